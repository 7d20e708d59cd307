"""Tensor-parallel layout (Megatron-style) and the collectives the model shard needs.

Query heads and MLP columns are split across ranks; KV heads too, or replicated when
tp > num_kv_heads; the vocabulary is split in equal (padded) shards. With one rank every
collective is a no-op, so the single-device path runs exactly the plain model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TPLayout:
    rank: int
    size: int
    num_heads: int  # local query heads
    num_kv_heads: int  # local KV heads
    q_head_start: int
    kv_head_start: int
    intermediate_size: int  # local MLP columns
    vocab_start: int
    vocab_shard: int  # rows per rank (the last shard is padded)
    moe_intermediate_size: int = 0  # each expert's local columns (every expert is split, as the MLP is)
    shared_expert_intermediate_size: int = 0  # the shared expert's local columns (Qwen2-MoE's)
    # The ranks' collectives go through host memory: a gloo group, whose CUDA support covers only some collectives
    # (ranks sharing a GPU). On a CPU the host copies are the tensors themselves, so CPU ranks run this same path.
    host_collectives: bool = False

    @classmethod
    def make(cls, config, rank: int = 0, size: int = 1, host_collectives: bool = False) -> TPLayout:
        """Raises ValueError when `size` cannot split this model evenly."""
        check_tp_size(config, size)
        if not 0 <= rank < size:
            raise ValueError(f"tensor-parallel rank {rank} outside [0, {size})")
        heads = config.num_heads // size
        if config.num_kv_heads >= size:
            kv_heads = config.num_kv_heads // size
            kv_start = rank * kv_heads
        else:  # replicate: each rank's query heads all map onto one KV head
            kv_heads = 1
            kv_start = rank * config.num_kv_heads // size
        inter = config.intermediate_size // size
        shard = -(-config.vocab_size // size)
        return cls(rank, size, heads, kv_heads, rank * heads, kv_start, inter, rank * shard, shard,
                   config.moe_intermediate_size // size, config.shared_expert_intermediate_size // size,
                   host_collectives)

    def mlp_columns(self, name: str) -> int:
        """The local intermediate columns of the MLP an HF tensor `name` belongs to: an expert's, the shared
        expert's, or the dense MLP's."""
        if ".experts." in name:
            return self.moe_intermediate_size
        if ".shared_expert." in name:
            return self.shared_expert_intermediate_size
        return self.intermediate_size


def shard_range(name: str, tp: TPLayout, config) -> tuple[int, int, int] | None:
    """(dim, start, length) of this rank's part of an HF tensor; None: every rank holds all of it."""
    d = config.head_dim
    if ".q_proj." in name:
        return 0, tp.q_head_start * d, tp.num_heads * d
    if ".k_proj." in name or ".v_proj." in name:
        return 0, tp.kv_head_start * d, tp.num_kv_heads * d
    if name.endswith(".self_attn.sinks"):  # one logit per query head
        return 0, tp.q_head_start, tp.num_heads
    if config.family.qk_norm_across_heads and name.endswith("q_norm.weight"):  # one weight per dim of every head
        return 0, tp.q_head_start * d, tp.num_heads * d
    if config.family.qk_norm_across_heads and name.endswith("k_norm.weight"):
        return 0, tp.kv_head_start * d, tp.num_kv_heads * d
    inter = tp.mlp_columns(name)
    if name.endswith((".experts.gate_proj", ".experts.up_proj", ".experts.gate_proj_bias", ".experts.up_proj_bias")):
        return 1, tp.rank * inter, inter  # stacked experts [E, I, H] (their biases [E, I]): their columns
    if name.endswith(".experts.down_proj"):  # [E, H, I]
        return 2, tp.rank * inter, inter
    if ".gate_proj." in name or ".up_proj." in name:
        return 0, tp.rank * inter, inter
    if name.endswith("o_proj.weight"):
        return 1, tp.q_head_start * d, tp.num_heads * d
    if name.endswith("down_proj.weight"):
        return 1, tp.rank * inter, inter
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return 0, tp.vocab_start, tp.vocab_shard  # the last shard may run past the vocabulary: padding
    return None


def check_tp_size(config, size: int) -> None:
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size={size!r} must be an integer >= 1")
    if config.num_heads % size:
        raise ValueError(f"tensor_parallel_size={size} must divide num_attention_heads={config.num_heads}")
    if config.num_kv_heads % size and size % config.num_kv_heads:
        raise ValueError(f"tensor_parallel_size={size} and num_key_value_heads={config.num_kv_heads}: "
                         "one must divide the other (KV heads are split or replicated)")
    for key in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if getattr(config, key) % size:
            raise ValueError(f"tensor_parallel_size={size} must divide {key}={getattr(config, key)}")


def all_reduce(x: torch.Tensor, layout: TPLayout) -> torch.Tensor:
    """The sum of every rank's `x`, in place."""
    if layout.size > 1:
        import torch.distributed as dist

        if layout.host_collectives:
            host = x.cpu()  # x itself on a CPU
            dist.all_reduce(host)
            x.copy_(host)
        else:
            dist.all_reduce(x)
    return x


def broadcast(x: torch.Tensor, layout: TPLayout, src: int = 0) -> torch.Tensor:
    """Rank `src`'s `x` on every rank, in place."""
    import torch.distributed as dist

    if layout.host_collectives:
        host = x.cpu()
        dist.broadcast(host, src=src)
        x.copy_(host)
    else:
        dist.broadcast(x, src=src)
    return x


def all_gather_last_dim(x: torch.Tensor, layout: TPLayout) -> torch.Tensor:
    """[..., n] on every rank -> [..., size * n] in rank order."""
    if layout.size == 1:
        return x
    import torch.distributed as dist

    local = (x.cpu() if layout.host_collectives else x).contiguous()
    parts = [torch.empty_like(local) for _ in range(layout.size)]  # each [..., n]
    dist.all_gather(parts, local)
    return torch.cat(parts, dim=-1).to(x.device)
