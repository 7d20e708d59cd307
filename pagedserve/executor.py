"""Executors run a StepBatch on the model replica's workers. The engine only sees this interface:
in one process (`LocalExecutor`) or on Ray worker actors (`pagedserve.cluster.ray_executor`)."""

from __future__ import annotations

import asyncio
import os
from typing import Protocol

from pagedserve.config import EngineConfig
from pagedserve.scheduler.batch import StepBatch, StepOutput
from pagedserve.workers.loader import ModelSource
from pagedserve.workers.models.config import ModelConfig


class WorkerFailure(RuntimeError):
    """A worker died or failed during a step; the step's requests cannot finish."""


class Executor(Protocol):
    num_blocks: int  # KV blocks every rank holds (the minimum over ranks)

    def execute(self, batch: StepBatch) -> StepOutput:
        """Run one step on every rank; rank 0's sampled tokens. WorkerFailure if a worker died or hung."""

    async def execute_async(self, batch: StepBatch) -> StepOutput:
        """`execute` without blocking the event loop."""

    def restart(self) -> None:
        """Replace the workers after a failure: same pool size, empty pools."""

    def shutdown(self) -> None: ...

    async def check_health(self) -> None:
        """RuntimeError naming what is gone when a worker is."""

    def worker_pids(self) -> list[int]:
        """Process id of each rank, in rank order."""


class LocalExecutor:
    def __init__(self, config: EngineConfig, source: ModelSource, model_config: ModelConfig,
                 max_model_len: int) -> None:
        from pagedserve.workers.worker import Worker

        self.worker = Worker(config, source, model_config, max_model_len)
        self.num_blocks = self.worker.available_blocks
        self.worker.init_kv_pool(self.num_blocks)

    def execute(self, batch: StepBatch) -> StepOutput:
        return self.worker.execute(batch)

    async def execute_async(self, batch: StepBatch) -> StepOutput:
        return await asyncio.to_thread(self.worker.execute, batch)

    def restart(self) -> None:
        self.worker.init_kv_pool(self.num_blocks)  # a fresh pool: nothing cached survives a failure

    def shutdown(self) -> None:
        pass

    async def check_health(self) -> None:
        pass  # the worker is this process

    def worker_pids(self) -> list[int]:
        return [os.getpid()]


def make_executor(config: EngineConfig, source: ModelSource, model_config: ModelConfig,
                  max_model_len: int) -> Executor:
    if config.executor == "ray":
        from pagedserve.cluster.ray_executor import RayExecutor

        return RayExecutor(config, source, model_config, max_model_len)
    return LocalExecutor(config, source, model_config, max_model_len)
