"""AsyncEngine: an `LLMEngine` driven by an asyncio step loop, streaming each request's outputs.

Requests are added and aborted on the event loop while a step's workers compute. What a request costs to
prepare (tokenizing it, rendering a chat template, compiling its grammar: a large schema takes a second)
runs on a thread of its own (`AsyncEngine.prepare`), so the streams already running go on meanwhile. The Serve
deployment (`serving/model_server.py`) wraps one; nothing here depends on Ray.

    engine = AsyncEngine(EngineConfig(...))
    async for out in engine.generate(prompt, params):   # RequestOutput, cumulative; the last finished
        ...
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from pagedserve.config import EngineConfig
from pagedserve.engine.beam_search import BeamSearch
from pagedserve.engine.llm_engine import LLMEngine, Prompt
from pagedserve.engine.request_errors import QueueFull, RequestFailed
from pagedserve.lora.lora_request import LoRARequest
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler.block_manager import UNBOUNDED
from pagedserve.scheduler.prefix_transfer import PrefixExport, PrefixImport
from pagedserve.scheduler.request import Request

T = TypeVar("T")
# How long replacing failed workers may take before the engine reports itself unhealthy: new workers load the model
# again (minutes for a large one from a slow disk); one that takes longer is stuck.
RESTART_GRACE_S = 600.0
# A made request's prefix K/V from elsewhere (another replica), staged here; None where there is none to use.
FetchPrefix = Callable[[Request], Awaitable[PrefixImport | None]]

__all__ = ["AsyncEngine", "QueueFull", "RequestFailed"]


class StepMetrics(Protocol):
    """What the step loop reports (serving/metrics.py's ServerMetrics records it for Ray)."""

    def on_tokens(self, count: int, first_token_latencies: list[float], inter_token_latencies: list[float]) -> None:
        """A step's tokens: how many, and per request that got some, the time since its arrival (its first)
        or since its tokens before."""

    def on_finish(self, reasons: list[str], prompt_tokens: int, seconds: float, queued_seconds: float | None) -> None:
        """A request finished `seconds` after its arrival, of which `queued_seconds` before it was first scheduled
        (None: it never was, or it was a beam search)."""

    def on_step(self, seconds: float, stats: dict[str, Any]) -> None: ...

    def on_state(self, stats: dict[str, Any]) -> None: ...


def stream_interval_seconds(stream_interval_ms: float) -> float:
    """The setting in seconds; ValueError naming it unless it is a number of milliseconds in [0, 10000]."""
    if isinstance(stream_interval_ms, bool) or not isinstance(stream_interval_ms, int | float) or not (
            0 <= stream_interval_ms <= 10_000):
        raise ValueError(f"stream_interval_ms={stream_interval_ms!r} must be a number of milliseconds in [0, 10000]")
    return stream_interval_ms / 1000


class _Stream:
    """One request's outputs on their way to its `generate` caller. With a stream interval, a request that
    gets tokens sooner than the interval after the last output sent waits until the interval has passed; its
    output is built then, holding every token since (outputs are cumulative), so a stream sends at most one
    message per interval however short the steps are, and no output is built that is not sent. The first
    output (time to first token) and the last go at once."""

    def __init__(self, request: Request | BeamSearch, arrival: float) -> None:
        self.request = request
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.arrival = arrival
        self.last_tokens = arrival  # when the engine last gave it tokens (for the latency metrics)
        self.num_tokens = 0
        self.due = 0.0  # time.monotonic() before which an output is held back
        self.timer: asyncio.TimerHandle | None = None

    def send(self, out: RequestOutput, interval: float, now: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.queue.put_nowait(out)
        self.due = now + interval

    def changed(self, engine: LLMEngine, interval: float, now: float, finished: bool) -> None:
        """The request got tokens or ended (by `now`, time.monotonic()): send its output now, or when the
        interval since the last one sent has passed."""
        if finished or now >= self.due:
            self.send(engine.output(self.request), interval, now)
        elif self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(self.due - now, self._send_newest, engine, interval)

    def _send_newest(self, engine: LLMEngine, interval: float) -> None:
        self.timer = None  # a finished request's output went at once, and cancelled this
        self.send(engine.output(self.request), interval, time.monotonic())

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()


class AsyncEngine:
    """`max_waiting_requests` bounds the admission queue (QueueFull beyond it). `stream_interval_ms`: a
    stream yields at most one output per this many milliseconds, the newest (outputs are cumulative), so that
    with many streams and short steps the consumers handle a message per interval rather than one per token;
    0 yields every step's output. `metrics` is optional."""

    def __init__(self, config: EngineConfig, max_waiting_requests: int | None = None,
                 metrics: StepMetrics | None = None, stream_interval_ms: float = 0) -> None:
        if max_waiting_requests is not None and max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests={max_waiting_requests} must be >= 0")
        self.stream_interval = stream_interval_seconds(stream_interval_ms)
        self.llm_engine = LLMEngine(config)
        self.max_waiting_requests = max_waiting_requests
        self.metrics = metrics
        self._streams: dict[str, _Stream] = {}
        self._num_preparing = 0  # requests on the preparing thread, not queued yet
        self._work = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._exports: dict[int, asyncio.Future] = {}  # export id -> whoever waits for it
        # One thread: preparations run in the order they arrive, and never two tokenizer encodes at once.
        self._preparing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedserve-prepare")

    async def prepare(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` (a request's preparation: `InputProcessor.make`, `chat_plan`, `tokenize`, ...)
        on the preparing thread, off the event loop, so that the step loop goes on while it runs. The
        engine's step state is the event loop's alone; a preparation reads only what does not change (the
        tokenizer, the model's limits) and the grammar cache (locked)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._preparing, functools.partial(fn, *args, **kwargs))

    async def generate(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None,
                       lora_request: LoRARequest | None = None,
                       fetch_prefix: FetchPrefix | None = None) -> AsyncIterator[RequestOutput]:
        """Validate (ValueError naming the field), queue, and yield outputs until the request ends: each the
        request's whole output so far, so a caller that reads slower than the engine steps gets the newest
        and misses nothing. RequestFailed if a failed step ended it. A beam search (`use_beam_search`) yields
        once, its answer. `lora_request`: the LoRA adapter it runs with. `fetch_prefix`: called with the made
        request (its prompt tokenized and cut) before it is queued, for its prefix's K/V from elsewhere
        (`import_prefix`); not for a beam search, nor for a request scoring its prompt (which reads no cached
        block). Whatever becomes of the request, the import is released."""
        if self.max_waiting_requests is not None:
            # Requests still being prepared are waiting too: they are queued the moment they are ready.
            waiting = self.llm_engine.num_waiting_requests() + self._num_preparing
            if waiting >= self.max_waiting_requests:
                raise QueueFull(f"{waiting} requests are waiting "
                                f"(max_waiting_requests={self.max_waiting_requests}); retry later")
        arrival = time.monotonic()
        self._num_preparing += 1
        try:
            made = await self.prepare(self.llm_engine.inputs.make, prompt, params, request_id, lora_request)
            kv_import = None
            if fetch_prefix is not None and isinstance(made, Request) and not made.needs_prompt_logprobs:
                self._check_unused(made.request_id)  # before the fetch it would waste
                kv_import = await fetch_prefix(made)
        finally:
            self._num_preparing -= 1
        self.llm_engine.with_import(made, kv_import)
        # Closed with this generator (a caller that stops reading), not when the collector finds it.
        async with contextlib.aclosing(self._run(made, arrival)) as outputs:
            async for out in outputs:
                yield out

    def _drop_import(self, kv_import: PrefixImport | None) -> None:
        if kv_import is not None:
            self.llm_engine.drop_import(kv_import)
            self._wake()

    def _wake(self) -> None:
        """Have the step loop run: a request, or a transfer a step must carry, is due."""
        self._start_loop()
        self._work.set()

    async def export_prefix(self, token_ids: list[int], cache_salt: str | None = None, lora_id: int | None = None,
                            first_block: int = 0, num_blocks: int = UNBOUNDED) -> PrefixExport:
        """The prompt's cached full blocks from `first_block` on, read by the next step (`LLMEngine.export_prefix`).
        RuntimeError where they cannot be read."""
        export_id = self.llm_engine.export_prefix(token_ids, cache_salt, lora_id, first_block, num_blocks)
        future = self._exports[export_id] = asyncio.get_running_loop().create_future()
        self._wake()
        try:
            result = await future
        finally:
            self._exports.pop(export_id, None)
        if isinstance(result, Exception):
            raise result
        return result

    async def import_prefix(self, export: PrefixExport, token_ids: list[int], cache_salt: str | None = None,
                            lora_id: int | None = None) -> PrefixImport | None:
        """Stage another replica's export on the workers (off the event loop), for `generate`'s `kv_import`; None
        where it cannot be used (`LLMEngine.import_prefix`). Cancelled, it is released."""
        engine = self.llm_engine
        import_id = engine.begin_import(export, token_ids, cache_salt, lora_id)
        if import_id is None:
            return None
        error: BaseException | None = None
        try:
            await asyncio.to_thread(engine.stage_import, import_id, export)
        except asyncio.CancelledError as e:
            engine.end_import(import_id, export, e)
            self._wake()
            raise
        except Exception as e:
            error = e
        kv_import = engine.end_import(import_id, export, error)
        self._wake()  # a failed one's release
        return kv_import

    def _deliver_exports(self) -> None:
        """Hand the exports the last step read to those waiting for them (an export no one waits for is dropped)."""
        for export_id, result in self.llm_engine.exports_done.items():
            future = self._exports.get(export_id)
            if future is not None and not future.done():
                future.set_result(result)
        self.llm_engine.exports_done.clear()

    async def _run(self, request: Request | BeamSearch, arrival: float) -> AsyncIterator[RequestOutput]:
        """Queue a made request (or beam search) and yield its outputs (`generate`)."""
        rid = request.request_id
        try:
            self._check_unused(rid)
            self.llm_engine.enqueue(request)
        except BaseException:
            self._drop_import(getattr(request, "kv_import", None))  # a beam search's is released already
            raise
        stream = self._streams[rid] = _Stream(request, arrival)
        self._start_loop()
        self._work.set()
        finished = False
        try:
            while not finished:
                out = await stream.queue.get()
                while not stream.queue.empty():  # the reader fell behind: the newest output covers the rest
                    out = stream.queue.get_nowait()
                if out.error:
                    raise RequestFailed(out.error)
                finished = out.finished
                yield out
        finally:
            stream.close()
            self._streams.pop(rid, None)
            # The caller went away (cancelled, disconnected) before the end: free the blocks now.
            if not finished and self.llm_engine.abort_request(rid) is not None:
                self._record_finish(stream, time.monotonic())

    def _check_unused(self, request_id: str) -> None:
        """The engine knows the ids it runs (`enqueue` checks them); here, also those of requests whose last
        output is not read yet."""
        if request_id in self._streams:
            raise ValueError(f"request_id={request_id!r} is already in use")

    def abort(self, request_id: str) -> bool:
        out = self.llm_engine.abort_request(request_id)
        if out is None:
            return False
        stream = self._streams.get(request_id)
        if stream is not None:
            now = time.monotonic()
            self._record_finish(stream, now)
            stream.send(out, self.stream_interval, now)
        return True

    def _deliver(self, requests: list[Request | BeamSearch], now: float) -> None:
        """Record a step's tokens, and pass each request it changed to its stream (if its caller is still
        there)."""
        count = 0
        first: list[float] = []
        later: list[float] = []
        for request in requests:
            stream = self._streams.get(request.request_id)
            if stream is None:
                if request.finished:
                    self.llm_engine.output(request)  # frees what the engine keeps for it
                continue
            total = request.num_output_tokens
            if total > stream.num_tokens:
                count += total - stream.num_tokens
                (later if stream.num_tokens else first).append(now - stream.last_tokens)
                stream.num_tokens, stream.last_tokens = total, now
            finished = request.finished
            if finished:
                self._record_finish(stream, now)
            stream.changed(self.llm_engine, self.stream_interval, now, finished)
        if self.metrics is not None and count:
            self.metrics.on_tokens(count, first, later)

    def _record_finish(self, stream: _Stream, now: float) -> None:
        if self.metrics is not None:
            request = stream.request
            admitted = request.admitted_at if isinstance(request, Request) else None  # a beam search: its steps
            self.metrics.on_finish(request.finish_reasons(), len(request.prompt_token_ids), now - stream.arrival,
                                   None if admitted is None else max(0.0, admitted - stream.arrival))

    def stats(self) -> dict[str, Any]:
        return self.llm_engine.stats() | {"num_streams": len(self._streams)}

    def model_info(self) -> dict[str, Any]:
        return self.llm_engine.model_info()

    def cached_block_hashes(self) -> list[int]:
        return self.llm_engine.cached_block_hashes()

    async def check_health(self) -> None:
        """RuntimeError naming what is gone: the step loop (it died of an error) or a worker. Workers being replaced
        after a failure are not asked (they answer once loaded), for up to `RESTART_GRACE_S`."""
        task = self._loop_task
        if task is not None and task.done() and not task.cancelled() and task.exception() is not None:
            raise RuntimeError(f"the engine's step loop died: {task.exception()!r}")
        engine = self.llm_engine
        if engine.executor is None:
            raise RuntimeError("the engine is shut down")
        since = engine.restarting_since
        if since is not None:
            if time.monotonic() - since > RESTART_GRACE_S:
                raise RuntimeError(f"replacing the failed workers has taken over {RESTART_GRACE_S:.0f}s")
            return
        await engine.executor.check_health()

    async def worker_pids(self) -> list[int]:
        return await asyncio.to_thread(self.llm_engine.worker_pids)

    def _start_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            # In a context of its own, not the request's that starts it: Ray counts the tasks an actor call submits
            # (every step's, to the workers) as that call's, and cancelling the call (a Serve client gone) would
            # cancel the step in flight and fail every request in it.
            self._loop_task = asyncio.get_running_loop().create_task(self._step_loop(), context=contextvars.Context())

    async def _step_loop(self) -> None:
        engine = self.llm_engine
        while True:
            if not engine.has_unfinished_requests():
                self._work.clear()
                try:
                    await asyncio.wait_for(self._work.wait(), timeout=1.0)
                except TimeoutError:
                    if self.metrics is not None:
                        self.metrics.on_state(engine.stats())
                continue
            start = time.monotonic()
            requests = await engine.advance_async()  # those a failed step ended come back with `error` set
            self._deliver_exports()
            now = time.monotonic()
            if self.metrics is not None:
                self.metrics.on_step(now - start, engine.stats())
            self._deliver(requests, now)
            await asyncio.sleep(0)  # let new requests and aborts in between steps

    def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        self._preparing.shutdown(wait=False, cancel_futures=True)
        self.llm_engine.shutdown()
