"""Engine settings, as the `LLM` constructor and the CLI take them."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from pagedserve.chat.reasoning import check_reasoning_parser
from pagedserve.scheduler.scheduler import POLICIES
from pagedserve.speculative.speculative_config import SpeculativeConfig
from pagedserve.workers.kv_pool import parse_memory

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30


@dataclass
class EngineConfig:
    model: str | None = None  # None: the embedded SmolLM2; a checkpoint dir; a .gguf; "random:<config.json>"
    dtype: str = "auto"  # auto: fp32 on CPU, the checkpoint's half type (or bf16) on CUDA
    device: str = "auto"
    block_size: int = 16
    kv_cache_memory: int | str | None = None  # bytes for the KV pool; on CPU at most 1 GiB by default
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    # "fcfs": requests run in the order they came; "priority": by their SamplingParams.priority (lower first),
    # a more urgent request preempting less urgent ones when there is no room for it
    scheduling_policy: str = "fcfs"
    max_num_batched_tokens: int | None = None  # default 2048 on CPU, 8192 on CUDA
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    seed: int = 0
    attention_backend: str = "auto"  # auto | triton | cpu | reference
    executor: str = "local"  # local: the worker in this process; ray: worker actors (one per GPU / CPU slot)
    tensor_parallel_size: int = 1  # ranks of one model replica (needs executor="ray" when > 1)
    # CPUs each Ray worker actor reserves and computes on (its torch threads). None: it reserves one and
    # computes on the node's cores shared among its replica's ranks, which replicas sharing a node of CPUs
    # then oversubscribe: give them worker_cpus that add up to the node's cores.
    worker_cpus: int | None = None
    # The share of a GPU each Ray worker actor reserves: 1, a GPU of its own; below 1, ranks may share one (tensor
    # parallelism on fewer GPUs than ranks, e.g. 0.5 for two ranks on one GPU). Ranks that share a GPU talk over
    # gloo (NCCL refuses two ranks on one device) and are never captured in CUDA graphs; each sizes its KV pool
    # from its share of the device's memory.
    gpus_per_worker: float = 1.0
    # Replay decode steps from CUDA graphs. None: on when the workers run on CUDA (on an H100 a small model
    # decodes several times faster: its eager step waits on kernel launches); a CPU has none.
    cuda_graphs: bool | None = None
    # On a CPU in fp32, linear layers of a GGUF checkpoint compute from its own Q4_0/Q4_1/Q8_0 blocks (the
    # same weights as the fp32 conversion, a sixth to a quarter of the bytes per decode step); False: from fp32.
    gguf_linears: bool = True
    # Schedule and launch each step while the one before it runs, its inputs drawn by that step filled in on
    # the workers, so that the device need not wait for the host between steps. None: on when the workers
    # run on CUDA; off on a CPU, where a step computes when it runs, so scheduling ahead would only delay outputs.
    async_scheduling: bool | None = None
    # Parse a reasoning model's thinking (`<think>...</think>`) out of its chat answers, and start a request's
    # output constraint after it: "qwen3" or "deepseek_r1" (pagedserve/chat/reasoning.py); None: no parsing.
    reasoning_parser: str | None = None
    # Speculative decoding, in vLLM's shape: {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_max": n, "prompt_lookup_min": m} proposes up to k tokens a step copied from where the
    # sequence's last n..m tokens occurred before, all verified by one step (pagedserve/speculative/).
    speculative_config: dict[str, Any] | None = None
    # LoRA adapters (PEFT's format) over the model, chosen per request (vLLM's names): up to `max_loras` of them in
    # one step, each in a slot of the workers' (swapped, least recently used first), of rank up to `max_lora_rank`;
    # the workers keep `max_cpu_loras` read adapters in host memory (None: max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # The prefix cache's second tier: full blocks evicted from the KV pool are kept (least recently used go first)
    # and copied back on a hit instead of recomputed: `kv_offload_memory` bytes of pinned host memory beside a CUDA
    # pool, or `kv_offload_disk` bytes of a file on local disk, in `kv_offload_dir` (default: the cache directory's
    # kv-offload). Per worker: a tensor-parallel rank keeps its own heads. On a CPU, where the pool is host memory
    # already, the tier is a disk's.
    kv_offload_memory: int | str | None = None
    kv_offload_disk: int | str | None = None
    kv_offload_dir: str | None = None

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size={self.block_size} must be a power of two in [1, 128]")
        if self.dtype not in ("auto", *_DTYPES):
            raise ValueError(f"dtype={self.dtype!r} must be 'auto' or one of {sorted(_DTYPES)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if self.scheduling_policy not in POLICIES:
            raise ValueError(f"scheduling_policy={self.scheduling_policy!r} must be one of {POLICIES}")
        if self.executor not in ("local", "ray"):
            raise ValueError(f"executor={self.executor!r} must be 'local' or 'ray'")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size!r} must be an integer >= 1")
        if self.tensor_parallel_size > 1 and self.executor != "ray":
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} needs executor='ray'")
        for name in _ON_FOR_CUDA:
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name}={value!r} must be true, false or null (auto)")
        check_reasoning_parser(self.reasoning_parser)
        SpeculativeConfig.parse(self.speculative_config)
        if not isinstance(self.gguf_linears, bool):
            raise ValueError(f"gguf_linears={self.gguf_linears!r} must be true or false")
        self._check_gpu_share()
        self._check_lora()
        self._check_offload()
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "worker_cpus"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} must be an integer >= 1")

    def _check_gpu_share(self) -> None:
        share = self.gpus_per_worker
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share <= 1:
            raise ValueError(f"gpus_per_worker={share!r} must be a number in (0, 1]")
        if share == 1:
            return
        if self.executor != "ray":
            raise ValueError(f"gpus_per_worker={share} needs executor='ray' (Ray places workers on shares of a GPU)")
        if self.device == "cpu":
            raise ValueError(f"gpus_per_worker={share} has no meaning with device='cpu'")
        if self.shares_gpus() and self.cuda_graphs:
            raise ValueError(f"cuda_graphs=True with gpus_per_worker={share} and tensor_parallel_size="
                             f"{self.tensor_parallel_size}: ranks that share a GPU all-reduce over gloo, on the host, "
                             "which a CUDA graph cannot capture (leave cuda_graphs null or false)")

    def _check_lora(self) -> None:
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora={self.enable_lora!r} must be true or false")
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
            if not self.enable_lora and value != _LORA_DEFAULTS[name]:
                raise ValueError(f"{name}={value!r} needs enable_lora=True")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras={self.max_cpu_loras} must be at least max_loras={self.max_loras}")

    def _check_offload(self) -> None:
        sizes = {name: getattr(self, name) for name in ("kv_offload_memory", "kv_offload_disk")
                 if getattr(self, name) is not None}
        for name, value in sizes.items():
            if parse_memory(value, name) < 1:
                raise ValueError(f"{name}={value!r} must be a size above 0 (e.g. 8GiB), or null for no tier")
        if len(sizes) > 1:
            raise ValueError("kv_offload_memory and kv_offload_disk are both set: the second tier is one of them")
        if sizes and not self.enable_prefix_caching:
            raise ValueError(f"{next(iter(sizes))} keeps the prefix cache's blocks: it needs enable_prefix_caching")
        if "kv_offload_memory" in sizes and self.device == "cpu":
            raise ValueError("kv_offload_memory is host memory beside a GPU's pool; on device='cpu' the pool is host "
                             "memory already: raise kv_cache_memory, or set kv_offload_disk")
        if self.kv_offload_dir is not None and "kv_offload_disk" not in sizes:
            raise ValueError(f"kv_offload_dir={self.kv_offload_dir!r} needs kv_offload_disk")

    def offload_tier(self) -> tuple[str, int] | None:
        """The second tier's medium ("memory" or "disk") and bytes per worker; None without one."""
        if self.kv_offload_memory is not None:
            return "memory", parse_memory(self.kv_offload_memory, "kv_offload_memory")
        if self.kv_offload_disk is not None:
            return "disk", parse_memory(self.kv_offload_disk, "kv_offload_disk")
        return None

    def speculative(self) -> SpeculativeConfig | None:
        """`speculative_config`'s settings (None: no speculative decoding)."""
        return SpeculativeConfig.parse(self.speculative_config)

    def shares_gpus(self) -> bool:
        """Whether tensor-parallel ranks may share a GPU (`gpus_per_worker` below 1): they then talk over gloo."""
        return self.gpus_per_worker < 1 and self.tensor_parallel_size > 1

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, device: torch.device, checkpoint_dtype: str | None) -> torch.dtype:
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        if device.type == "cpu":
            return torch.float32
        return _DTYPES[checkpoint_dtype] if checkpoint_dtype in ("float16", "bfloat16") else torch.bfloat16

    def batched_tokens(self, device_type: str) -> int:
        """The step's token budget for workers on `device_type` ("cuda", "cpu")."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 8192 if device_type == "cuda" else 2048

    def replays_graphs(self, device_type: str) -> bool:
        """Whether decode steps replay CUDA graphs (`cuda_graphs`) for workers on `device_type`: never for ranks
        that share a GPU (their collectives run on the host)."""
        return not self.shares_gpus() and self._on_for_cuda("cuda_graphs", device_type)

    def schedules_ahead(self, device_type: str) -> bool:
        """Whether steps are scheduled ahead (`async_scheduling`) for workers on `device_type`."""
        return self._on_for_cuda("async_scheduling", device_type)

    def _on_for_cuda(self, name: str, device_type: str) -> bool:
        """Setting `name` of `_ON_FOR_CUDA` as set, or when null (auto) whether the workers run on CUDA."""
        value = getattr(self, name)
        return value if value is not None else device_type == "cuda"


_LORA_DEFAULTS = {"max_loras": 1, "max_lora_rank": 16, "max_cpu_loras": None}
# Settings that are true, false or null: null turns them on where the workers run on CUDA.
_ON_FOR_CUDA = ("async_scheduling", "cuda_graphs")


def ray_hosted_config(settings: EngineConfig | dict[str, Any]) -> EngineConfig:
    """The settings of an engine that Ray hosts (an actor, a Serve replica). Its workers are Ray actors of
    their own (one per GPU / CPU slot), so `executor` is "ray" whatever the settings leave it at; settings
    given as a dict (a Serve config) may name no other executor."""
    if isinstance(settings, EngineConfig):
        return replace(settings, executor="ray")
    if settings.get("executor", "ray") != "ray":
        raise ValueError(f"executor={settings['executor']!r}: a served engine runs its workers as Ray actors "
                         "(leave executor out, or set 'ray')")
    return EngineConfig(**{**settings, "executor": "ray"})
