"""What the engine sees of its workers: the `Executor` interface, and `WorkerFailure`, which a step raises
when a worker is gone. The executors are `LocalExecutor` (`executors/local.py`: the worker in this process)
and `RayExecutor` (`executors/ray_executor.py`: worker actors on Ray); `make_executor` picks one."""

from __future__ import annotations

from typing import Any, Protocol

from pagedserve.scheduler.batch import StepBatch, StepOutput


class WorkerFailure(RuntimeError):
    """A worker died or failed during a step; the step's requests cannot finish."""


class Executor(Protocol):
    num_blocks: int  # the blocks of the pool the KV-cache groups share, on every rank (the minimum over ranks)
    num_offload_blocks: int  # the blocks of the prefix cache's second tier, on every rank (0: none)
    device_type: str  # where the workers compute: "cuda" or "cpu"
    takes_late_masks: bool  # whether `sample` can give a launched step its grammar masks
    takes_transfers: bool  # whether `take_export` and `stage_import` reach the workers

    def launch(self, batch: StepBatch) -> Any:
        """Start one step on every rank, behind the steps launched before it; a handle for `collect`. The
        workers fill its deferred inputs (`StepBatch.deferred_inputs`) from the draws of the step before."""

    def sample(self, handle: Any, masks: list[bytes | None]) -> None:
        """The masks of a launched step's `StepBatch.late_masks` (None: draw unmasked), which it waits for
        before it draws; without waiting for the draws."""

    def collect(self, handle: Any) -> StepOutput:
        """Wait for a launched step; rank 0's draws. WorkerFailure if a worker died or hung."""

    async def collect_async(self, handle: Any) -> StepOutput:
        """`collect` without blocking the event loop."""

    def take_export(self, export_id: int) -> list[Any]:
        """Each rank's pages of an export a processed step read (`PrefixExport.pages`): the tensors, or Ray
        references to them, which the ranks keep no more."""

    def stage_import(self, import_id: int, pages: list[Any]) -> None:
        """Give rank r `pages[r]` (another replica's rank r's pages, or a reference to them) to keep under
        `import_id` until a step copies them; blocks until every rank has them. Raises if a rank cannot (the pages
        are lost, or do not fit its pools)."""

    def restart(self) -> None:
        """Replace the workers after a failure: same pool and second tier sizes, both empty."""

    def shutdown(self) -> None: ...

    async def check_health(self) -> None:
        """RuntimeError naming what is gone when a worker is."""

    def worker_pids(self) -> list[int]:
        """Process id of each rank, in rank order."""
