"""Worker actors on Ray: one per GPU (or CPU slot), packed by a STRICT_PACK placement group so one
tensor-parallel group shares a node.

Each step's batch is `ray.put` once and its ref passed to every rank's `execute`; rank 0 returns the
sampled tokens. With async scheduling the engine sends a step while the one before it still runs: each
actor launches steps in the order the engine numbered them (`StepOrder`), whatever order the calls
arrive in, so the next step's kernels are queued while the last one's draws are read back.

PAGEDSERVE_COMPILED_GRAPH=1 sends steps through a Ray compiled graph instead (ray.dag: the batch is
written once into a shared-memory channel all ranks read), which cuts the dispatch overhead 2.5x
(benchmarks/RESULTS.md). It is off by default: in Ray 2.60, a worker dying under a
compiled graph sometimes aborts the driving process (a fatal check in
experimental_mutable_object_provider.cc), and the engine must survive a worker's death."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import warnings

import ray
from ray.exceptions import GetTimeoutError, RayError
from ray.util.placement_group import get_current_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pagedserve.config import EngineConfig
from pagedserve.executors.base import WorkerFailure
from pagedserve.scheduler.batch import StepBatch, StepOutput
from pagedserve.workers.loader import ModelSource
from pagedserve.workers.models.model_config import ModelConfig

log = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 120.0
HEALTH_TIMEOUT_S = 10.0
STEP_TIMEOUT_S = float(os.environ.get("PAGEDSERVE_STEP_TIMEOUT_S", "600"))
TRANSFER_TIMEOUT_S = 60.0  # the most a rank's staging of another replica's K/V may take
USE_COMPILED_GRAPH = os.environ.get("PAGEDSERVE_COMPILED_GRAPH", "0") == "1"


class StepOrder:
    """Lets steps launch one at a time in the order they are numbered (0, 1, ...), whichever thread's call
    arrives first: Ray does not keep the submission order of calls to an actor with several threads."""

    def __init__(self) -> None:
        self._turn = threading.Condition()
        self._next = 0  # the step whose turn it is
        self._failed: int | None = None  # the first step whose launch raised

    def wait(self, step: int) -> None:
        """Block until every step before `step` has launched; RuntimeError if one of them failed."""
        with self._turn:
            if not self._turn.wait_for(lambda: self._next == step, timeout=STEP_TIMEOUT_S):
                raise RuntimeError(f"step {step} waited {STEP_TIMEOUT_S:.0f}s for step {self._next} to arrive")
            if self._failed is not None:
                self._pass(step)
                raise RuntimeError(f"step {step} cannot run: step {self._failed} before it failed")

    def done(self, step: int, ok: bool) -> None:
        """`step` has launched (or failed to): the next one may go."""
        with self._turn:
            if not ok and self._failed is None:
                self._failed = step
            self._pass(step)

    def _pass(self, step: int) -> None:
        self._next = step + 1
        self._turn.notify_all()


class LateMasks:
    """Grammar masks that the engine sends for a launched step (`StepBatch.late_masks`), by step number,
    for the step's thread to take: they may arrive before the step does."""

    def __init__(self) -> None:
        self._arrived = threading.Condition()
        self._masks: dict[int, list[bytes | None]] = {}

    def put(self, step: int, masks: list[bytes | None]) -> None:
        with self._arrived:
            self._masks[step] = masks
            self._arrived.notify_all()

    def take(self, step: int) -> list[bytes | None]:
        with self._arrived:
            if not self._arrived.wait_for(lambda: step in self._masks, timeout=STEP_TIMEOUT_S):
                raise RuntimeError(f"step {step} waited {STEP_TIMEOUT_S:.0f}s for its grammar masks")
            return self._masks.pop(step)


def _to_wire(pages: list) -> list:
    """K/V pages as Ray moves them fastest: numpy arrays, which its object store hands out without a copy (a torch
    tensor is pickled, and copied on the way in and out: twice the time). As bytes with their dtype's name, since
    numpy has no bfloat16."""
    import torch

    return [(str(p.dtype).removeprefix("torch."), p.view(torch.uint8).numpy()) for p in pages]


def _from_wire(pages: list) -> list:
    import torch

    with warnings.catch_warnings():  # read-only: the object store's memory, only ever read (copied into blocks)
        warnings.simplefilter("ignore", UserWarning)
        return [torch.from_numpy(data).view(getattr(torch, dtype)) for dtype, data in pages]


class WorkerActor:
    """Holds one rank's `Worker`. Created light; `setup` loads the model so errors reach the caller.

    Steps run in the "steps" concurrency group, two threads: one launches a step while the other waits
    for the draws of the step before it. Other calls (`pid`, the health check) have a thread of their own."""

    def __init__(self, rank: int, world_size: int, threads: int) -> None:
        import torch

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        torch.set_num_threads(threads)
        self.rank = rank
        self.world_size = world_size
        self.worker = None
        self.order = StepOrder()
        self.late_masks = LateMasks()

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def setup(self, config: EngineConfig, source: ModelSource, model_config: ModelConfig, max_model_len: int,
              dist_init_method: str | None) -> tuple[int, int, str]:
        """(KV blocks that fit in the shared pool, in the second tier, the device type the worker computes on)."""
        from pagedserve.workers.worker import Worker

        self.worker = Worker(config, source, model_config, max_model_len, self.rank, self.world_size,
                             dist_init_method)
        return self.worker.available_blocks, self.worker.available_offload_blocks, self.worker.device.type

    def init_kv_pool(self, num_blocks: int, offload_blocks: int) -> None:
        self.worker.init_kv_pool(num_blocks, offload_blocks)

    @ray.method(concurrency_group="steps")
    def execute(self, step: int, batch: StepBatch) -> StepOutput | None:
        """Run step number `step` (numbered from 0 by the executor) once every step before it has launched:
        its deferred inputs are the draws of the one before it. A step that waits for grammar masks (rank
        0's, with `StepBatch.late_masks`) draws once `give_late_masks` brings them, before the next step may
        launch."""
        self.order.wait(step)
        launched = None
        try:
            launched = self.worker.launch(batch)
            if launched.waiting is not None:
                self.worker.sample(launched, self.late_masks.take(step))
        except BaseException:
            self.order.done(step, ok=False)
            raise
        self.order.done(step, ok=True)
        return self.worker.collect(launched)

    @ray.method(concurrency_group="transfers")
    def take_export(self, export_id: int) -> list:
        """This rank's pages of an export a step read (`KVTransfer.take`), as `_to_wire` sends them."""
        return _to_wire(self.worker.runner.transfer.take(export_id))

    @ray.method(concurrency_group="transfers")
    def stage_import(self, import_id: int, pages: list) -> None:
        """Keep another replica's pages for a later step (`KVTransfer.stage`); Ray fetched them for this call."""
        self.worker.runner.transfer.stage(import_id, _from_wire(pages))

    def give_late_masks(self, step: int, masks: list[bytes | None]) -> None:
        """The masks of step `step`'s `StepBatch.late_masks` (rank 0 only: it draws)."""
        self.late_masks.put(step, masks)

    def pid(self) -> int:
        return os.getpid()


def ensure_ray(min_cpus: int = 1) -> None:
    """Join the cluster named by RAY_ADDRESS (or the one this process runs in), else start a local one."""
    if ray.is_initialized():
        return
    env = {"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(runtime_env=env)
    else:
        # Logical CPUs: one per worker slot even on a small machine (the workers share the cores).
        ray.init(num_cpus=max(os.cpu_count() or 1, min_cpus), runtime_env=env, include_dashboard=False)


def uses_gpus(config: EngineConfig) -> bool:
    """Whether the workers take GPUs: device "cuda", or "auto" where the cluster (else this machine) has
    enough of them."""
    if config.device != "auto":
        return config.device == "cuda"
    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0) >= config.tensor_parallel_size * config.gpus_per_worker
    import torch

    return torch.cuda.device_count() >= config.tensor_parallel_size * config.gpus_per_worker


def worker_bundle(config: EngineConfig) -> dict[str, float]:
    """The resources of one worker actor (one rank): `gpus_per_worker` of a GPU and `worker_cpus` CPUs (default
    one), or the CPUs."""
    cpus = config.worker_cpus or 1
    return {"GPU": config.gpus_per_worker, "CPU": cpus} if uses_gpus(config) else {"CPU": cpus}


def worker_threads(config: EngineConfig) -> int:
    """A worker's torch threads: its `worker_cpus`, else this node's cores shared among the replica's ranks."""
    return config.worker_cpus or max(1, (os.cpu_count() or 1) // config.tensor_parallel_size)


class RayExecutor:
    """The workers of one model replica. Inside a placement group of `worker_bundle`s after one bundle of
    its own (a Serve replica's, see `ModelServer`), the workers take those bundles; anywhere else it makes
    a placement group of its own."""

    def __init__(self, config: EngineConfig, source: ModelSource, model_config: ModelConfig,
                 max_model_len: int) -> None:
        self.config = config
        self.source = source
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.world_size = config.tensor_parallel_size
        self.bundle = worker_bundle(config)
        ensure_ray(int(self.world_size * self.bundle["CPU"]) + 1)
        self.workers: list = []
        self.placement_group = None  # one this executor made (and removes); never the Serve replica's
        self.compiled = None
        self.num_blocks = 0
        self.num_offload_blocks = 0
        self.device_type = "cpu"
        self._start()

    def _placement_group(self):
        """(placement group, bundle index of rank 0): the replica's own when it was placed with one bundle
        per worker after its own, else a new one."""
        current = get_current_placement_group()
        if current is not None and current.bundle_specs[1:] == [self.bundle] * self.world_size:
            return current, 1
        pg = placement_group([dict(self.bundle) for _ in range(self.world_size)], strategy="STRICT_PACK")
        self.placement_group = pg
        try:
            ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except GetTimeoutError:
            self.shutdown()
            raise RuntimeError(f"the Ray cluster cannot place {self.world_size} workers of {self.bundle} on one "
                               f"node within {PLACEMENT_TIMEOUT_S:.0f}s: not enough resources") from None
        return pg, 0

    def _start(self) -> None:
        pg, first = self._placement_group()
        cpu_threads = worker_threads(self.config)
        # Two step threads: a step in flight (its launch, then the wait for its draws) and the one sent behind it.
        # A thread for K/V transfers: a fetch between replicas never holds a step.
        actor_cls = ray.remote(concurrency_groups={"steps": 2, "transfers": 1})(WorkerActor)
        self.steps_sent = 0  # the new actors number steps from 0
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=first + rank)
            options = {"num_cpus": self.bundle["CPU"], "num_gpus": self.bundle.get("GPU", 0)}
            self.workers.append(actor_cls.options(scheduling_strategy=strategy, **options)
                                .remote(rank, self.world_size, cpu_threads))
        init_method = None
        if self.world_size > 1:
            # STRICT_PACK puts every rank on one node, so the rendezvous stays on loopback.
            init_method = f"tcp://127.0.0.1:{ray.get(self.workers[0].free_port.remote())}"
        try:
            capacities, offload_capacities, devices = zip(*ray.get([
                w.setup.remote(self.config, self.source, self.model_config, self.max_model_len, init_method)
                for w in self.workers]), strict=True)
            # Every rank must hold every block the scheduler hands out: the smallest pool (and tier) wins.
            self.num_blocks = self.num_blocks or min(capacities)
            self.num_offload_blocks = self.num_offload_blocks or min(offload_capacities)
            self.device_type = devices[0]
            ray.get([w.init_kv_pool.remote(self.num_blocks, self.num_offload_blocks) for w in self.workers])
        except RayError as e:
            self.shutdown()
            raise RuntimeError(f"starting the worker actors failed: {_cause(e)}") from e
        if USE_COMPILED_GRAPH:
            try:
                self.compiled = self._compile()
            except Exception as e:  # the plain path works everywhere; say why the fast one is off
                log.warning("Ray compiled graph unavailable, using actor calls: %s", e)
        log.info("%d worker actor(s) ready, %d KV blocks each, compiled graph: %s", self.world_size, self.num_blocks,
                 self.compiled is not None)

    def _compile(self):
        from ray.dag import InputNode, MultiOutputNode

        with InputNode() as step:
            dag = MultiOutputNode([w.execute.bind(step[0], step[1]) for w in self.workers])
        return dag.experimental_compile()

    @property
    def takes_late_masks(self) -> bool:
        """A compiled graph's actors take no calls besides the graph's: its steps get their masks at launch."""
        return self.compiled is None

    @property
    def takes_transfers(self) -> bool:
        """K/V transfers are calls of their own to the actors, which a compiled graph's do not take."""
        return self.compiled is None

    def launch(self, batch: StepBatch) -> tuple[int, object]:
        """(the step's number, its refs: a compiled graph's one, or each rank's)."""
        step = self.steps_sent
        self.steps_sent += 1
        if self.compiled is not None:
            try:
                return step, self.compiled.execute(step, batch)
            except RayError as e:
                raise WorkerFailure(f"worker failed during a step: {_cause(e)}") from e
        if not self.workers:
            raise WorkerFailure("no worker actors (an earlier restart failed)")
        ref = ray.put(batch)  # one copy in the object store; every rank reads the same ref
        return step, [w.execute.remote(step, ref) for w in self.workers]

    def sample(self, handle: tuple[int, object], masks: list[bytes | None]) -> None:
        if not self.workers:
            raise WorkerFailure("no worker actors (an earlier restart failed)")
        self.workers[0].give_late_masks.remote(handle[0], masks)

    def collect(self, handle: tuple[int, object]) -> StepOutput:
        _, refs = handle
        if self.compiled is not None:
            try:
                # The graph is torn down when any of its actors dies, so a dead rank fails this at once.
                return ray.get(refs, timeout=STEP_TIMEOUT_S)[0]
            except (RayError, GetTimeoutError) as e:
                raise WorkerFailure(f"worker failed during a step: {_cause(e)}") from e
        pending = list(refs)
        try:
            # Wait for every rank, but fail as soon as any one fails: the others may be stuck in a
            # collective waiting for the dead one.
            while pending:
                done, pending = ray.wait(pending, num_returns=1, timeout=STEP_TIMEOUT_S)
                if not done:
                    raise WorkerFailure(f"a worker did not finish the step within {STEP_TIMEOUT_S:.0f}s")
                ray.get(done)
            return ray.get(refs[0])
        except RayError as e:
            raise WorkerFailure(f"worker failed during a step: {_cause(e)}") from e

    async def collect_async(self, handle: tuple[int, object]) -> StepOutput:
        _, refs = handle
        if self.compiled is not None:
            return await asyncio.to_thread(self.collect, handle)
        futures = [asyncio.wrap_future(r.future()) for r in refs]
        done, pending = await asyncio.wait(futures, timeout=STEP_TIMEOUT_S, return_when=asyncio.FIRST_EXCEPTION)
        for f in done:
            if f.exception() is not None:
                for p in pending:
                    p.cancel()
                raise WorkerFailure(f"worker failed during a step: {_cause(f.exception())}") from f.exception()
        if pending:
            for p in pending:
                p.cancel()
            raise WorkerFailure(f"a worker did not finish the step within {STEP_TIMEOUT_S:.0f}s")
        return futures[0].result()

    def take_export(self, export_id: int) -> list:
        """Each rank's references: the pages go from each worker to where they are read, not through here."""
        return [w.take_export.remote(export_id) for w in self.workers]

    def stage_import(self, import_id: int, pages: list) -> None:
        if len(pages) != len(self.workers):
            raise ValueError(f"the K/V pages fetched are {len(pages)} ranks'; this replica has {len(self.workers)}")
        ray.get([w.stage_import.remote(import_id, p) for w, p in zip(self.workers, pages, strict=True)],
                timeout=TRANSFER_TIMEOUT_S)

    def worker_pids(self) -> list[int]:
        return ray.get([w.pid.remote() for w in self.workers])

    async def check_health(self) -> None:
        """RuntimeError when a worker is gone or does not answer (it answers between and during steps)."""
        if not self.workers:
            raise RuntimeError("no worker actors (an earlier restart failed)")
        try:
            await asyncio.wait_for(asyncio.gather(*[w.pid.remote() for w in self.workers]), HEALTH_TIMEOUT_S)
        except (RayError, TimeoutError) as e:
            raise RuntimeError(f"a worker actor is gone: {_cause(e)}") from None

    def restart(self) -> None:
        """Replace every worker (the survivors may be wedged in a collective) with the same pool size."""
        self.shutdown()
        self._start()

    def shutdown(self) -> None:
        if self.compiled is not None:
            try:
                self.compiled.teardown()
            except Exception:  # its actors may already be dead
                pass
            self.compiled = None
        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:  # already gone
                pass
        self.workers = []
        if self.placement_group is not None:
            try:
                remove_placement_group(self.placement_group)
            except Exception:
                pass
        self.placement_group = None


def _cause(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
