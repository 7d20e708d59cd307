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


class AsyncEngine:
    """`max_waiting_requests` bounds the admission queue (QueueFull beyond it); `metrics` is optional."""

    def __init__(self, config: EngineConfig, max_waiting_requests: int | None = None,
                 metrics: StepMetrics | None = None) -> None:
        if max_waiting_requests is not None and max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests={max_waiting_requests} must be >= 0")
        self.engine = LLMEngine(config)
        self.max_waiting_requests = max_waiting_requests
        self.metrics = metrics
        self._streams: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._work = asyncio.Event()
        self._loop_task: asyncio.Task | None = None

    async def generate(self, prompt: Prompt, params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Validate (ValueError naming the field), queue, and yield outputs until the request ends.
        RequestFailed if a failed step ended it."""
        if self.max_waiting_requests is not None:
            waiting = self.engine.num_waiting_requests()
            if waiting >= self.max_waiting_requests:
                raise QueueFull(f"{waiting} requests are waiting "
                                f"(max_waiting_requests={self.max_waiting_requests}); retry later")
        request = self.engine.make_request(prompt, params, request_id)
        rid = request.request_id
        if rid in self._streams:  # its request has ended, but its last output is not read yet
            raise ValueError(f"request_id={rid!r} is already in use")
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[rid] = queue
        self.engine.enqueue(request)
        self._start_loop()
        self._work.set()
        finished = False
        arrival = last = time.monotonic()
        num_tokens = 0
        try:
            while not finished:
                out = await queue.get()
                if out.error:
                    raise RequestFailed(out.error)
                finished = out.finished
                if self.metrics is not None:
                    now = time.monotonic()
                    total = sum(len(c.token_ids) for c in out.outputs)
                    self.metrics.on_tokens(total - num_tokens, num_tokens == 0, now - last)
                    num_tokens, last = total, now
                    if finished:
                        self.metrics.on_finish([c.finish_reason or "abort" for c in out.outputs],
                                               len(out.prompt_token_ids), now - arrival)
                yield out
        finally:
            self._streams.pop(rid, None)
            if not finished:  # the caller went away (cancelled, disconnected): free the blocks now
                self.engine.abort_request(rid)

    def abort(self, request_id: str) -> bool:
        out = self.engine.abort_request(request_id)
        if out is not None and request_id in self._streams:
            self._streams[request_id].put_nowait(out)
        return out is not None

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
                queue = self._streams.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
            await asyncio.sleep(0)  # let new requests and aborts in between steps

    def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        self.engine.shutdown()
