"""AsyncEngine: an `LLMEngine` driven by an asyncio step loop, streaming each request's outputs.

Requests are added and aborted on the event loop while a step's workers compute. The Ray actor
(`cluster/engine_actor.py`) and the Serve deployment (`cluster/engine_server.py`) both wrap one;
nothing here depends on Ray.

    engine = AsyncEngine(EngineConfig(...))
    async for out in engine.generate(prompt, params):   # RequestOutput, cumulative; the last finished
        ...
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

from pagedserve.config import EngineConfig
from pagedserve.engine import LLMEngine, Prompt, RequestFailed
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

__all__ = ["AsyncEngine", "QueueFull", "RequestFailed"]


class QueueFull(RuntimeError):
    """The waiting queue is at its bound; the client should retry later (RESOURCE_EXHAUSTED)."""


class StepMetrics(Protocol):
    """What the step loop reports (cluster/metrics.py's EngineMetrics records it for Ray)."""

    def on_tokens(self, count: int, first: bool, since_last: float) -> None: ...

    def on_finish(self, reasons: list[str], prompt_tokens: int, seconds: float) -> None: ...

    def on_step(self, seconds: float, stats: dict[str, Any]) -> None: ...

    def on_state(self, stats: dict[str, Any]) -> None: ...


def stream_interval_seconds(stream_interval_ms: float) -> float:
    """The setting in seconds; ValueError naming it unless it is a number of milliseconds in [0, 10000]."""
    if isinstance(stream_interval_ms, bool) or not isinstance(stream_interval_ms, int | float) or not (
            0 <= stream_interval_ms <= 10_000):
        raise ValueError(f"stream_interval_ms={stream_interval_ms!r} must be a number of milliseconds in [0, 10000]")
    return stream_interval_ms / 1000


class _Stream:
    """One request's outputs on their way to its `generate` caller. With a stream interval, an output that
    comes sooner than the interval after the last one sent is held back and replaced by each newer one until
    the interval has passed: outputs are cumulative, so the newest says all the held ones did, and a stream
    sends at most one message per interval however short the steps are. The first output (time to first
    token) and the last go at once."""

    def __init__(self, arrival: float) -> None:
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.arrival = arrival
        self.last_output = arrival  # when the engine last gave it tokens (for the latency metrics)
        self.num_tokens = 0
        self.due = 0.0  # time.monotonic() before which a new output is held back
        self.held: RequestOutput | None = None
        self.timer: asyncio.TimerHandle | None = None

    def send(self, out: RequestOutput, interval: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.held = None
        self.queue.put_nowait(out)
        self.due = time.monotonic() + interval

    def offer(self, out: RequestOutput, interval: float) -> None:
        """Send `out` now, or hold it until the interval since the last output sent has passed."""
        now = time.monotonic()
        if out.finished or out.error or now >= self.due:
            self.send(out, interval)
            return
        self.held = out
        if self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(self.due - now, self._send_held, interval)

    def _send_held(self, interval: float) -> None:
        self.timer = None
        if self.held is not None:
            self.send(self.held, interval)

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
        self.engine = LLMEngine(config)
        self.max_waiting_requests = max_waiting_requests
        self.metrics = metrics
        self._streams: dict[str, _Stream] = {}
        self._work = asyncio.Event()
        self._loop_task: asyncio.Task | None = None

    async def generate(self, prompt: Prompt, params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Validate (ValueError naming the field), queue, and yield outputs until the request ends: each the
        request's whole output so far, so a caller that reads slower than the engine steps gets the newest
        and misses nothing. RequestFailed if a failed step ended it."""
        if self.max_waiting_requests is not None:
            waiting = self.engine.num_waiting_requests()
            if waiting >= self.max_waiting_requests:
                raise QueueFull(f"{waiting} requests are waiting "
                                f"(max_waiting_requests={self.max_waiting_requests}); retry later")
        request = self.engine.make_request(prompt, params, request_id)
        rid = request.request_id
        if rid in self._streams:  # its request has ended, but its last output is not read yet
            raise ValueError(f"request_id={rid!r} is already in use")
        stream = self._streams[rid] = _Stream(time.monotonic())
        self.engine.enqueue(request)
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
            if not finished:  # the caller went away (cancelled, disconnected): free the blocks now
                self.engine.abort_request(rid)

    def abort(self, request_id: str) -> bool:
        out = self.engine.abort_request(request_id)
        if out is not None:
            self._deliver(out)
        return out is not None

    def _deliver(self, out: RequestOutput) -> None:
        """Record the output's tokens and pass it to its stream (if its caller is still there)."""
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        if self.metrics is not None:
            now = time.monotonic()
            total = sum(len(c.token_ids) for c in out.outputs)
            self.metrics.on_tokens(total - stream.num_tokens, stream.num_tokens == 0, now - stream.last_output)
            if total > stream.num_tokens:
                stream.num_tokens, stream.last_output = total, now
            if out.finished:
                self.metrics.on_finish([c.finish_reason or "abort" for c in out.outputs],
                                       len(out.prompt_token_ids), now - stream.arrival)
        stream.offer(out, self.stream_interval)

    def stats(self) -> dict[str, Any]:
        return self.engine.stats() | {"num_streams": len(self._streams)}

    def model_info(self) -> dict[str, Any]:
        return self.engine.model_info()

    async def check_health(self) -> None:
        """RuntimeError naming what is gone: the step loop (it died of an error) or a worker."""
        task = self._loop_task
        if task is not None and task.done() and not task.cancelled() and task.exception() is not None:
            raise RuntimeError(f"the engine's step loop died: {task.exception()!r}")
        if self.engine.executor is None:
            raise RuntimeError("the engine is shut down")
        await self.engine.executor.check_health()

    async def worker_pids(self) -> list[int]:
        return await asyncio.to_thread(self.engine.worker_pids)

    def _start_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._step_loop())

    async def _step_loop(self) -> None:
        engine = self.engine
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
            outputs = await engine.step_async()  # a failed step comes back as outputs with `error` set
            if self.metrics is not None:
                self.metrics.on_step(time.monotonic() - start, engine.stats())
            for out in outputs:
                self._deliver(out)
            await asyncio.sleep(0)  # let new requests and aborts in between steps

    def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        self.engine.shutdown()
