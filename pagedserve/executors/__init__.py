"""Executors run a StepBatch on a model replica's workers; the engine sees only their interface
(`executors/base.py`). `LocalExecutor` (`executors/local.py`) is the worker in this process; `RayExecutor`
(`executors/ray_executor.py`) runs the workers as Ray actors. Only this package's `make_executor` knows both:
each executor imports the interface alone, so no import runs in a circle."""

from __future__ import annotations

from pagedserve.config import EngineConfig
from pagedserve.executors.base import Executor, WorkerFailure
from pagedserve.executors.local import LocalExecutor
from pagedserve.workers.loader import ModelSource
from pagedserve.workers.models.model_config import ModelConfig

__all__ = ["Executor", "LocalExecutor", "WorkerFailure", "make_executor"]


def make_executor(config: EngineConfig, source: ModelSource, model_config: ModelConfig,
                  max_model_len: int) -> Executor:
    if config.executor == "ray":
        # Imported here: Ray is an optional dependency (the `serve` extra).
        from pagedserve.executors.ray_executor import RayExecutor

        return RayExecutor(config, source, model_config, max_model_len)
    return LocalExecutor(config, source, model_config, max_model_len)
