"""LLMEngine, the core loop: the scheduler, the block manager and an executor, stepped one batch at a time,
between input processing (`InputProcessor`: requests made ready) and output processing (`OutputProcessor`:
stops, outputs). A beam search runs here too, as requests of its own, so every caller sees it as one request.

Everything that drives it (the offline `LLM`, the asyncio `AsyncEngine`, the benchmarks) goes through
the methods here, never through the scheduler or the executor.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import gc
import json
import logging
import time
from typing import Any

from pagedserve.config import EngineConfig
from pagedserve.engine.beam_search import BeamSearch
from pagedserve.engine.input_processor import InputProcessor, Prompt, reasoning_tags
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.executors import Executor, WorkerFailure, make_executor
from pagedserve.lora.lora_request import LoRARequest
from pagedserve.lora.registry import AdapterRegistry
from pagedserve.lora.slots import AdapterSlots
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler.batch import StepBatch, StepOutput
from pagedserve.scheduler.block_manager import UNBOUNDED, BlockManager, chain_root, prefix_hashes
from pagedserve.scheduler.kv_groups import kv_groups
from pagedserve.scheduler.prefix_transfer import ExportOrder, PrefixExport, PrefixImport
from pagedserve.scheduler.request import Request, SequenceStatus
from pagedserve.scheduler.scheduler import Scheduler
from pagedserve.speculative.speculative_config import SpeculativeConfig
from pagedserve.workers.loader import ModelSource, resolve_model
from pagedserve.workers.models.lora_layers import read_model_adapter
from pagedserve.workers.models.model_config import ModelConfig

log = logging.getLogger(__name__)


class LLMEngine:
    """Owns the scheduler and the executor. `add_request` (or `inputs.make` then `enqueue`), then `step()` until
    nothing is left."""

    def __init__(self, config: EngineConfig) -> None:
        from pagedserve.workers.models.parallel import check_tp_size

        self.config = config
        self.source: ModelSource = resolve_model(config.model)
        self.model_config = ModelConfig.from_file(self.source.config_path)
        check_tp_size(self.model_config, config.tensor_parallel_size)
        self.max_model_len = self._max_model_len()
        self.eos_token_ids = self._eos_token_ids()
        self.tokenizer = _load_tokenizer(self.source)
        # before the workers start: a wrong setting fails fast
        reasoning = reasoning_tags(config.reasoning_parser, self.tokenizer, self.model_config.vocab_size)
        speculative = self._speculative()
        self.executor: Executor | None = make_executor(config, self.source, self.model_config, self.max_model_len)
        self.num_failures = 0
        self.workers_lost = False  # a step failed with its workers: the next `advance` replaces them first
        self.restarting_since: float | None = None  # time.monotonic() at the start of the replacement under way
        self.block_manager = BlockManager(self.executor.num_blocks, config.block_size, config.enable_prefix_caching,
                                          [group.window for group in kv_groups(self.model_config.layer_windows)],
                                          offload_blocks=self.executor.num_offload_blocks)
        # The workers' device, not this process's: a served engine's actor holds no GPU.
        device_type = self.executor.device_type
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.batched_tokens(device_type),
                                   self.max_model_len, config.scheduling_policy,
                                   self.model_config.long_rope_after, speculative,
                                   AdapterSlots(config.max_loras) if config.enable_lora else None)
        self.adapters = AdapterRegistry(config.enable_lora, functools.partial(
            read_model_adapter, config=self.model_config, max_rank=config.max_lora_rank))
        self.inputs = InputProcessor(self.model_config, self.tokenizer, self.eos_token_ids, reasoning,
                                     self.scheduler, self.adapters)
        self.grammars = self.inputs.grammars  # None without a tokenizer
        if self.grammars is not None:
            self.scheduler.grammar_proposals = self.grammars.valid_proposals
        self.outputs = OutputProcessor(self.tokenizer, self.scheduler, self.grammars)
        self._searches: dict[str, BeamSearch] = {}  # beam searches running, by request id
        self._beam_steps: dict[str, BeamSearch] = {}  # their steps' requests' ids -> the search
        # Async scheduling: the next step is scheduled and launched before this one's output is processed.
        self.schedules_ahead = config.schedules_ahead(device_type)
        self._in_flight: tuple[StepBatch, Any] | None = None  # a launched step not yet processed
        # K/V between replicas: exports read by processed steps (or why they failed), until taken; counts
        self.exports_done: dict[int, PrefixExport | RuntimeError] = {}
        self.num_exports = 0
        self.num_imports = 0
        self.num_import_failures = 0
        _freeze_startup_heap()

    # ---- requests ------------------------------------------------------------------------

    def enqueue(self, request: Request | BeamSearch) -> None:
        """Queue a request (or a beam search) from `inputs.make`: validation and queueing are apart so that a
        caller can validate a whole batch before any of it starts."""
        if isinstance(request, BeamSearch):
            if request.request_id in self._searches or request.request_id in self.scheduler.requests:
                raise ValueError(f"request_id={request.request_id!r} is already in use")
            self._searches[request.request_id] = request
            self._start_beam_step(request)
            return
        if request.request_id in self._searches:
            raise ValueError(f"request_id={request.request_id!r} is already in use")
        self.scheduler.add_request(request)

    def add_request(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None,
                    lora_request: LoRARequest | None = None, kv_import: PrefixImport | None = None) -> str:
        """`kv_import`: the prompt's prefix staged from another replica (`import_prefix`), which the request's
        prefix lookup may find."""
        try:
            request = self.inputs.make(prompt, params, request_id, lora_request)
            self.with_import(request, kv_import)
            self.enqueue(request)
        except BaseException:
            self.drop_import(kv_import)
            raise
        return request.request_id

    def with_import(self, request: Request | BeamSearch, kv_import: PrefixImport | None) -> None:
        """Give a made request its staged prefix (a beam search's steps take none: it is released)."""
        if isinstance(request, Request):
            request.kv_import = kv_import
        else:
            self.drop_import(kv_import)

    def drop_import(self, kv_import: PrefixImport | None) -> None:
        """An import no request will use: the next step releases its pages."""
        if kv_import is not None:
            self.scheduler.transfers.release(kv_import.import_id)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request (or a beam search: with its best beams so far); its last output, None if no such
        request is running."""
        search = self._searches.pop(request_id, None)
        if search is not None:
            self._drop_beam_steps(search)
            search.aborted = not search.done
            return self.outputs.beam_output(search)
        request = self.scheduler.abort(request_id)
        return self.outputs.build(request) if request is not None else None

    def has_unfinished_requests(self) -> bool:
        """Whether a step is due: a request to run, a K/V transfer for a step to carry, or workers to replace."""
        # A step still in flight for requests that all ended is processed by the next step, not waited for.
        return self.workers_lost or self.scheduler.has_work()

    def num_waiting_requests(self) -> int:
        return self.scheduler.num_waiting_requests()

    def output(self, request: Request | BeamSearch) -> RequestOutput:
        """The request's whole output so far; for a finished request, its last (build it once: it frees what
        the engine keeps for the request). A beam search's is its answer."""
        if isinstance(request, BeamSearch):
            return self.outputs.beam_output(request)
        return self.outputs.build(request)

    def cached_block_hashes(self) -> list[int]:
        """The chained hashes of the full blocks the prefix cache holds, in the pool or the second tier (what a
        prefix-aware router matches)."""
        bm = self.block_manager
        if bm.tier is None:
            return bm.pool.cached_hashes()
        return list(dict.fromkeys(bm.pool.cached_hashes() + bm.tier.cached_hashes()))

    # ---- K/V between replicas (`scheduler/prefix_transfer.py`) ---------------------------------

    def transfer_unsupported(self) -> str | None:
        """Why this engine cannot move K/V to or from another replica, or None where it can."""
        if not self.config.enable_prefix_caching:
            return "enable_prefix_caching is off"
        if self.block_manager.num_groups != 1:
            return "the model has sliding-window layers beside full ones (several KV-cache groups)"
        if not self.executor.takes_transfers:
            return "the worker actors run a Ray compiled graph, which takes no other calls"
        return None

    def export_prefix(self, token_ids: list[int], cache_salt: str | None = None, lora_id: int | None = None,
                      first_block: int = 0, num_blocks: int = UNBOUNDED) -> int:
        """Order an export of the prompt's cached full blocks from `first_block` on (at most `num_blocks`, as many in
        a row as the prefix cache holds): the next step reads them. Returns its id, under which `exports_done`
        holds the `PrefixExport` once that step is processed (a RuntimeError if it failed)."""
        reason = self.transfer_unsupported()
        if reason is not None:
            raise RuntimeError(f"K/V cannot be exported: {reason}")
        order = ExportOrder(tuple(token_ids), chain_root(cache_salt, adapter=lora_id), first_block, num_blocks)
        return self.scheduler.transfers.order_export(order)

    def cached_prefix_blocks(self, token_ids: list[int], cache_salt: str | None = None,
                             lora_id: int | None = None) -> int:
        """How many of the prompt's full blocks, from the first, the prefix cache holds (pool or second tier)."""
        order = ExportOrder(tuple(token_ids), chain_root(cache_salt, adapter=lora_id), 0, UNBOUNDED)
        return len(self.block_manager.export_blocks(order)[0])

    def begin_import(self, export: PrefixExport, token_ids: list[int], cache_salt: str | None = None,
                     lora_id: int | None = None) -> int | None:
        """An id to stage `export` under (`stage_import`), once its hashes are checked to be this prompt's blocks as
        this engine files them; None where it holds none of them (nothing to fetch) or other blocks."""
        hashes = prefix_hashes(token_ids, self.config.block_size, cache_salt, lora_id)
        wanted = tuple(hashes[export.first_block:export.first_block + len(export.hashes)])
        if not export.hashes or self.transfer_unsupported() is not None:
            return None
        if wanted != export.hashes:
            log.warning("a K/V export of %d blocks from block %d holds other blocks than the prompt's; recomputing",
                        len(export.hashes), export.first_block)
            self.num_import_failures += 1
            return None
        return self.scheduler.transfers.begin_import()

    def stage_import(self, import_id: int, export: PrefixExport) -> None:
        """Every rank keeps its pages of `export` (blocking; may run off the engine's thread: it touches only the
        workers). Raises where a rank cannot (the pages are lost, or another layout's)."""
        self.executor.stage_import(import_id, export.pages)

    def end_import(self, import_id: int, export: PrefixExport, error: BaseException | None) -> PrefixImport | None:
        """The staged import, for `add_request`; None, its pages released, where staging failed with `error`."""
        if error is not None:
            log.warning("fetching %d KV blocks from another replica failed, recomputing them: %s",
                        len(export.hashes), error)
            self.num_import_failures += 1
            self.scheduler.transfers.release(import_id)
            return None
        self.num_imports += 1
        return PrefixImport(import_id, export.first_block, export.hashes)

    def import_prefix(self, export: PrefixExport, token_ids: list[int], cache_salt: str | None = None,
                      lora_id: int | None = None) -> PrefixImport | None:
        """`begin_import`, `stage_import` and `end_import` in turn."""
        import_id = self.begin_import(export, token_ids, cache_salt, lora_id)
        if import_id is None:
            return None
        try:
            self.stage_import(import_id, export)
        except Exception as e:
            return self.end_import(import_id, export, e)
        return self.end_import(import_id, export, None)

    def _take_exports(self, batch: StepBatch) -> None:
        """The exports a processed step read: each rank's pages, handed out by the executor."""
        transfers = self.scheduler.transfers
        for export_id, _ in batch.kv_exports:
            first_block, hashes = transfers.sent.pop(export_id)
            self.exports_done[export_id] = PrefixExport(first_block, hashes, self.executor.take_export(export_id))
            self.num_exports += bool(hashes)

    def _fail_exports(self, error: str) -> None:
        """A step failed: every export ordered or read fails, and what the workers may hold of them is dropped."""
        transfers = self.scheduler.transfers
        read = list(transfers.sent)
        for export_id in transfers.fail_exports():
            self.exports_done[export_id] = RuntimeError(f"the step reading the export failed: {error}")
        for export_id in read:
            try:
                self.executor.take_export(export_id)
            except Exception:  # not read there, or the workers are gone
                pass

    # ---- beam searches -------------------------------------------------------------------

    def _start_beam_step(self, search: BeamSearch) -> None:
        """Queue one request per running beam, each one token long (see `engine/beam_search.py`)."""
        params = search.step_params()
        step = [self.inputs.make_request(ids, params, f"{search.request_id}#{search.num_steps}.{b}", search.lora)
                for b, ids in enumerate(search.step_prompts())]
        search.start_step([r.request_id for r in step])
        for request in step:
            request.final_output_only = True
            self._beam_steps[request.request_id] = search
            self.scheduler.add_request(request)

    def _with_beam_searches(self, changed: list[Request]) -> list[Request | BeamSearch]:
        """A step's changed requests as callers see them: a beam search's step requests taken by their search,
        which is in the list when it has ended."""
        if not self._beam_steps:
            return changed
        seen: list[Request | BeamSearch] = []
        for request in changed:
            search = self._beam_steps.get(request.request_id)
            if search is None:
                seen.append(request)
            elif request.finished:
                del self._beam_steps[request.request_id]
                if search.take(self.outputs.build(request)):
                    self._end_or_step(search, seen)
        return seen

    def _end_or_step(self, search: BeamSearch, seen: list[Request | BeamSearch]) -> None:
        if not search.finished:
            self._start_beam_step(search)
            return
        self._drop_beam_steps(search)  # a failed step: the search's other requests are dropped
        del self._searches[search.request_id]
        seen.append(search)

    def _drop_beam_steps(self, search: BeamSearch) -> None:
        """Abort the search's step requests still running."""
        for step_id in list(search.step_beams):
            self._beam_steps.pop(step_id, None)
            step = self.scheduler.abort(step_id)
            if step is not None:
                self.outputs.build(step)  # frees what output processing keeps for it

    # ---- the loop ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; outputs of the requests that got tokens or ended (a request with `final_output_only`
        only when it finishes). Never raises for a failed step: the requests it ended come back with `error`
        set."""
        return [self.output(r) for r in self.advance() if r.finished or not r.final_output_only]

    def advance(self) -> list[Request | BeamSearch]:
        """Run one step; the requests it changed: those that got tokens, and those it ended (`error` set where
        a failed step ended them), and a beam search when it ends. No output is built: `output` builds one when
        it is wanted, and must once for each finished request, which frees what the engine keeps for it (`step`
        does both).

        With async scheduling the step after it is launched first, to run while this one's output is
        processed. Never raises for a failed step."""
        if self.workers_lost:
            self._restart_workers()
        try:
            start = time.perf_counter()
            launched = self._launch()
            if launched is None:
                return []
            batch, handle = launched
            output = self.executor.collect(handle)
            self._measure(batch, time.perf_counter() - start)
            changed = self._process(batch, output)
            self._take_exports(batch)
            self._send_late_masks()
            return changed
        except Exception as e:
            return self._with_beam_searches(self._fail_step(e))

    async def advance_async(self) -> list[Request | BeamSearch]:
        """`advance` for an event loop: requests can be added and aborted while the workers compute, or while
        new ones replace them (off the event loop: requests that arrive meanwhile wait in the queue, holding no
        blocks)."""
        if self.workers_lost:
            await asyncio.to_thread(self._restart_workers)
        try:
            start = time.perf_counter()
            launched = self._launch()
            if launched is None:
                return []
            batch, handle = launched
            output = await self.executor.collect_async(handle)
            self._measure(batch, time.perf_counter() - start)
            changed = self._process(batch, output)
            self._take_exports(batch)
            self._send_late_masks()
            return changed
        except Exception as e:
            return self._with_beam_searches(self._fail_step(e))

    def _launch(self) -> tuple[StepBatch, Any] | None:
        """The step to process now (launched here if none is in flight), with the step after it launched
        behind it where the scheduler allows: the device then has work queued while the host processes."""
        if self._in_flight is None:
            batch = self._schedule()
            if batch is None:
                return None
            self._in_flight = (batch, self.executor.launch(batch))
        current, self._in_flight = self._in_flight, None
        if self.schedules_ahead and self.scheduler.can_schedule_ahead(current[0], self.executor.takes_late_masks):
            ahead = self._schedule()
            if ahead is not None:
                self._in_flight = (ahead, self.executor.launch(ahead))
        return current

    def _measure(self, batch: StepBatch, seconds: float) -> None:
        """With speculative decoding, the time of a step that ran alone (none launched behind it), for the cost of
        verifying proposals (`speculative/policy.py`)."""
        if self.scheduler.speculative is not None and self._in_flight is None:
            self.scheduler.step_cost.observe(batch.num_tokens, seconds)

    def _send_late_masks(self) -> None:
        """Once the step before it is processed, give the step in flight the grammar masks that waited for
        that step's draws (`StepBatch.late_masks`): its forward ran meanwhile, and it draws now."""
        if self._in_flight is not None and self._in_flight[0].late_masks:
            batch, handle = self._in_flight
            self.executor.sample(handle, self.grammars.late_masks(batch, self.scheduler.seqs))

    def _schedule(self) -> StepBatch | None:
        batch = self.scheduler.schedule()
        if batch is not None and self.grammars is not None and self.grammars.in_use:
            self.grammars.fill_masks(batch, self.scheduler.running)
        return batch

    def _fail_step(self, error: Exception) -> list[Request]:
        """The one failure path of a step. Returns the requests it ended (`error` set), which their callers hear of
        at once; where the workers failed, the next step replaces them first (`workers_lost`).

        A worker failure loses the KV of every request that holds blocks: those that produced tokens end with the
        error, those that had not (in their prefill) go back to the queue once, and queued ones wait for new
        workers. Any other error is a bug of the engine, and nothing says which request caused it, so every
        request ends with it."""
        if self._in_flight is not None and self._in_flight[0].late_masks:
            try:  # let it draw (unmasked, discarded): a worker waiting for masks would hold the steps after it
                self.executor.sample(self._in_flight[1], [None] * len(self._in_flight[0].late_masks))
            except Exception:  # the workers are gone: they are replaced below
                log.debug("releasing a step that waited for grammar masks failed", exc_info=True)
        self._in_flight = None  # its output, if it comes, is for requests ended here
        self.scheduler.discard_pending()
        self._fail_exports(str(error))
        lost_workers = isinstance(error, WorkerFailure)
        if lost_workers:
            log.error("step failed, failing in-flight requests and restarting workers: %s", error)
            self.num_failures += 1
            message = str(error)
        else:
            log.error("engine step failed, failing every request", exc_info=error)
            message = f"internal engine error: {type(error).__name__}: {error}"
        ended = []
        for request in list(self.scheduler.requests.values()):
            if lost_workers and not any(seq.status == SequenceStatus.RUNNING for seq in request.sequences):
                continue  # holds no blocks, computed nothing: it simply waits for the new workers
            if lost_workers and request.num_output_tokens == 0 and not request.requeued_after_failure:
                # Nothing of it reached its caller: it runs again from its prompt, as a queued one does.
                request.requeued_after_failure = True
                self.scheduler.requeue(request)
                continue
            request.error = message
            for seq in request.sequences:
                self.scheduler.finish(seq, "error")
            ended.append(request)
        # New workers hold nothing (no cached prefix, no adapter). Where the workers stay, every request has ended,
        # and the prefix cache may name K/V the failed step (or one scheduled ahead of it) never wrote: forget it
        # all, as new workers' empty pools would (and the adapters its loads may have left half written).
        self.scheduler.reset_worker_state()
        self.workers_lost = lost_workers
        return ended

    def _restart_workers(self) -> None:
        self.restarting_since = time.monotonic()
        try:
            self.executor.restart()
        except Exception:  # then the next step fails at once with WorkerFailure, and tries again
            log.exception("restarting the workers failed")
        finally:
            self.workers_lost = False
            self.restarting_since = None

    def _process(self, batch: StepBatch, output: StepOutput) -> list[Request | BeamSearch]:
        return self._with_beam_searches(self.outputs.process(self.scheduler.update(batch, output)))

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
            **self._speculation_stats(),
            **self._adapter_stats(),
            **self._offload_stats(),
            "kv_transfer_hits": bm.transfer_hits,
            "kv_transfer_imports": self.num_imports,
            "kv_transfer_failures": self.num_import_failures,
            "kv_transfer_exports": self.num_exports,
            "kv_transfer_staged": len(self.scheduler.transfers.staged),  # imports whose pages workers may hold
        }

    def _offload_stats(self) -> dict[str, Any]:
        """With a second tier: its blocks, those in use, the prefix-cache tokens found there, and its copies."""
        tier = self.block_manager.tier
        if tier is None:
            return {}
        return {"offload_total_blocks": tier.num_slots, "offload_used_blocks": tier.num_used_slots,
                "offload_hits": self.block_manager.offload_hits, "offload_saved_blocks": tier.saved_blocks,
                "offload_restored_blocks": tier.restored_blocks}

    def _adapter_stats(self) -> dict[str, Any]:
        """With LoRA on: the ids of the adapters in the workers' slots (what a router prefers a replica for)."""
        slots = self.scheduler.adapter_slots
        return {} if slots is None else {"adapters": [a.lora_int_id for a in slots.loaded()]}

    def _speculation_stats(self) -> dict[str, Any]:
        """Speculative decoding's counts: rows that verified proposals, tokens proposed and kept, the share kept,
        and the tokens a verifying row emits on average (its kept proposals and the one after them)."""
        if self.scheduler.speculative is None:
            return {}
        rows, proposed = self.scheduler.num_spec_rows, self.scheduler.num_spec_proposed
        accepted = self.scheduler.num_spec_accepted
        return {"spec_num_rows": rows, "spec_num_proposed_tokens": proposed,
                "spec_num_accepted_tokens": accepted,
                "spec_acceptance_rate": accepted / proposed if proposed else 0.0,
                "spec_mean_accepted_length": (accepted + rows) / rows if rows else 0.0}

    def model_info(self) -> dict[str, Any]:
        return {"model": self.source.name, "max_model_len": self.max_model_len,
                "block_size": self.config.block_size, "tensor_parallel_size": self.config.tensor_parallel_size,
                "num_kv_blocks": self.block_manager.num_total_blocks, "vocab_size": self.model_config.vocab_size,
                "eos_token_ids": list(self.eos_token_ids)}

    def worker_pids(self) -> list[int]:
        return self.executor.worker_pids()

    def shutdown(self) -> None:
        """Stop the workers and let go of them. Idempotent."""
        if self.executor is None:
            return
        self._in_flight = None
        self.executor.shutdown()
        # Dropped, not kept: the model and the KV pool are freed by reference counting now, even while
        # the start-up heap stays frozen for another engine of this process.
        self.executor = None
        _release_startup_heap()

    def _speculative(self) -> SpeculativeConfig | None:
        """The speculative decoding settings, refused for a model whose rotary frequencies follow the sequence's
        length (dynamic NTK, LongRoPE): a step's verified tokens share one length, where one at a time each has
        its own."""
        speculative = self.config.speculative()
        scaling = self.model_config.rope_scaling
        if speculative is not None and scaling and scaling["rope_type"] in ("dynamic", "longrope"):
            raise ValueError(f"speculative_config with rope_scaling.rope_type={scaling['rope_type']!r}: its "
                             "frequencies depend on each token's sequence length, which one verification step "
                             "cannot give the tokens it checks")
        if speculative is not None and speculative.method == "draft_model":
            self._check_draft(speculative.model)
        return speculative

    def _check_draft(self, path: str) -> None:
        """Refuse, naming the setting, a draft model the workers could not run beside this model: one whose tokens
        are not this model's, or that the draft's KV pool (the target's block ids, its own layers) cannot serve."""
        draft = ModelConfig.from_file(resolve_model(path).config_path)
        name = f"speculative_config.model={path!r}"
        vocab = self.model_config.vocab_size
        if draft.vocab_size != vocab:
            raise ValueError(f"{name} has a vocabulary of {draft.vocab_size} tokens, the model {vocab}: a draft "
                             "must share the model's tokenizer")
        for who, config in (("the model", self.model_config), ("the draft", draft)):
            if len(kv_groups(config.layer_windows)) > 1 or config.rope_scaling and config.rope_scaling[
                    "rope_type"] in ("dynamic", "longrope"):
                raise ValueError(f"{name}: {who} has sliding-window layers beside full ones, or rotary frequencies "
                                 "that follow the sequence's length; a draft shares one block table per sequence "
                                 "with the model, and needs neither")
        limit = draft.max_position_embeddings
        if limit < self.max_model_len:
            raise ValueError(f"{name} has {limit} positions, fewer than max_model_len={self.max_model_len}")

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


_live_engines = 0
_exit_hook = False


def _freeze_startup_heap() -> None:
    """Move every object alive after start-up (torch, transformers, triton, the model) out of the
    garbage collector's sight. Otherwise each full collection walks those ~350k-600k objects, a stall
    of the whole step loop (190 ms on the 2-core CI machine); see benchmarks/RESULTS.md."""
    global _live_engines, _exit_hook
    gc.collect()
    gc.freeze()
    _live_engines += 1
    if not _exit_hook:
        _exit_hook = True
        # Unfrozen at exit so interpreter shutdown still finalises them (extension modules such as
        # triton's report frozen objects as leaks otherwise).
        atexit.register(gc.unfreeze)


def _release_startup_heap() -> None:
    """When the last engine stops, hand the frozen heap back to the collector (a cycle through a stopped
    engine can then be collected). Not before: another engine's step loop still wants it out of sight."""
    global _live_engines
    _live_engines -= 1
    if _live_engines == 0:
        gc.unfreeze()


def _load_tokenizer(source: ModelSource):
    if source.tokenizer_dir is None:
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source.tokenizer_dir)
    # A tokenizer.json may carry truncation or padding settings. transformers' encode clears them on its
    # first call (it never truncates or pads unless asked), which changes the Rust tokenizer in place, and that
    # fails ("Already borrowed") while another thread decodes with it: requests are tokenized on a thread of
    # their own beside the step loop's detokenizing (AsyncEngine). Cleared once here, encode only reads.
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and getattr(backend, "truncation", None) is not None:
        backend.no_truncation()
    if backend is not None and getattr(backend, "padding", None) is not None:
        backend.no_padding()
    return tokenizer
