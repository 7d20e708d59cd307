"""LLMEngine (scheduler + worker loop) and the offline `LLM` API."""

from __future__ import annotations

import asyncio
import atexit
import gc
import itertools
import json
import logging
from collections.abc import Sequence as Seq
from dataclasses import asdict
from typing import Any

from pagedserve.config import EngineConfig
from pagedserve.detokenizer import Detokenizer
from pagedserve.executor import WorkerFailure, make_executor
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler.block_manager import BlockManager
from pagedserve.scheduler.request import Request, SequenceStatus
from pagedserve.scheduler.scheduler import Scheduler
from pagedserve.workers.loader import ModelSource, resolve_model
from pagedserve.workers.models.config import ModelConfig

log = logging.getLogger(__name__)

Prompt = str | list[int]


class LLMEngine:
    """Owns the scheduler and the executor. `add_request` then `step()` until nothing is left."""

    def __init__(self, config: EngineConfig) -> None:
        from pagedserve.workers.models.parallel import check_tp_size

        self.config = config
        self.source: ModelSource = resolve_model(config.model)
        self.model_config = ModelConfig.from_file(self.source.config_path)
        check_tp_size(self.model_config, config.tensor_parallel_size)
        self.max_model_len = self._max_model_len()
        self.eos_token_ids = self._eos_token_ids()
        self.tokenizer = _load_tokenizer(self.source)
        self.executor = make_executor(config, self.source, self.model_config, self.max_model_len)
        self.num_failures = 0
        self.block_manager = BlockManager(self.executor.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.batched_tokens(config.torch_device()), self.max_model_len)
        self.detokenizer = Detokenizer(self.tokenizer)
        self._ids = itertools.count()
        _freeze_startup_heap()

    def _reset_blocks(self) -> None:
        """A fresh block manager: the new workers' pools hold nothing, so no cached prefix survives.
        Only called when no sequence holds blocks (in-flight ones were failed; new ones still wait)."""
        old = self.block_manager
        self.block_manager = BlockManager(self.executor.num_blocks, self.config.block_size,
                                          self.config.enable_prefix_caching)
        self.block_manager.prefix_cache_queries = old.prefix_cache_queries
        self.block_manager.prefix_cache_hits = old.prefix_cache_hits
        self.scheduler.block_manager = self.block_manager

    # ---- requests ------------------------------------------------------------------------

    def make_request(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None) -> Request:
        """Validate and tokenize; raises ValueError naming the bad field. Adds nothing."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError("prompt is text but this model has no tokenizer: pass token ids")
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list | tuple):
            token_ids = list(prompt)
            vocab = self.model_config.vocab_size
            for t in token_ids:
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                    raise ValueError(f"prompt_token_ids contains {t!r}, outside the vocabulary [0, {vocab})")
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("prompt is empty (no tokens)")
        request_id = str(next(self._ids)) if request_id is None else request_id
        request = Request(request_id, token_ids, params, frozenset(self.eos_token_ids),
                          prompt=prompt if isinstance(prompt, str) else None)
        self.scheduler.check_admissible(request)
        return request

    def add_request(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None) -> str:
        request = self.make_request(prompt, params, request_id)
        self.scheduler.add_request(request)
        return request.request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.abort(request_id)
        return self._output(request) if request is not None else None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the loop ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; outputs of the requests that got tokens (finished ones last time)."""
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        try:
            output = self.executor.execute(batch)
        except WorkerFailure as e:
            return self._recover(e)
        return self._process(batch, output)

    async def step_async(self) -> list[RequestOutput]:
        """`step` for an event loop: requests can be added and aborted while the workers compute."""
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        try:
            if hasattr(self.executor, "execute_async"):
                output = await self.executor.execute_async(batch)
            else:
                output = await asyncio.to_thread(self.executor.execute, batch)
        except WorkerFailure as e:
            outputs = self._fail_in_flight(e)
            # Off the event loop: requests that arrive meanwhile wait in the queue, holding no blocks.
            await asyncio.to_thread(self.executor.restart)
            self._reset_blocks()
            return outputs
        return self._process(batch, output)

    def _recover(self, error: WorkerFailure) -> list[RequestOutput]:
        outputs = self._fail_in_flight(error)
        self.executor.restart()
        self._reset_blocks()
        return outputs

    def _fail_in_flight(self, error: WorkerFailure) -> list[RequestOutput]:
        """End every request that holds blocks with the error; queued ones stay queued."""
        log.error("step failed, failing in-flight requests and restarting workers: %s", error)
        self.num_failures += 1
        outputs = []
        for request in list(self.scheduler.requests.values()):
            if not any(seq.status == SequenceStatus.RUNNING for seq in request.sequences):
                continue  # holds no blocks, computed nothing: it simply waits for the new workers
            for seq in request.sequences:
                self.scheduler.finish(seq, "error")
            out = self._output(request)
            out.error = str(error)
            outputs.append(out)
        return outputs

    def _process(self, batch, output) -> list[RequestOutput]:
        updated = self.scheduler.update(batch, output)
        requests: dict[str, Request] = {}
        for seq in updated:
            params = seq.request.params
            if self.detokenizer.update(seq.seq_id, seq.token_ids, seq.num_prompt_tokens,
                                       params.skip_special_tokens, params.stop) and not seq.finished:
                self.scheduler.finish(seq, "stop")
            requests[seq.request.request_id] = seq.request
        return [self._output(r) for r in requests.values()]

    def _output(self, request: Request) -> RequestOutput:
        outputs = [
            CompletionOutput(
                index=seq.sample_index,
                text=self.detokenizer.text(seq.seq_id),
                token_ids=seq.output_token_ids,  # a fresh slice
                finish_reason=seq.finish_reason,
                logprobs=list(seq.logprobs) if request.params.logprobs is not None else None,
            )
            for seq in sorted(request.sequences, key=lambda s: s.sample_index)
        ]
        finished = request.finished
        if finished:
            for seq in request.sequences:
                self.detokenizer.release(seq.seq_id)
        # The request's prompt ids are never mutated (sequences copy them), so they are shared, not copied.
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outputs, finished)

    # ---- numbers -------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        bm = self.block_manager
        return {
            "num_total_blocks": bm.num_total_blocks,
            "num_free_blocks": bm.num_free_blocks,
            "num_cached_blocks": bm.pool.num_cached_blocks,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_running": self.scheduler.num_running_requests(),
            "num_waiting": self.scheduler.num_waiting_requests(),
            "block_size": self.config.block_size,
            "max_model_len": self.max_model_len,
            "tensor_parallel_size": self.config.tensor_parallel_size,
            "num_worker_failures": self.num_failures,
        }

    def shutdown(self) -> None:
        self.executor.shutdown()
        gc.unfreeze()  # this engine was frozen with the start-up heap: let a cycle through it be collected

    def _max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        scaling = self.model_config.rope_scaling
        # Linear and dynamic scaling stretch the trained length; llama3 configs already state the long one.
        if scaling and scaling["rope_type"] in ("linear", "dynamic"):
            limit = int(limit * scaling.get("factor", 1.0))
        if self.config.max_model_len is None:
            return limit
        if self.config.max_model_len > limit:
            raise ValueError(f"max_model_len={self.config.max_model_len} exceeds the model's {limit} positions")
        return self.config.max_model_len

    def _eos_token_ids(self) -> tuple[int, ...]:
        # As transformers' generate: generation_config.json if the checkpoint has one, else config.json.
        gen_path = self.source.config_path.parent / "generation_config.json"
        if self.source.weights_dir is not None and gen_path.is_file():
            eos = json.loads(gen_path.read_text()).get("eos_token_id")
            if eos is not None:
                return tuple(eos) if isinstance(eos, list) else (eos,)
        return self.model_config.eos_token_ids


_heap_frozen = False


def _freeze_startup_heap() -> None:
    """Move every object alive after start-up (torch, transformers, triton, the model) out of the
    garbage collector's sight. Otherwise each full collection walks those ~350k-600k objects, a stall
    of the whole step loop (190 ms on the 2-core CI machine); see benchmarks/RESULTS.md."""
    global _heap_frozen
    gc.collect()
    gc.freeze()
    if not _heap_frozen:
        _heap_frozen = True
        # Unfrozen at exit so interpreter shutdown still finalises them (extension modules such as
        # triton's report frozen objects as leaks otherwise).
        atexit.register(gc.unfreeze)


def _load_tokenizer(source: ModelSource):
    if source.tokenizer_dir is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source.tokenizer_dir)


class LLM:
    """Offline batch API: `LLM(model).generate(prompts, SamplingParams(...))`."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run all prompts to completion; outputs in input order. Validates every prompt before
        starting any, so a bad one raises ValueError and leaves the engine as it was."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (list(sampling_params) if isinstance(sampling_params, list | tuple)
                       else [sampling_params] * len(prompts))
        if len(params_list) != len(prompts):
            raise ValueError(f"sampling_params has {len(params_list)} entries for {len(prompts)} prompts")
        engine = self.engine
        requests = []
        for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
            try:
                requests.append(engine.make_request(prompt, params))
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from None
        for r in requests:
            engine.scheduler.add_request(r)
        order = {r.request_id: i for i, r in enumerate(requests)}
        results: list[RequestOutput | None] = [None] * len(requests)
        try:
            while any(x is None for x in results):
                for out in engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
        finally:
            for r in requests:
                if results[order[r.request_id]] is None:
                    engine.abort_request(r.request_id)
        errors = [o.error for o in results if o.error]
        if errors:
            raise WorkerFailure(f"{len(errors)} of {len(results)} requests failed: {errors[0]}")
        return results  # type: ignore[return-value]

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation (or a list of them) and generate."""
        if self.engine.tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template; this model has none")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in conversations:
            for m in conv:
                if not isinstance(m, dict) or "role" not in m or "content" not in m:
                    raise ValueError(f"messages entries need 'role' and 'content', got {m!r}")
            ids = self.engine.tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                                            tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            prompts.append(list(ids))
        return self.generate(prompts, sampling_params)

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def shutdown(self) -> None:
        """Stop the worker actors (executor="ray"); a no-op in process."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def config(self) -> dict[str, Any]:
        return asdict(self.engine.config)
