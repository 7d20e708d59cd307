"""LoRA's added products for a batch whose rows run with different adapters (the SGMV pattern): each adapter's
tokens through its own A and B, grouped, while the projection's own kernel computes every token's base product.

An adapted projection holds every slot's weights stacked: A [S, n * R, in] (the A of each of its n parts, a fused
projection's q/k/v or gate/up, each part's rank padded to R with zeros) and B [S, out, R] (each part's B in its
rows, scaling folded in): a token of slot s adds, to part i's columns of its output row, `x A_i[s]^T B_i[s]^T`,
A_i[s] rows i * R .. (i + 1) * R of A[s]. Ranks padded with zeros add exact zeros."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class LoRAKernel(Protocol):
    def __call__(self, x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, parts: tuple[int, ...],
                 token_slots: torch.Tensor) -> torch.Tensor:
        """`add_lora`'s products in one kernel, each token through slot token_slots[t] [T] (-1: none)."""


@dataclass(frozen=True)
class LoRAStep:
    """A step's tokens by adapter slot, for `add_lora`: (slot, the indices [n] of its tokens, or None where every
    token of the step is the slot's), tokens of the base model in no group; or, where a backend brings its own
    `kernel` (Triton's), each token's slot [T] (-1: none), read on the device."""

    groups: tuple[tuple[int, torch.Tensor | None], ...] = ()
    token_slots: torch.Tensor | None = None
    kernel: LoRAKernel | None = None


def add_lora(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, parts: tuple[int, ...],
             step: LoRAStep) -> torch.Tensor:
    """out [T, out] += each grouped token's LoRA products (x [T, in]; `parts`: the output columns of each part, in
    order), in place; returns `out`."""
    if step.kernel is not None:
        return step.kernel(x, out, a, b, parts, step.token_slots)
    rank = b.shape[-1]
    for slot, tokens in step.groups:
        shrunk = (x if tokens is None else x[tokens]) @ a[slot].T  # [n, parts * R]
        if len(parts) == 1:
            delta = shrunk @ b[slot].T  # [n, out]
        else:
            delta = torch.cat([shrunk[:, i * rank:(i + 1) * rank] @ b_part.T
                               for i, b_part in enumerate(b[slot].split(parts))], dim=1)  # [n, out]
        if tokens is None:
            out += delta
        else:
            out.index_add_(0, tokens, delta)
    return out
