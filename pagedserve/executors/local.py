"""LocalExecutor: the model replica's one worker in this process (the offline `LLM`, the tests, the
benchmarks)."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Any

import torch

from pagedserve.config import EngineConfig
from pagedserve.scheduler.batch import StepBatch, StepOutput
from pagedserve.workers.loader import ModelSource
from pagedserve.workers.model_runner import LaunchedStep
from pagedserve.workers.models.model_config import ModelConfig


@dataclass
class _UnrunStep:
    """A step launched on a CPU: it runs when collected."""

    batch: StepBatch
    late_masks: list[bytes | None] | None = None


class LocalExecutor:
    """The worker in this process. On CUDA `launch` queues the step's kernels, which run while the host goes
    on, and `collect` waits for its draws. On a CPU a step computes where it is run, so it runs in
    `collect` (off the event loop in `collect_async`), launched steps in the order they were launched."""

    takes_late_masks = True
    takes_transfers = True

    def __init__(self, config: EngineConfig, source: ModelSource, model_config: ModelConfig,
                 max_model_len: int) -> None:
        from pagedserve.workers.worker import Worker

        self.worker = Worker(config, source, model_config, max_model_len)
        self.num_blocks = self.worker.available_blocks
        self.num_offload_blocks = self.worker.available_offload_blocks
        self.worker.init_kv_pool(self.num_blocks, self.num_offload_blocks)
        self.device_type = self.worker.device.type

    def launch(self, batch: StepBatch) -> LaunchedStep | _UnrunStep:
        return self.worker.launch(batch) if self.device_type == "cuda" else _UnrunStep(batch)

    def sample(self, handle: LaunchedStep | _UnrunStep, masks: list[bytes | None]) -> None:
        if isinstance(handle, _UnrunStep):
            handle.late_masks = masks  # it draws with them when it runs, in `collect`
        else:
            self.worker.sample(handle, masks)

    def collect(self, handle: LaunchedStep | _UnrunStep) -> StepOutput:
        if isinstance(handle, _UnrunStep):
            return self.worker.execute(handle.batch, handle.late_masks)
        return self.worker.collect(handle)

    async def collect_async(self, handle: LaunchedStep | _UnrunStep) -> StepOutput:
        return await asyncio.to_thread(self.collect, handle)

    def take_export(self, export_id: int) -> list[Any]:
        return [self.worker.runner.transfer.take(export_id)]

    def stage_import(self, import_id: int, pages: list[Any]) -> None:
        if len(pages) != 1:
            raise ValueError(f"the K/V pages fetched are {len(pages)} ranks'; this replica has one")
        self.worker.runner.transfer.stage(import_id, pages[0])

    def restart(self) -> None:
        # a fresh pool and second tier: nothing cached survives a failure
        self.worker.init_kv_pool(self.num_blocks, self.num_offload_blocks)

    def shutdown(self) -> None:
        self.worker = None  # the model and the KV pool go now
        if self.device_type == "cuda":
            # Give the freed pool back to the driver: left cached, a later engine of this process would
            # carve its weights out of it and find no room for its own pool.
            torch.cuda.empty_cache()

    async def check_health(self) -> None:
        pass  # the worker is this process

    def worker_pids(self) -> list[int]:
        return [os.getpid()]
