"""Argument checks the backends' kernels share (the native CPU one, the Triton one, the torch reference), apart
from `backend.py` so that a backend never imports the module that picks it."""

from __future__ import annotations

import torch


def check_rotation(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """ValueError unless the arguments are what a `backend.RotateQK` takes: views of one projection's output may be
    given, contiguous in D; cos/sin [T, 1, R] as `RotaryEmbedding.cos_sin` makes them, in q's dtype, for the first
    R dims of each head (R even, at most D; R < D for a partial rotary embedding)."""
    num_tokens, _, head_dim = q.shape
    rotary_dim = cos.shape[-1]
    if (k.shape[0] != num_tokens or k.shape[2] != head_dim or rotary_dim % 2 or not 0 < rotary_dim <= head_dim
            or q.stride(-1) != 1 or k.stride(-1) != 1 or cos.shape != (num_tokens, 1, rotary_dim)
            or sin.shape != cos.shape or cos.stride(-1) != 1 or sin.stride(-1) != 1 or q.dtype != k.dtype):
        raise ValueError(f"rotate_qk needs q [T, Hq, D], k [T, Hkv, D] of one dtype, and cos/sin [T, 1, R], R even "
                         f"and at most D, each contiguous in its last dim: got q {tuple(q.shape)} {q.dtype}, "
                         f"k {tuple(k.shape)} {k.dtype}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")


def check_window(window: int | None) -> None:
    """ValueError unless `window` is a sliding window (at least one position) or None (full attention)."""
    if window is not None and window < 1:
        raise ValueError(f"window={window} must be at least 1")


def check_softcap(softcap: float | None) -> None:
    """ValueError unless `softcap` is an attention-logit soft cap (a positive number) or None (no cap)."""
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap={softcap} must be positive (or None: no cap)")


def check_sinks(sinks: torch.Tensor | None, num_q_heads: int) -> None:
    """ValueError unless `sinks` is one attention-sink logit per query head ([Hq], fp32) or None (no sinks)."""
    if sinks is not None and (sinks.shape != (num_q_heads,) or sinks.dtype != torch.float32):
        raise ValueError(f"sinks must be fp32 [{num_q_heads}] (one logit per query head), got "
                         f"{sinks.dtype} {tuple(sinks.shape)}")
