"""Linear layers on CPU with their weights reordered once into oneDNN's blocked layout.

The plain [out, in] weight goes through MKL's sgemm, which at decode batch sizes (16 rows) reaches
less than half of what the same product reaches on a prepacked weight (benchmarks/RESULTS.md). These are
the two ops torch.compile's CPU weight-freezing pass emits; calling them directly gives the speed-up
without a compile at start-up.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from pagedserve.workers.models.llama import CausalLM


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packs fp32 on any x86 CPU it supports, bf16 only where the CPU computes in bf16."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class PackedLinear(nn.Module):
    """`x @ weight.T + bias` from a packed copy of `weight`; the plain weight is not kept."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, batch_hint: int) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), batch_hint)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ weight.T` without the bias (a row-parallel shard adds it after the all-reduce)."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: CausalLM, batch_hint: int) -> None:
    """Swap every nn.Linear of a loaded model for a PackedLinear, and give a tied LM head without a module
    of its own a packed copy of the embedding (the embedding lookup keeps the plain one)."""
    replace_linears(model, lambda weight, bias: PackedLinear(weight, bias, batch_hint))


def replace_linears(model: CausalLM,
                    make: Callable[[torch.Tensor, torch.Tensor | None], nn.Module | None]) -> int:
    """Swap each nn.Linear of a loaded model for `make(weight, bias)`, and give a tied LM head without a module
    of its own `make(embedding weight, None)` (the lookup keeps the plain weights); where `make` returns None
    the layer stays as it is. Returns how many were swapped."""
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and (layer := make(child.weight, child.bias)) is not None:
                setattr(module, name, layer)
                swapped += 1
    if model.config.tie_word_embeddings and getattr(model, "lm_head", None) is None:
        if (head := make(model.model.embed_tokens.weight, None)) is not None:
            model.lm_head = head
            swapped += 1
    return swapped

