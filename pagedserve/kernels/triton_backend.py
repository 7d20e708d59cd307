"""The Triton attention backend: paged KV write and paged attention (CUDA; the interpreter off-GPU)."""

from __future__ import annotations

from pagedserve.kernels.attention import paged_attention
from pagedserve.kernels.cache import write_kv_cache

__all__ = ["paged_attention", "write_kv_cache"]
