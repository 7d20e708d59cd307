"""Attention backends: the Triton kernels on CUDA, a native kernel on CPU, and the plain-torch reference
(the oracle the others are tested against, and the fallback where neither can run)."""

from __future__ import annotations

from types import ModuleType

import torch

from pagedserve.kernels import cpu

BACKENDS = ("auto", "triton", "cpu", "reference")


def get_attention_backend(name: str, device: torch.device) -> ModuleType:
    """A module with `write_kv_cache` and `paged_attention` (see kernels/reference.py)."""
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
        return cpu
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
