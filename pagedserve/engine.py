"""LLMEngine: the scheduler, the block manager and an executor, stepped one batch at a time.

Everything that drives it (the offline `LLM`, the asyncio `AsyncEngine`, the benchmarks) goes through
the methods here, never through the scheduler or the executor.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import gc
import itertools
import json
import logging
from typing import Any

from pagedserve.beam_search import BeamSearch, check_width
from pagedserve.chat import ChatOptions, ChatPlan, ChatTemplate
from pagedserve.config import EngineConfig
from pagedserve.detokenizer import Detokenizer
from pagedserve.executors import Executor, WorkerFailure, make_executor
from pagedserve.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagedserve.reasoning import THINK_CLOSE, THINK_OPEN, ReasoningStart, ReasoningTags
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler.batch import StepBatch, StepOutput
from pagedserve.scheduler.block_manager import BlockManager
from pagedserve.scheduler.request import Request, SequenceStatus
from pagedserve.scheduler.scheduler import Scheduler
from pagedserve.structured_output import GrammarManager
from pagedserve.tool_calls import Tool, parse_tool_choice, parse_tools
from pagedserve.tool_calls import plan as plan_tool_calls
from pagedserve.workers.loader import ModelSource, resolve_model
from pagedserve.workers.models.config import ModelConfig

log = logging.getLogger(__name__)

# A text, token ids, or vLLM's prompt dicts: {"prompt": text} and {"prompt_token_ids": ids}
Prompt = str | list[int] | dict[str, Any]
_PROMPT_KEYS = ("prompt", "prompt_token_ids")


def prompt_of(prompt: Prompt) -> str | list[int]:
    """The text or token ids a prompt holds (vLLM's dicts unwrapped); ValueError naming a key that cannot
    be honoured (multimodal data: this server serves text)."""
    if not isinstance(prompt, dict):
        return prompt
    unknown = sorted(set(prompt) - set(_PROMPT_KEYS))
    if unknown:
        raise ValueError(f"prompt has keys {unknown} that are not supported (a prompt dict holds one of "
                         f"{', '.join(_PROMPT_KEYS)})")
    if len(prompt) != 1:
        raise ValueError(f"prompt: give one of {', '.join(_PROMPT_KEYS)}, not {len(prompt)}")
    (key, value), = prompt.items()
    if key == "prompt" and not isinstance(value, str):
        raise ValueError(f"prompt.prompt must be a string, got {type(value).__name__}")
    if key == "prompt_token_ids" and not isinstance(value, list | tuple):
        raise ValueError(f"prompt.prompt_token_ids must be a list of token ids, got {type(value).__name__}")
    return value


class RequestFailed(RuntimeError):
    """A failed step ended the request; the engine has recovered and serves new requests."""


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
        self.reasoning_tags = self._reasoning_tags()  # before the workers start: a wrong setting fails fast
        self.executor: Executor | None = make_executor(config, self.source, self.model_config, self.max_model_len)
        self.num_failures = 0
        self.block_manager = BlockManager(self.executor.num_blocks, config.block_size, config.enable_prefix_caching)
        # The workers' device, not this process's: a served engine's actor holds no GPU.
        device_type = self.executor.device_type
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.batched_tokens(device_type),
                                   self.max_model_len, config.scheduling_policy)
        self.detokenizer = Detokenizer(self.tokenizer)
        self._grammars: GrammarManager | None = None  # made on the first constrained request
        self._template: ChatTemplate | None = None  # made on the first chat request
        self._ids = itertools.count()
        # Async scheduling: the next step is scheduled and launched before this one's output is processed.
        self.schedules_ahead = config.schedules_ahead(device_type)
        self._in_flight: tuple[StepBatch, Any] | None = None  # a launched step not yet processed
        _freeze_startup_heap()

    # ---- requests ------------------------------------------------------------------------

    def make_request(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None) -> Request:
        """Validate and tokenize; raises ValueError naming the bad field. Adds nothing."""
        _check_params(params)
        params.validate()
        if params.use_beam_search:
            raise ValueError("use_beam_search: a beam search runs as requests of its own (make_beam_search; "
                             "LLM.generate and AsyncEngine.generate run it)")
        for name in ("stop", "bad_words"):
            if getattr(params, name) and self.tokenizer is None:
                raise ValueError(f"{name}: words need a tokenizer, and this model has none (name tokens by id: "
                                 "stop_token_ids, logit_bias)")
        prompt = prompt_of(prompt)
        token_ids = self.encode_prompt(prompt)
        keep = params.truncate_prompt_tokens
        if keep == -1:
            keep = self.scheduler.prompt_room(params.max_tokens)
            if keep < 1:
                raise ValueError(f"max_tokens={params.max_tokens} leaves no room for a prompt in a context of "
                                 f"{keep + (params.max_tokens or 1)} tokens (truncate_prompt_tokens=-1)")
        if keep is not None:
            token_ids = token_ids[-keep:]
        for name, ids in params.token_ids_named().items():
            self._check_token_ids(name, ids)
        constraint = params.structured_outputs  # compiled now: a ValueError here, not mid-generation
        grammar = self.grammars().compile(constraint) if constraint is not None else None
        bad_words = self._bad_words_token_ids(params.bad_words)
        if params.allowed_token_ids is not None and {ids[0] for ids in bad_words if len(ids) == 1}.issuperset(
                params.allowed_token_ids):
            raise ValueError("bad_words ban every token of allowed_token_ids: nothing would be left to draw")
        request_id = str(next(self._ids)) if request_id is None else request_id
        request = Request(request_id, token_ids, params, frozenset(self.eos_token_ids),
                          prompt=prompt if isinstance(prompt, str) else None, bad_words_token_ids=bad_words,
                          grammar=grammar)
        self.scheduler.check_admissible(request)
        return request

    def make_beam_search(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None) -> BeamSearch:
        """A beam search's start (`params.use_beam_search`), validated as `make_request` validates a request:
        the prompt tokenized and cut as truncate_prompt_tokens says, and checked to fit with max_tokens.
        ValueError naming the field."""
        _check_params(params)
        params.validate()
        ends = frozenset(params.stop_token_ids) | frozenset(() if params.ignore_eos else self.eos_token_ids)
        check_width(params.n, len(ends))
        first = self.make_request(prompt, dataclasses.replace(params, n=1, use_beam_search=False, length_penalty=1.0),
                                  request_id)
        prompt_ids = first.prompt_token_ids
        room = self.scheduler.prompt_room(None) + 1 - len(prompt_ids)  # the context left for the output
        return BeamSearch(first.request_id, first.prompt, prompt_ids, params, params.max_tokens or room, ends)

    def beam_output(self, search: BeamSearch, aborted: bool = False) -> RequestOutput:
        """A beam search's answer (`BeamSearch.output`), its texts decoded as a request's output is."""
        prompt_ids, skip = search.prompt_token_ids, search.params.skip_special_tokens
        return search.output(lambda ids: self.detokenizer.text_of(prompt_ids + ids, len(prompt_ids), skip), aborted)

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as the token sequences that spell it: alone, and after a space (mid-text, where a
        tokenizer folds the space into the word's first token), as vLLM tokenizes them."""
        out: list[list[int]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """A prompt's token ids: text through the tokenizer, ids checked against the vocabulary. ValueError
        naming what is wrong."""
        prompt = prompt_of(prompt)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError("prompt is text but this model has no tokenizer: pass token ids")
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list | tuple):
            token_ids = list(prompt)
            self._check_token_ids("prompt_token_ids", token_ids)
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("prompt is empty (no tokens)")
        return token_ids

    def enqueue(self, request: Request) -> None:
        """Queue a request from `make_request`: validation and queueing are apart so that a caller can
        validate a whole batch before any of it starts."""
        self.scheduler.add_request(request)

    def add_request(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None) -> str:
        request = self.make_request(prompt, params, request_id)
        self.enqueue(request)
        return request.request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.abort(request_id)
        return self.output(request) if request is not None else None

    def has_unfinished_requests(self) -> bool:
        # A step still in flight for requests that all ended is processed by the next step, not waited for.
        return self.scheduler.has_unfinished()

    def num_waiting_requests(self) -> int:
        return self.scheduler.num_waiting_requests()

    def _reasoning_tags(self) -> ReasoningTags | None:
        """The reasoning parser and the token ids of `<think>` and `</think>`, when one is set; ValueError
        naming it if this model's tokenizer does not write them as tokens of their own that its text keeps."""
        parser = self.config.reasoning_parser
        if parser is None:
            return None
        if self.tokenizer is None:
            raise ValueError(f"reasoning_parser={parser!r} needs a tokenizer, and this model has none")
        ids = []
        for tag in (THINK_OPEN, THINK_CLOSE):
            encoded = self.tokenizer.encode(tag, add_special_tokens=False)
            if len(encoded) != 1 or encoded[0] >= self.model_config.vocab_size:
                raise ValueError(f"reasoning_parser={parser!r} is for models that write their reasoning between "
                                 f"{THINK_OPEN} and {THINK_CLOSE} tokens; this model's tokenizer has no {tag} token")
            if encoded[0] in self.tokenizer.all_special_ids:
                raise ValueError(f"reasoning_parser={parser!r}: this model's tokenizer counts {tag} as a special "
                                 "token, which outputs drop from their text (skip_special_tokens)")
            ids.append(encoded[0])
        return ReasoningTags(parser, *ids)

    def reasoning_start(self, prompt_token_ids: list[int]) -> ReasoningStart | None:
        """Where a sample of the prompt begins (see `pagedserve.reasoning`); None without a reasoning parser."""
        if self.reasoning_tags is None:
            return None
        return self.reasoning_tags.start(prompt_token_ids, self.tokenizer.decode)

    def chat_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    options: ChatOptions | None = None) -> list[int]:
        """The model's chat template applied to `messages` (and `tools`, OpenAI's shapes), as token ids;
        ValueError naming what is wrong."""
        return self._chat_template().render(messages, parse_tools(tools), options)

    def chat_plan(self, messages: list[dict[str, Any]], params: SamplingParams,
                  tools: list[dict[str, Any]] | None = None, tool_choice: str | dict[str, Any] | None = None,
                  parallel_tool_calls: bool | None = None, options: ChatOptions | None = None) -> ChatPlan:
        """A chat request made ready to run: its prompt with the tools offered, `params` with the output
        constraint that `tool_choice` "required" or a named function asks for, and how to parse its tool
        calls. ValueError naming the field that is wrong."""
        _check_params(params)
        template = self._chat_template()
        offered = parse_tools(tools)
        choice = parse_tool_choice(tool_choice, offered)
        if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
            raise ValueError(f"parallel_tool_calls={parallel_tool_calls!r} must be true or false")
        constraint, parsing = plan_tool_calls(offered, choice, parallel_tool_calls, template.tool_format)
        if constraint is not None:
            named = repr(choice.function) if choice.function else "'required'"
            if params.use_beam_search:
                raise ValueError(f"tool_choice={named} constrains the output: it cannot be combined with "
                                 "use_beam_search (a beam search is not constrained by a grammar here)")
            try:
                self.grammars().compile(constraint)
            except ValueError as e:
                raise ValueError(f"tools: the parameters schema of tool_choice={named} does not compile: "
                                 f"{str(e).split(': ', 1)[-1]}") from None
            # A forced call writes no message text, so a response format has nothing to shape: the call's
            # constraint replaces it for this request (as OpenAI and vLLM accept the pair)
            params = dataclasses.replace(params, structured_outputs=constraint)
        shown = offered if choice.mode != "none" else []  # "none": the model is not told of tools it may not call
        ids = template.render(messages, shown, options)
        if params.truncate_prompt_tokens == -1:
            ids, params = self._drop_oldest_turns(template, messages, shown, options, ids, params)
        tags = self.reasoning_tags
        return ChatPlan(ids, params, parsing, self.reasoning_start(ids), tags.close_id if tags else None)

    def _drop_oldest_turns(self, template: ChatTemplate, messages: list[dict[str, Any]], tools: list[Tool],
                           options: ChatOptions | None, ids: list[int],
                           params: SamplingParams) -> tuple[list[int], SamplingParams]:
        """A chat's `truncate_prompt_tokens=-1`: the oldest turns after the leading system messages dropped,
        whole (a user message with its answer, calls and their results), until the prompt leaves room for
        max_tokens, as OpenAI's `truncation: "auto"` drops items; cutting the rendered prompt's first tokens
        instead would cut into the template's own. The last message is never dropped: a prompt still too long
        is refused."""
        room = self.scheduler.prompt_room(params.max_tokens)
        params = dataclasses.replace(params, truncate_prompt_tokens=None)
        if len(ids) <= room:
            return ids, params
        first = next((i for i, m in enumerate(messages) if m.get("role") not in ("system", "developer")),
                     len(messages))
        # Where the kept conversation may start: at a later user message (whole turns dropped before it), or
        # at the last message. Fewer messages never render longer, so the earliest start that fits is found
        # by bisection: a long conversation is rendered a few times, not once per turn.
        starts = sorted({i for i in range(first + 1, len(messages)) if messages[i].get("role") == "user"}
                        | ({len(messages) - 1} if first < len(messages) - 1 else set()))
        lo, hi, fits = 0, len(starts), None
        while lo < hi:
            mid = (lo + hi) // 2
            tried = template.render(messages[:first] + messages[starts[mid]:], tools, options)
            if len(tried) <= room:
                hi, fits = mid, tried
            else:
                lo = mid + 1
        if fits is None and starts:  # not even the last message fits: its prompt, refused when it is run
            fits = template.render(messages[:first] + messages[starts[-1]:], tools, options)
        return (ids if fits is None else fits), params

    def _chat_template(self) -> ChatTemplate:
        if self._template is None:
            if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
                raise ValueError("messages: this model has no chat template")
            self._template = ChatTemplate(self.tokenizer)
        return self._template

    def tokenize(self, text: str | None = None, messages: list[dict[str, Any]] | None = None,
                 add_special_tokens: bool | None = None, tools: list[dict[str, Any]] | None = None,
                 options: ChatOptions | None = None) -> tuple[list[int], list[str]]:
        """Token ids and their string forms of `text`, or of `messages` (and `tools`, rendered as `options`
        say) through the chat template. `add_special_tokens` unset: true for text, as `options` say for
        messages (false by default: the template writes them)."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer")
        if messages:
            if add_special_tokens:
                options = dataclasses.replace(options or ChatOptions(), add_special_tokens=True)
            ids = self.chat_prompt(messages, tools, options)
        elif chat_only := (["tools"] if tools else []) + (options.changed() if options is not None else []):
            raise ValueError(f"{', '.join(chat_only)}: these shape a chat's prompt: give them with messages, "
                             "not with text")
        elif text:
            ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens is not False)
        else:
            raise ValueError("text is empty (give text or messages)")
        return ids, self.tokenizer.convert_ids_to_tokens(ids)

    def _check_token_ids(self, name: str, token_ids: list[int]) -> None:
        """ValueError naming `name` if any of `token_ids` is not a token id of this model."""
        vocab = self.model_config.vocab_size
        outside = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if outside:
            raise ValueError(f"{name} contains {outside[:5]!r}, outside the vocabulary [0, {vocab})")

    def grammars(self) -> GrammarManager:
        if self.tokenizer is None:
            raise ValueError("structured_outputs need a tokenizer; this model has none")
        if self._grammars is None:
            self._grammars = GrammarManager(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids,
                                            self.reasoning_tags)
        return self._grammars

    def detokenize(self, token_ids: list[int]) -> str:
        """The text of `token_ids` (special tokens included); ValueError for an id outside the vocabulary."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer")
        self._check_token_ids("tokens", token_ids)
        return self.tokenizer.decode(token_ids)

    # ---- the loop ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; outputs of the requests that got tokens or ended (a request with `final_output_only`
        only when it finishes). Never raises for a failed step: the requests it ended come back with `error`
        set."""
        return [self.output(r) for r in self.advance() if r.finished or not r.final_output_only]

    def advance(self) -> list[Request]:
        """Run one step; the requests it changed: those that got tokens, and those it ended (`error` set where
        a failed step ended them). No output is built: `output` builds one when it is wanted, and must once
        for each finished request, which frees what the engine keeps for it (`step` does both).

        With async scheduling the step after it is launched first, to run while this one's output is
        processed. Never raises for a failed step."""
        try:
            launched = self._launch()
            if launched is None:
                return []
            batch, handle = launched
            changed = self._process(batch, self.executor.collect(handle))
            self._send_late_masks()
            return changed
        except Exception as e:
            ended, restart = self._fail_step(e)
        if restart:
            self._restart_workers()
            self.block_manager.reset()  # the new pools hold nothing: no cached prefix survives
        return ended

    async def advance_async(self) -> list[Request]:
        """`advance` for an event loop: requests can be added and aborted while the workers compute."""
        try:
            launched = self._launch()
            if launched is None:
                return []
            batch, handle = launched
            changed = self._process(batch, await self.executor.collect_async(handle))
            self._send_late_masks()
            return changed
        except Exception as e:
            ended, restart = self._fail_step(e)
        if restart:
            # Off the event loop: requests that arrive meanwhile wait in the queue, holding no blocks.
            await asyncio.to_thread(self._restart_workers)
            self.block_manager.reset()
        return ended

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

    def _send_late_masks(self) -> None:
        """Once the step before it is processed, give the step in flight the grammar masks that waited for
        that step's draws (`StepBatch.late_masks`): its forward ran meanwhile, and it draws now."""
        if self._in_flight is not None and self._in_flight[0].late_masks:
            batch, handle = self._in_flight
            self.executor.sample(handle, self._grammars.late_masks(batch, self.scheduler.seqs))

    def _schedule(self) -> StepBatch | None:
        batch = self.scheduler.schedule()
        if batch is not None and self._grammars is not None:
            self._grammars.fill_masks(batch, self.scheduler.running)
        return batch

    def _fail_step(self, error: Exception) -> tuple[list[Request], bool]:
        """The one failure path of a step. Returns the requests it ended (`error` set), and whether the
        workers must be replaced.

        A worker failure loses the KV of every request that holds blocks: those end with the error, and
        queued ones wait for new workers. Any other error is a bug of the engine, and nothing says which
        request caused it, so every request ends with it."""
        if self._in_flight is not None and self._in_flight[0].late_masks:
            try:  # let it draw (unmasked, discarded): a worker waiting for masks would hold the steps after it
                self.executor.sample(self._in_flight[1], [None] * len(self._in_flight[0].late_masks))
            except Exception:  # the workers are gone: they are replaced below
                log.debug("releasing a step that waited for grammar masks failed", exc_info=True)
        self._in_flight = None  # its output, if it comes, is for requests ended here
        self.scheduler.discard_pending()
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
            request.error = message
            for seq in request.sequences:
                self.scheduler.finish(seq, "error")
            ended.append(request)
        if not lost_workers:
            # Every request has ended. The prefix cache may name K/V the failed step (or one scheduled ahead
            # of it) never wrote: forget it all, as new workers' empty pools would.
            self.block_manager.reset()
        return ended, lost_workers

    def _restart_workers(self) -> None:
        try:
            self.executor.restart()
        except Exception:  # then the next step fails at once with WorkerFailure, and tries again
            log.exception("restarting the workers failed")

    def _process(self, batch: StepBatch, output: StepOutput) -> list[Request]:
        updated = self.scheduler.update(batch, output)
        requests: dict[str, Request] = {}
        for seq in updated:
            params = seq.request.params
            # Text is needed every step only to look for stop strings; without them it is decoded when an
            # output is built, all new tokens at once (`output`), so a step with no output decodes nothing.
            if params.stop:
                # Stop strings count only once min_tokens are out (as EOS and stop_token_ids, banned until then).
                stop = params.stop if seq.num_output_tokens >= params.min_tokens else []
                hit = self.detokenizer.update(seq.seq_id, seq.token_ids, seq.num_prompt_tokens,
                                              params.skip_special_tokens, stop, params.include_stop_str_in_output)
                if hit is not None and not seq.finished:
                    seq.stop_reason = hit
                    self.scheduler.finish(seq, "stop")
            if params.structured_outputs is not None and self._grammars.advance(seq) and not seq.finished:
                self.scheduler.finish(seq, "stop")  # the grammar is complete: nothing more may follow
            requests[seq.request.request_id] = seq.request
        return list(requests.values())

    def _name_tokens(self, entries: list[PositionLogprobs]) -> None:
        """Give the newest logprob entries (those still without text) their tokens' text."""
        if self.tokenizer is None:
            return
        new: list[PositionLogprobs] = []
        for entry in reversed(entries):
            if entry.token is not None:
                break
            new.append(entry)
        for entry in new:
            for scored, text in zip(entry.values(), self.detokenizer.token_texts(list(entry)), strict=True):
                scored.decoded_token = text

    def output(self, request: Request) -> RequestOutput:
        """The request's whole output so far; for a finished request, its last (build it once: it frees the
        request's detokenizer and grammar state)."""
        if request.prompt_logprobs is not None:
            self._name_tokens(request.prompt_logprobs)
        with_logprobs = request.params.logprobs is not None
        if with_logprobs:
            for seq in request.sequences:
                self._name_tokens(seq.logprobs)
        skip_special_tokens = request.params.skip_special_tokens
        for seq in request.sequences:  # catch up with tokens not decoded yet (no stop strings: see _process)
            self.detokenizer.update(seq.seq_id, seq.token_ids, seq.num_prompt_tokens, skip_special_tokens, [])
        outputs = [
            CompletionOutput(
                index=seq.sample_index,
                text=self.detokenizer.text(seq.seq_id),
                token_ids=seq.output_token_ids,  # a fresh slice
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                logprobs=list(seq.logprobs) if with_logprobs else None,
            )
            for seq in sorted(request.sequences, key=lambda s: s.sample_index)
        ]
        finished = request.finished
        if finished:
            for seq in request.sequences:
                self.detokenizer.release(seq.seq_id)
                if self._grammars is not None:
                    self._grammars.release(seq.seq_id)
        # The request's prompt ids are never mutated (sequences copy them), so they are shared, not copied.
        prompt_logprobs = list(request.prompt_logprobs) if request.prompt_logprobs is not None else None
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outputs, finished,
                             error=request.error, prompt_logprobs=prompt_logprobs,
                             num_cached_tokens=request.num_cached_tokens)

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


def _check_params(params: object) -> None:
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")


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
