"""Executors run a StepBatch on the model replica's workers. The engine only sees this interface:
in one process (`LocalExecutor`) or on Ray worker actors (`pagedserve.cluster.ray_executor`)."""

from __future__ import annotations

from typing import Protocol

from pagedserve.config import EngineConfig
from pagedserve.scheduler.batch import StepBatch, StepOutput
from pagedserve.workers.loader import ModelSource
from pagedserve.workers.models.config import ModelConfig


class WorkerFailure(RuntimeError):
    """A worker died or failed during a step; the step's requests cannot finish."""


class Executor(Protocol):
    num_blocks: int  # KV blocks every rank holds (the minimum over ranks)

    def execute(self, batch: StepBatch) -> StepOutput: ...

    def restart(self) -> None: ...

    def shutdown(self) -> None: ...


class LocalExecutor:
    def __init__(self, config: EngineConfig, source: ModelSource, model_config: ModelConfig,
                 max_model_len: int) -> None:
        from pagedserve.workers.worker import Worker

        self.worker = Worker(config, source, model_config, max_model_len)
        self.num_blocks = self.worker.available_blocks
        self.worker.init_kv_pool(self.num_blocks)

    def execute(self, batch: StepBatch) -> StepOutput:
        return self.worker.execute(batch)

    def restart(self) -> None:
        self.worker.init_kv_pool(self.num_blocks)  # a fresh pool: nothing cached survives a failure

    def shutdown(self) -> None:
        pass


def make_executor(config: EngineConfig, source: ModelSource, model_config: ModelConfig,
                  max_model_len: int) -> Executor:
    if config.executor == "ray":
        from pagedserve.cluster.ray_executor import RayExecutor

        return RayExecutor(config, source, model_config, max_model_len)
    return LocalExecutor(config, source, model_config, max_model_len)
