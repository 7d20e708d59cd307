"""Attention backends: the Triton kernels on CUDA, the plain-torch reference elsewhere."""

from __future__ import annotations

from types import ModuleType

import torch

BACKENDS = ("auto", "triton", "reference")


def get_attention_backend(name: str, device: torch.device) -> ModuleType:
    """A module with `write_kv_cache` and `paged_attention` (see kernels/reference.py)."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend={name!r} must be one of {BACKENDS}")
    if name == "auto":
        name = "triton" if device.type == "cuda" and _triton_available() else "reference"
    if name == "reference":
        from pagedserve.kernels import reference

        return reference
    if not _triton_available():
        raise ValueError("attention_backend='triton' needs the triton package and its kernels")
    from pagedserve.kernels import triton_backend

    return triton_backend


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401

        from pagedserve.kernels import triton_backend  # noqa: F401
    except ImportError:
        return False
    return True
