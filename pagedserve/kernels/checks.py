"""Argument checks the backends' kernels share (the native CPU one, the Triton one, the torch reference), apart
from `backend.py` so that a backend never imports the module that picks it."""

from __future__ import annotations

import torch


def check_rotation(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """ValueError unless the arguments are what a `backend.RotateQK` takes: views of one projection's output may be
    given, contiguous in D; cos/sin [T, 1, D] as `RotaryEmbedding.cos_sin` makes them, in q's dtype."""
    num_tokens, _, head_dim = q.shape
    if (k.shape[0] != num_tokens or k.shape[2] != head_dim or head_dim % 2 or q.stride(-1) != 1
            or k.stride(-1) != 1 or cos.shape != (num_tokens, 1, head_dim) or sin.shape != cos.shape
            or cos.stride(-1) != 1 or sin.stride(-1) != 1 or q.dtype != k.dtype):
        raise ValueError(f"rotate_qk needs q [T, Hq, D], k [T, Hkv, D] of one dtype, D even, and cos/sin "
                         f"[T, 1, D], each contiguous in D: got q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} "
                         f"{k.dtype}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")


def check_window(window: int | None) -> None:
    """ValueError unless `window` is a sliding window (at least one position) or None (full attention)."""
    if window is not None and window < 1:
        raise ValueError(f"window={window} must be at least 1")


def check_softcap(softcap: float | None) -> None:
    """ValueError unless `softcap` is an attention-logit soft cap (a positive number) or None (no cap)."""
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap={softcap} must be positive (or None: no cap)")
