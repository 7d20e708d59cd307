"""Executors run a StepBatch on the model replica's workers. The engine only sees this interface:
in one process (`LocalExecutor`) or on Ray worker actors (`pagedserve.cluster.ray_executor`)."""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch

from pagedserve.config import EngineConfig
from pagedserve.scheduler.batch import StepBatch, StepOutput
from pagedserve.workers.loader import ModelSource
from pagedserve.workers.models.config import ModelConfig


class WorkerFailure(RuntimeError):
    """A worker died or failed during a step; the step's requests cannot finish."""


class Executor(Protocol):
    num_blocks: int  # KV blocks every rank holds (the minimum over ranks)
    # Whether its workers fill a step's deferred inputs from the step before (StepBatch.deferred_inputs),
    # so that the engine may schedule a step while the one before it runs.
    fills_deferred_inputs: bool

    def launch(self, batch: StepBatch) -> Any:
        """Start one step on every rank, behind the steps launched before it; a handle for `collect`."""

    def collect(self, handle: Any) -> StepOutput:
        """Wait for a launched step; rank 0's draws. WorkerFailure if a worker died or hung."""

    async def collect_async(self, handle: Any) -> StepOutput:
        """`collect` without blocking the event loop."""

    def restart(self) -> None:
        """Replace the workers after a failure: same pool size, empty pools."""

    def shutdown(self) -> None: ...

    async def check_health(self) -> None:
        """RuntimeError naming what is gone when a worker is."""

    def worker_pids(self) -> list[int]:
        """Process id of each rank, in rank order."""


class LocalExecutor:
    """The worker in this process. Its steps run in order on a thread of their own, so the engine's host
    work (scheduling the next step, detokenizing the last) goes on meanwhile: on a CPU the forward pass
    computes outside the GIL, on CUDA the thread only queues kernels and the draws are waited for in
    `collect`."""

    fills_deferred_inputs = True

    def __init__(self, config: EngineConfig, source: ModelSource, model_config: ModelConfig,
                 max_model_len: int) -> None:
        from pagedserve.workers.worker import Worker

        self.worker = Worker(config, source, model_config, max_model_len)
        self.num_blocks = self.worker.available_blocks
        self.worker.init_kv_pool(self.num_blocks)
        device = self.worker.device
        self._steps = ThreadPoolExecutor(1, thread_name_prefix="pagedserve-step", initializer=(
            (lambda: torch.cuda.set_device(device)) if device.type == "cuda" else None))

    def launch(self, batch: StepBatch) -> Future:
        return self._steps.submit(self.worker.launch, batch)

    def collect(self, handle: Future) -> StepOutput:
        return self.worker.collect(handle.result())

    async def collect_async(self, handle: Future) -> StepOutput:
        launched = await asyncio.wrap_future(handle)
        if self.worker.device.type == "cpu":  # computed already: nothing to wait for
            return self.worker.collect(launched)
        return await asyncio.to_thread(self.worker.collect, launched)

    def restart(self) -> None:
        # On the step thread, behind any step still queued there: none runs on the pool being replaced.
        self._steps.submit(self.worker.init_kv_pool, self.num_blocks).result()  # a fresh, empty pool

    def shutdown(self) -> None:
        self._steps.shutdown(wait=True)

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
