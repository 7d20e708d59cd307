"""EngineActor: an `AsyncEngine` in an async Ray actor, owning the scheduler and the one block manager of a
model replica; its workers are actors of their own.

    engine = EngineActor.options(name="pagedserve-engine").remote(EngineConfig(...))
    async for ref in engine.generate.options(num_returns="streaming").remote(prompt, params):
        out = await ref   # RequestOutput, cumulative; the last has finished=True

Cancelling the stream (`ray.cancel` on it) aborts the request and frees its blocks.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any

import ray

from pagedserve.async_engine import AsyncEngine
from pagedserve.config import EngineConfig, ray_hosted_config
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams


@ray.remote(num_cpus=0)
class EngineActor:
    """Async methods: it serves many streams at once."""

    def __init__(self, config: EngineConfig, stream_interval_ms: float = 0) -> None:
        """`stream_interval_ms`: a stream yields at most one output per interval (see `AsyncEngine`)."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        self.core = AsyncEngine(ray_hosted_config(config), stream_interval_ms=stream_interval_ms)

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
        return await self.core.worker_pids()

    async def shutdown(self) -> None:
        self.core.shutdown()

    async def ready(self) -> bool:
        return True
