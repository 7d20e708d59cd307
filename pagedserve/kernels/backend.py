"""The attention contract between the model and the kernels, and the backends that fulfil it.

A model layer writes its new K/V into the paged pool (`write_kv_cache`) and attends through block
tables (`paged_attention`); the step's tensors reach it as an `AttentionContext` argument. Three
backends implement the contract:

- `triton`: the Triton kernels (`gpu/attention.py`, `gpu/cache.py`), for CUDA (and Triton's interpreter in tests);
- `cpu`: every query token through the native C kernel (`cpu/ops.py`);
- `reference`: plain torch (`reference.py`): the oracle the others are tested against, and the fallback.

No backend is imported here at module level, and none imports this module: each is imported when picked, and
what they share lives apart (`checks.py`).

A backend may also bring the layer's RMSNorm (with the residual add before it) and rotary embedding as one
kernel each (`rms_norm`, `rotate_qk`): Triton's on CUDA, where each eager op is a launch; the CPU's native
rotation, where each is a dispatch. Without them the model runs the reference's torch ops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from pagedserve.kernels.lora_products import LoRAKernel, LoRAStep

BACKENDS = ("auto", "triton", "cpu", "reference")


class WriteKVCache(Protocol):
    def __call__(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Scatter key/value [T, Hkv, D] into kv_cache [2, N, B, Hkv, D] at slot_mapping [T] (-1: skip)."""


class PagedAttention(Protocol):
    def __call__(self, query: torch.Tensor, kv_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, *,
                 max_query_len: int | None = None, max_context_len: int | None = None,
                 window: int | None = None, softcap: float | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Each row's new queries [T, Hq, D] over its paged context, the last `window` positions of it for a
        sliding-window layer, scores soft-capped by `softcap` where given, each head's softmax with its logit of
        `sinks` [Hq] in the denominator where given; see reference.paged_attention."""


class RMSNormRows(Protocol):
    def __call__(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm of each row of x [T, H] (contiguous in H), as reference.rms_norm: of `residual + x` when
        `residual` [T, H] is given, which then holds that sum (in place)."""


class RMSNormHeads(Protocol):
    def __call__(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of each head of x [T, heads, D] (contiguous in D) by weight [D]: a new [T, heads, D]."""


class SiluMul(Protocol):
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for x [T, 2 * I] = [gate | up] (contiguous in I): [T, I]."""


class FusedExperts(Protocol):
    def __call__(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
                 down: torch.Tensor, gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                 activation: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """A mixture-of-experts layer's experts, as workers.models.moe.grouped_experts: x [T, H], routing weights
        and experts [T, k], gate_up [E, 2I, H], down [E, H, I], their biases [E, 2I] and [E, H] where given, the
        activation of [gate | up] rows (None: SiLU(gate) * up) -> [T, H]."""


class RouteTopK(Protocol):
    def __call__(self, logits: torch.Tensor, top_k: int,
                 renormalize: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Router logits [T, E] -> (weights [T, k], expert ids [T, k]): the softmax over all experts, its top k,
        divided by their sum where `renormalize` (workers.models.moe.route's); None where it does not take these
        logits (the caller routes with torch)."""


class RotateQK(Protocol):
    def __call__(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """q [T, Hq, D] and k [T, Hkv, D] (contiguous in D) rotated in place by cos/sin [T, 1, R] (each head's first
        R dims), as reference.rotate_qk."""


@dataclass(frozen=True)
class AttentionBackend:
    name: str  # as `attention_backend` names it
    write_kv_cache: WriteKVCache
    paged_attention: PagedAttention
    rms_norm: RMSNormRows | None = None  # None: the reference's torch ops
    rotate_qk: RotateQK | None = None
    silu_mul: SiluMul | None = None
    rms_norm_heads: RMSNormHeads | None = None  # the per-head q/k norms (Qwen3)
    fused_experts: FusedExperts | None = None  # None: the loop over experts (workers/models/moe.py)
    route_topk: RouteTopK | None = None  # None: torch's ops (the CPU's own: its one-call decoder routes the same)
    lora_add: LoRAKernel | None = None  # LoRA's products per token's slot; None: grouped by adapter with torch


@dataclass
class AttentionContext:
    """One step's attention inputs, shared by every layer."""

    backend: AttentionBackend
    slot_mapping: torch.Tensor  # [T]
    cu_seqlens_q: torch.Tensor  # [R + 1]
    context_lens: torch.Tensor  # [R]
    block_tables: torch.Tensor  # [R, max_blocks]
    max_query_len: int  # host-side maxima: kernels size their launches without a device sync
    max_context_len: int
    token_seq_lens: torch.Tensor | None = None  # [T] each token's sequence length: for dynamic NTK and LongRoPE
    # Further KV-cache groups (sliding-window layers beside full-attention ones, each group with block tables of its
    # own over the shared pool): group g's slot mapping [T] and block tables [R, blocks] are more_tables[g - 1];
    # group 0's are above.
    more_tables: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
    lora: LoRAStep | None = None  # the rows of LoRA adapters, by slot; None: every row is the base model's

    def tables(self, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """KV-cache group `group`'s slot mapping and block tables."""
        return (self.slot_mapping, self.block_tables) if group == 0 else self.more_tables[group - 1]


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend `name` for `device` ("auto": triton on CUDA, cpu on a CPU, else the reference);
    ValueError when it cannot run there."""
    from pagedserve.kernels.cpu import ops as cpu

    if name not in BACKENDS:
        raise ValueError(f"attention_backend={name!r} must be one of {BACKENDS}")
    if name == "auto":
        if device.type == "cuda":
            name = "triton" if _triton_available() else "reference"
        else:
            name = "cpu" if device.type == "cpu" and cpu.available() else "reference"
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention_backend='cpu' runs on the CPU, not on {device}")
        if not cpu.available():
            raise ValueError("attention_backend='cpu' needs a C compiler to build its kernel (set CC)")
        return AttentionBackend("cpu", cpu.write_kv_cache, cpu.paged_attention, cpu.rms_norm, cpu.rotate_qk,
                                cpu.silu_mul, cpu.rms_norm_heads, route_topk=cpu.route_topk)
    if name == "reference":
        from pagedserve.kernels import reference

        return AttentionBackend("reference", reference.write_kv_cache, reference.paged_attention)
    if not _triton_available():
        raise ValueError("attention_backend='triton' needs the triton package and its kernels")
    from pagedserve.kernels.gpu import attention, cache, fused_moe, lora_bgmv, norm, rotary

    return AttentionBackend("triton", cache.write_kv_cache, attention.paged_attention, norm.rms_norm,
                            rotary.rotate_qk, fused_experts=fused_moe.fused_experts, lora_add=lora_bgmv.add_lora)


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401

        from pagedserve.kernels.gpu import attention, cache  # noqa: F401
    except ImportError:
        return False
    return True
