"""EngineActor: an async Ray actor that owns the scheduler and the one block manager of a model
replica, runs the step loop, and streams each request's outputs.

    engine = EngineActor.options(name="pagedserve-engine").remote(EngineConfig(...))
    async for ref in engine.generate.options(num_returns="streaming").remote(prompt, params):
        out = await ref   # RequestOutput, cumulative; the last has finished=True

Requests are added and aborted on the actor's event loop while a step's workers compute.
Cancelling the stream (`ray.cancel` on it) aborts the request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import ray

from pagedserve.config import EngineConfig
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class RequestFailed(RuntimeError):
    """A worker failure ended the request; the engine has recovered and serves new requests."""


class QueueFull(RuntimeError):
    """The waiting queue is at its bound; the client should retry later (RESOURCE_EXHAUSTED)."""


class EngineCore:
    """The actor's logic, usable in any asyncio loop (the actor and the Serve deployment wrap it).

    `max_waiting_requests` bounds the admission queue; `metrics` (an EngineMetrics) is optional.
    """

    def __init__(self, config: EngineConfig, max_waiting_requests: int | None = None, metrics=None) -> None:
        from pagedserve.engine import LLMEngine

        if max_waiting_requests is not None and max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests={max_waiting_requests} must be >= 0")
        self.engine = LLMEngine(config)
        self.max_waiting_requests = max_waiting_requests
        self.metrics = metrics
        self._streams: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._work = asyncio.Event()
        self._loop_task: asyncio.Task | None = None

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Validate (ValueError naming the field), queue, and yield outputs until the request ends."""
        waiting = len(self.engine.scheduler.waiting)
        if self.max_waiting_requests is not None and waiting >= self.max_waiting_requests:
            raise QueueFull(f"{waiting} requests are waiting (max_waiting_requests={self.max_waiting_requests}); "
                            "retry later")
        request = self.engine.make_request(prompt, params, request_id)
        rid = request.request_id
        if rid in self._streams:
            raise ValueError(f"request_id={rid!r} is already in use")
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[rid] = queue
        self.engine.scheduler.add_request(request)
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
        engine = self.engine
        return {"model": engine.source.name, "max_model_len": engine.max_model_len,
                "block_size": engine.config.block_size, "tensor_parallel_size": engine.config.tensor_parallel_size,
                "num_kv_blocks": engine.block_manager.num_total_blocks, "vocab_size": engine.model_config.vocab_size}

    def _start_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._step_loop())

    async def _step_loop(self) -> None:
        while True:
            if not self.engine.has_unfinished_requests():
                self._work.clear()
                try:
                    await asyncio.wait_for(self._work.wait(), timeout=1.0)
                except TimeoutError:
                    if self.metrics is not None:
                        self.metrics.on_state(self.engine.stats())
                continue
            start = time.monotonic()
            try:
                outputs = await self.engine.step_async()
                if self.metrics is not None:
                    self.metrics.on_step(time.monotonic() - start, self.engine.stats())
            except Exception:  # a bug must not silently stall every stream: fail them and go on
                log.exception("engine step failed")
                outputs = []
                for rid in list(self.engine.scheduler.requests):
                    out = self.engine.abort_request(rid)
                    if out is not None:
                        out.error = "internal engine error"
                        outputs.append(out)
            for out in outputs:
                queue = self._streams.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
            await asyncio.sleep(0)  # let new requests and aborts in between steps

    def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        self.engine.shutdown()


@ray.remote(num_cpus=0)
class EngineActor:
    """Ray actor around `EngineCore`. Async methods: it serves many streams at once."""

    def __init__(self, config: EngineConfig) -> None:
        import os

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        if config.executor != "ray":
            config.executor = "ray"  # workers are actors of their own (one per GPU / CPU slot)
        self.core = EngineCore(config)

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        async for out in self.core.generate(prompt, params, request_id):
            yield out

    async def abort(self, request_id: str) -> bool:
        return self.core.abort(request_id)

    async def stats(self) -> dict[str, Any]:
        return self.core.stats()

    async def model_info(self) -> dict[str, Any]:
        return self.core.model_info()

    async def worker_pids(self) -> list[int]:
        return list(await asyncio.gather(*[w.pid.remote() for w in self.core.engine.executor.workers]))

    async def shutdown(self) -> None:
        self.core.shutdown()

    async def ready(self) -> bool:
        return True
