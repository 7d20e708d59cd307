"""One device: the model (shard), its KV pool, and `execute(StepBatch) -> StepOutput` (or `launch`, then
`collect`)."""

from __future__ import annotations

import ctypes
import functools
import logging
import shutil
from collections import Counter

import torch

from pagedserve.config import DEFAULT_CPU_KV_CACHE_MEMORY, EngineConfig
from pagedserve.kernels.backend import get_attention_backend
from pagedserve.kernels.cpu import quant_linear
from pagedserve.kernels.cpu.native_forward import attach_native_experts
from pagedserve.kernels.cpu.packed_linear import can_pack, pack_linears
from pagedserve.scheduler.batch import SampleSpec, StepBatch, StepOutput
from pagedserve.scheduler.kv_groups import KVGroup, blocks_held_at_most
from pagedserve.workers.adapter_loader import AdapterLoader
from pagedserve.workers.draft import DraftRunner
from pagedserve.workers.gguf import GGUF_BLOCKS_NAME
from pagedserve.workers.kv_pool import allocate_kv_pool, bytes_per_block, model_kv_groups, parse_memory
from pagedserve.workers.kv_transfer import KVTransfer
from pagedserve.workers.loader import ModelSource, build_model, resolve_model
from pagedserve.workers.model_runner import LaunchedStep, ModelRunner
from pagedserve.workers.models.llama import CausalLM
from pagedserve.workers.models.model_config import ModelConfig
from pagedserve.workers.models.parallel import TPLayout
from pagedserve.workers.offload_store import OffloadStore, offload_dir
from pagedserve.workers.sampler import Sampler

log = logging.getLogger(__name__)

# The row count oneDNN tunes packed weights for: decode batches, where packing gains the most.
PACK_BATCH_HINT = 16


class Worker:
    """Rank `rank` of a tensor-parallel group of `world_size` (1: a plain single-device worker).

    Two-phase start: the constructor loads the model shard and measures how many KV blocks fit in the pool the
    KV-cache groups share (`available_blocks`); the engine takes the minimum over ranks and calls `init_kv_pool`.
    """

    def __init__(self, config: EngineConfig, source: ModelSource, model_config: ModelConfig,
                 max_model_len: int, rank: int = 0, world_size: int = 1, dist_init_method: str | None = None) -> None:
        self.config = config
        self.model_config = model_config
        self.rank = rank
        self.device = config.torch_device()
        if self.device.type == "cuda":
            if self.device.index is None:  # set_device refuses a bare "cuda", and tensors report "cuda:N"
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
            torch.cuda.empty_cache()  # the weights must not land inside a cached segment the pool needs whole
        self.dtype = config.torch_dtype(self.device, model_config.torch_dtype)
        self.max_model_len = max_model_len
        backend = None
        if world_size > 1:
            backend = _init_distributed(self.device, rank, world_size, dist_init_method, config.shares_gpus())
        self.tp = TPLayout.make(model_config, rank, world_size, host_collectives=backend == "gloo")
        self.model = self._load(source, model_config, self.tp)
        self.draft_model: CausalLM | None = None
        speculative = config.speculative()
        # A draft model runs whole on rank 0, which gives the other ranks its proposals (`ModelRunner._drafts`).
        if speculative is not None and speculative.method == "draft_model" and rank == 0:
            draft_source = resolve_model(speculative.model)
            draft_config = ModelConfig.from_file(draft_source.config_path)
            self.draft_model = self._load(draft_source, draft_config, TPLayout.make(draft_config, 0, 1))
        self.adapters = None  # the model's LoRA adapter slots (before the KV budget is measured: they count in it)
        if config.enable_lora:
            self.adapters = AdapterLoader(self.model, config.max_loras, config.max_lora_rank,
                                          config.max_cpu_loras or config.max_loras)
        _return_freed_heap()
        self.backend = get_attention_backend(config.attention_backend, self.device)
        self.sampler = Sampler(self.device, config.seed)
        self.available_blocks = self._count_blocks()
        self.available_offload_blocks = self._count_offload_blocks()
        self.runner: ModelRunner | None = None

    def _load(self, source: ModelSource, model_config: ModelConfig, tp: TPLayout) -> CausalLM:
        """A model (the target, or a draft) with its weights on this worker's device, its linear layers on the
        kernels that serve them here."""
        blocks = None if source.is_random else source.weights_dir / GGUF_BLOCKS_NAME
        held_by = None
        if self.config.gguf_linears and blocks is not None and blocks.is_file() and quant_linear.available(
                self.device, self.dtype):
            # The layers a GGUF holds as blocks are made from them before the checkpoint is read, so their fp32
            # copies are never loaded: memory holds about the GGUF's bytes, not four bytes a weight.
            held_by = functools.partial(quant_linear.load_gguf_linears, blocks_path=blocks)
        model = build_model(source, model_config, self.dtype, self.device, self.max_model_len, self.config.seed,
                            tp, held_by)
        if quant_linear.available(self.device, self.dtype):
            # The other fp32 layers through the same kernel, unquantized: every row computed the same way in any
            # batch (oneDNN's GEMM blocks by the batch's rows), and the whole model in one call per step. A 16-bit
            # checkpoint's weights stay 16-bit there, exactly: half the bytes a decode step streams.
            quant_linear.load_fp32_linears(model)
            attach_native_experts(model)  # a MoE layer's experts on those layers: one native call
            embedding = quant_linear.hold_embedding(model)
            table, head = model.model.embed_tokens.table, getattr(model, "lm_head", None)
            types = Counter(m.qtype for m in model.modules()
                            if isinstance(m, quant_linear.QuantLinear) and (m is not table or m is head))
            log.info("rank %d: linear layers on the CPU kernel, by weight type: %s; embedding table %s", self.rank,
                     ", ".join(f"{t} {n}" for t, n in sorted(types.items())), embedding)
        if can_pack(self.device, self.dtype):  # what is left: bf16, or a CPU without AVX2
            pack_linears(model, PACK_BATCH_HINT)
        return model

    def init_kv_pool(self, num_blocks: int, offload_blocks: int = 0) -> None:
        """The pool of `num_blocks` blocks, shared by the KV-cache groups, and a second tier of `offload_blocks`."""
        self.runner = None  # release a previous pool before allocating its replacement (no 2x peak)
        kv_pool = allocate_kv_pool(self.model_config, num_blocks, self.config.block_size, self.dtype, self.device,
                                   self.tp.num_kv_heads)
        self.runner = ModelRunner(self.model, kv_pool, self.backend, self.config.block_size,
                                  self.sampler if self.rank == 0 else None,
                                  share_draws=self.tp.size > 1 and self.config.schedules_ahead(self.device.type))
        self.runner.draft = self._draft_runner(num_blocks)
        self.runner.adapters = self.adapters
        pools = [kv_pool] + ([self.runner.draft.kv_pool] if self.runner.draft is not None else [])
        if offload_blocks:
            medium, _ = self.config.offload_tier()
            self.runner.offload = OffloadStore(pools, offload_blocks, medium, self.config.kv_offload_dir)
        self.runner.transfer = KVTransfer(pools, self.runner.offload)
        if self.config.replays_graphs(self.device.type):
            if self.device.type == "cuda" and self.model_config.num_experts and self.backend.fused_experts is None:
                # the loop over experts reads each expert's token count on the host: not capturable
                log.info("CUDA graphs are off for a mixture-of-experts model on the %s backend: decode steps run "
                         "eagerly", self.backend.name)
            elif self.device.type == "cuda":
                self.runner.use_decode_graphs(self.config.max_num_seqs, self.max_model_len)
            else:
                log.warning("cuda_graphs=True has no effect on %s", self.device)
        log.info("rank %d KV pool: %d blocks of %d tokens (%.1f MiB) on %s", self.rank, num_blocks,
                 self.config.block_size, kv_pool.numel() * kv_pool.element_size() / 2**20, self.device)

    def execute(self, batch: StepBatch, late_masks: list[bytes | None] | None = None) -> StepOutput | None:
        """Every rank runs the step; rank 0 returns the sampled tokens, the others None."""
        return self.collect(self.launch(batch, late_masks))

    def launch(self, batch: StepBatch, late_masks: list[bytes | None] | None = None) -> LaunchedStep:
        """Queue the step on the device; `collect` waits for it. A batch with `StepBatch.late_masks` draws
        once `sample` gives them, unless `late_masks` does here."""
        return self.runner.launch(batch, late_masks)

    def sample(self, step: LaunchedStep, late_masks: list[bytes | None]) -> None:
        """Queue the draws of a launched step that waited for its grammar masks."""
        self.runner.sample(step, late_masks)

    def collect(self, step: LaunchedStep) -> StepOutput | None:
        return self.runner.collect(step)

    def _block_bytes(self) -> int:
        """A block's bytes in every pool of this rank: the model's heads, and a draft's (whose pool has as many)."""
        per_block = bytes_per_block(self.model_config, self.config.block_size, self.dtype, self.tp.num_kv_heads)
        if self.draft_model is not None:
            per_block += bytes_per_block(self.draft_model.config, self.config.block_size, self.dtype)
        return per_block

    def _count_offload_blocks(self) -> int:
        """How many blocks the second tier's budget holds (0 without one)."""
        tier = self.config.offload_tier()
        if tier is None:
            return 0
        medium, budget = tier
        name = f"kv_offload_{medium}"
        if medium == "memory" and self.device.type != "cuda":
            raise ValueError(f"kv_offload_memory is host memory beside a GPU's pool; the workers compute on "
                             f"{self.device.type}, whose pool is host memory already: set kv_offload_disk instead")
        per_block = self._block_bytes()
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(f"{name}={getattr(self.config, name)!r} holds no block of {self.config.block_size} "
                             f"tokens ({per_block} bytes)")
        if medium == "disk":
            folder = offload_dir(self.config.kv_offload_dir)
            free = shutil.disk_usage(folder).free
            if budget > free:
                raise ValueError(f"kv_offload_disk={self.config.kv_offload_disk!r} is more than the "
                                 f"{free / 2**30:.1f} GiB free in {folder} (kv_offload_dir)")
        return num_blocks

    def _count_blocks(self) -> int:
        """How many blocks of the shared pool the KV budget holds."""
        groups = model_kv_groups(self.model_config)
        sliding = any(group.window is not None for group in groups)
        per_block = self._block_bytes()
        if self.config.kv_cache_memory is not None:
            budget = parse_memory(self.config.kv_cache_memory)
        elif self.device.type == "cuda":
            budget = self._cuda_budget()
        else:  # host memory, zeroed at once: no more than running sequences can hold (and the placeholder)
            budget = min(DEFAULT_CPU_KV_CACHE_MEMORY, (self._most_blocks_held(groups) + sliding) * per_block)
        num_blocks = max(0, budget) // per_block
        if num_blocks - sliding < 1:  # with sliding groups the pool reserves a placeholder block
            source = (f"kv_cache_memory={self.config.kv_cache_memory!r}" if self.config.kv_cache_memory is not None
                      else f"gpu_memory_utilization={self.config.gpu_memory_utilization} (after the weights and "
                      "a profiled step; lower max_num_batched_tokens or max_num_seqs to shrink the step)")
            raise ValueError(f"{source} leaves {budget} bytes for the KV cache, less than one block of "
                             f"{self.config.block_size} tokens ({per_block} bytes)")
        return num_blocks

    def _most_blocks_held(self, groups: list[KVGroup]) -> int:
        """The most blocks running sequences can hold at once: max_num_seqs sequences of max_model_len tokens, each
        holding in every KV-cache group what the scheduler counts for it. A larger pool only keeps more finished
        prompts for the prefix cache."""
        chunk = self.config.batched_tokens(self.device.type)
        per_sequence = sum(blocks_held_at_most(group.window, self.config.block_size, self.max_model_len, chunk)
                           for group in groups)
        return self.config.max_num_seqs * per_sequence

    def _cuda_budget(self) -> int:
        """This worker's share of the device's memory (`gpus_per_worker`) x utilization, minus what is allocated
        (weights), a profiled step's peak and, on a device of its own, what other processes hold."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self.profile_step()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        torch.cuda.empty_cache()  # hand the throwaway pool back before the real one is allocated
        total = torch.cuda.get_device_properties(self.device).total_memory
        free, _ = torch.cuda.mem_get_info(self.device)
        used_elsewhere = total - free - torch.cuda.memory_reserved(self.device)  # other processes
        share = self.config.gpus_per_worker
        budget = kv_budget(total, self.config.gpu_memory_utilization, before, peak, used_elsewhere, share)
        log.info("CUDA memory: total %.1f GiB (this worker's share %g), weights %.1f GiB, activation peak %.2f GiB, "
                 "other processes %.1f GiB, KV budget %.1f GiB", total / 2**30, share, before / 2**30, peak / 2**30,
                 used_elsewhere / 2**30, budget / 2**30)
        return budget

    def profile_step(self) -> StepOutput | None:
        """Run the largest step the scheduler may send, on a throwaway pool, to measure activations."""
        num_groups = len(model_kv_groups(self.model_config))
        speculative = self.config.speculative()
        batch = profile_batch(self.config.batched_tokens(self.device.type), self.config.max_num_seqs,
                              self.config.block_size, num_groups,
                              speculative.num_speculative_tokens if speculative else 0,
                              speculative is not None and speculative.method == "draft_model")
        num_blocks = sum(len(ids) for _, _, ids in batch.table_updates[0])
        pool = allocate_kv_pool(self.model_config, num_blocks, self.config.block_size, self.dtype, self.device,
                                self.tp.num_kv_heads)
        runner = ModelRunner(self.model, pool, self.backend, self.config.block_size,
                             self.sampler if self.rank == 0 else None)
        runner.draft = self._draft_runner(num_blocks)  # its passes and distributions count in the peak too
        if self.adapters is not None:  # every row through an adapter slot (holding zeros): its products count too
            runner.adapters = self.adapters
            batch.lora_slots = [0] * batch.num_rows
        return runner.execute(batch)

    def _draft_runner(self, num_blocks: int) -> DraftRunner | None:
        """The draft model's runner over a pool of its own of `num_blocks` (the model's block ids); None without
        a draft."""
        if self.draft_model is None:
            return None
        pool = allocate_kv_pool(self.draft_model.config, num_blocks, self.config.block_size, self.dtype, self.device)
        return DraftRunner(self.draft_model, pool, self.backend, self.config.block_size, self.sampler.generator)


def kv_budget(total: int, utilization: float, allocated: int, activation_peak: int, used_elsewhere: int,
              share: float = 1.0) -> int:
    """Bytes left for the KV pool: this process may use `utilization` of its `share` of the device, less what it
    already holds (weights), the peak a step adds on top, and, on a device of its own, what other processes hold.
    Workers that share a device start at the same time, so what the others hold then is no measure of what they
    will: each keeps to its share."""
    return int(total * share * utilization) - allocated - activation_peak - (used_elsewhere if share == 1 else 0)


def profile_batch(num_tokens: int, max_num_seqs: int, block_size: int, num_groups: int = 1,
                  num_proposals: int = 0, draft: bool = False) -> StepBatch:
    """The worst step the scheduler can send: `num_tokens` fresh tokens spread over as many rows as it
    allows, every row sampled with the costliest sampling path (penalties, top-k/top-p sort, min-p, 20
    logprobs), and with speculative decoding (`num_proposals` a row at most) verifying as many of its last tokens
    as proposals as it may (`draft`: a draft model's): the sampler's rows are then up to 1 + num_proposals a row.
    The penalties make the sampler allocate its counts up to its rows' slots, memory that stays and is so counted
    in the profile: the rows take the last slots, so that the counts cover all max_num_seqs slots the scheduler may
    hand out, even when a step holds fewer rows than that. Its sequence ids are negative: no real sequence's counts
    are these. Every KV-cache group gets the same tables (the groups then write the same pages of the throwaway
    pool: its values are never read as anyone's)."""
    from pagedserve.sampling_params import SamplingParams

    rows = max(1, min(max_num_seqs, num_tokens))
    row_len = [num_tokens // rows + (1 if r < num_tokens % rows else 0) for r in range(rows)]
    slots = list(range(max_num_seqs - rows, max_num_seqs))
    updates, cu, next_block = [], [0], 0  # each row's whole table, in a slot of its own
    for slot, n in zip(slots, row_len, strict=True):
        blocks = -(-n // block_size)
        updates.append((slot, 0, list(range(next_block, next_block + blocks))))
        next_block += blocks
        cu.append(cu[-1] + n)
    costly = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, logprobs=20, max_tokens=1,
                            repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.5)
    samples = [SampleSpec(seq_id=-1 - r, row=r, num_samples=1, sample_index=0, output_len=0, params=costly,
                          prompt_token_ids=[0] * n, output_token_ids=[],
                          proposals=[0] * min(num_proposals, n - 1) or None, draft=draft and n > 1)
               for r, n in enumerate(row_len)]
    return StepBatch(input_ids=[0] * num_tokens, cu_seqlens_q=cu, context_lens=row_len, slots=slots,
                     table_updates=[updates] * num_groups, block_copies=[],
                     samples=samples)


def _return_freed_heap() -> None:
    """Give the heap's free pages back to the system. Loading frees about a model's worth of temporaries (fp32
    weights replaced by blocks or panels, slices read and repacked), and glibc keeps them: a 1B-shaped Q4_K_M
    model's process stayed about 0.9 GB larger than it needed."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to ask
        pass


def process_group_backend(device: torch.device, shared_device: bool) -> str:
    """The ranks' collective backend: NCCL on CUDA, gloo on CPUs and for ranks that may share a GPU
    (`shared_device`), which NCCL refuses."""
    return "nccl" if device.type == "cuda" and not shared_device else "gloo"


def _init_distributed(device: torch.device, rank: int, world_size: int, init_method: str | None,
                      shared_device: bool = False) -> str:
    """Join the ranks' process group (`process_group_backend`); its backend."""
    import datetime

    import torch.distributed as dist

    if init_method is None:
        raise ValueError("tensor parallelism needs a dist_init_method (tcp://host:port)")
    backend = process_group_backend(device, shared_device)
    # A short timeout: a rank that died must not leave the others blocked in a collective for 30 minutes.
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    return backend
