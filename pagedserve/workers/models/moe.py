"""The sparse mixture-of-experts block (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss) that takes the MLP's place on its
layers.

A router scores every expert per token; the top k of the softmax (renormalized where the family does; gpt-oss's:
the softmax of the top k logits) weight the outputs of the experts picked. The experts are SiLU-gated, or
(gpt-oss's) a clamped SwiGLU with biases on both projections. `grouped_experts` computes each expert over the
tokens routed to it only: token-expert pairs sorted by expert, one matmul per projection per expert that has tokens,
the results put back in the pairs' order and summed per token. On the Triton backend the fused kernel
(`kernels/gpu/fused_moe.py`) takes its place.

Under tensor parallelism every expert is split along its intermediate dimension (gate/up columns, down rows) as
the dense MLP is, the router is replicated, and the block's output (experts and shared expert together) is
all-reduced once; an expert's down-projection bias is added by one rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels.backend import AttentionBackend
from pagedserve.workers.models.model_config import ModelConfig
from pagedserve.workers.models.parallel import TPLayout, all_reduce


class Gate(nn.Module):
    """A linear map (with a bias for gpt-oss's router) whose weight is read as transformers' (`F.linear`), not an
    nn.Linear: no swap for the linear layers takes it by accident (its scores pick experts). The CPU's fp32 path
    computes it on its linear kernel on purpose (`hold_linear`), as it does every other layer, so that a row's
    scores, and the experts they pick, do not depend on the batch's other rows."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.linear: nn.Module | None = None

    def hold_linear(self, linear: nn.Module) -> None:
        """Compute with `linear` (the same weight and bias, held its own way) in place of the parameters."""
        self.linear = linear
        self.weight = self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) if self.linear is None else self.linear(x)


def route(logits: torch.Tensor, top_k: int, renormalize: bool, keep_fp32: bool = False,
          top_k_first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k], expert ids [T, k]), as transformers' routers compute them:
    softmax over all experts in fp32, the top k, divided by their sum where `renormalize`; the weights then in
    the logits' dtype unless `keep_fp32`. `top_k_first` (gpt-oss's): the top k logits, then their softmax in the
    logits' dtype."""
    if top_k_first:
        values, experts = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(values, dim=-1, dtype=values.dtype), experts
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if keep_fp32 else weights.to(logits.dtype)), experts


def silu_gate(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] = [gate | up] -> SiLU(gate) * up [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's experts' activation of [gate | up], as transformers' `GptOssExperts._apply_gate`: the gate clamped
    from above and the up projection on both sides at `limit`, gate * sigmoid(alpha * gate) * (up + 1)."""

    limit: float
    alpha: float

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                    gate_up: torch.Tensor | Sequence[nn.Module], down: torch.Tensor | Sequence[nn.Module],
                    gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                    activation: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Each token's routed experts' outputs, weighted and summed: x [T, H], weights and experts [T, k], gate_up
    [E, 2I, H] (gate rows then up rows), down [E, H, I] (or each expert's linear layers: the CPU kernel's, with a
    `product`), their biases [E, 2I] and [E, H] where given (added after each product, as transformers' grouped
    experts add them), `activation` of the [gate | up] rows (None: SiLU's gate) -> this rank's partial sums
    [T, H] (x's dtype). Only the tokens routed to an expert go through it."""
    activation = activation or silu_gate
    num_tokens, top_k = experts.shape
    sorted_experts, order = torch.sort(experts.reshape(-1), stable=True)  # pairs grouped by expert  [T * k]
    counts = torch.bincount(sorted_experts, minlength=len(gate_up)).tolist()  # the group sizes, on the host
    rows = x[order // top_k]  # each pair's token  [T * k, H]
    out = torch.empty(num_tokens * top_k, x.shape[1], dtype=x.dtype, device=x.device)  # [T * k, H]
    start = 0
    for e, n in enumerate(counts):
        if n:
            h = _product(gate_up, e, rows[start:start + n])  # [n, 2I]
            h = activation(h if gate_up_bias is None else h + gate_up_bias[e])
            h = _product(down, e, h)  # [n, H]
            out[start:start + n] = h if down_bias is None else h + down_bias[e]
            start += n
    # weights times outputs in the pairs' sorted order (in the weights' dtype where it is wider: Mixtral's fp32),
    # then back in token order and added over each token's k pairs in choice order, as transformers' grouped path
    # sums them (and the CPU's native call, csrc/decoder.c `moe_experts`, adds them)
    weighted = out * weights.reshape(-1)[order, None]
    unsorted = torch.empty_like(weighted)
    unsorted[order] = weighted
    per_choice = unsorted.view(num_tokens, top_k, -1)  # [T, k, H]
    total = per_choice[:, 0]
    for j in range(1, top_k):
        total = total + per_choice[:, j]
    return total.to(x.dtype)


def _product(weights: torch.Tensor | Sequence[nn.Module], expert: int, x: torch.Tensor) -> torch.Tensor:
    """x @ W_e.T, for stacked weights or an expert's own linear layer."""
    return F.linear(x, weights[expert]) if isinstance(weights, torch.Tensor) else weights[expert].product(x)


class Experts(nn.Module):
    """The experts' stacked weights (and gpt-oss's biases): this rank's columns of each."""

    def __init__(self, config: ModelConfig, tp: TPLayout) -> None:
        super().__init__()
        inter, hidden, num = tp.moe_intermediate_size, config.hidden_size, config.num_experts
        self.tp, self.num_experts, self.hidden_size = tp, num, hidden
        self.gate_up_proj = nn.Parameter(torch.empty(num, 2 * inter, hidden))  # [E, 2I, H]
        self.down_proj = nn.Parameter(torch.empty(num, hidden, inter))  # [E, H, I]
        biases = config.family.moe_biases
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num, 2 * inter)) if biases else None  # [E, 2I]
        self.down_proj_bias = nn.Parameter(torch.empty(num, hidden)) if biases else None  # [E, H], whole on each rank
        self.activation = (None if config.swiglu_limit is None
                           else ClampedSwiGLU(config.swiglu_limit, config.swiglu_alpha))
        # each expert's gate|up and down as linear layers of their own, in place of the stacked weights
        # (`hold_linears`: the CPU kernel's, on a GGUF's blocks or the weights' panels)
        self.gate_up_linears: nn.ModuleList | None = None
        self.down_linears: nn.ModuleList | None = None
        # those layers in one native call (the CPU's `NativeExperts`, which its worker attaches), where it runs them
        self.native: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def hold_linears(self, gate_up: list[nn.Module], down: list[nn.Module]) -> None:
        """Compute each expert with its own layers, `gate_up[e]` ([gate | up] rows) and `down[e]`; the stacked
        weights are dropped (on a model not yet made, never allocated)."""
        if len(gate_up) != self.num_experts or len(down) != self.num_experts:
            raise ValueError(f"{len(gate_up)} and {len(down)} expert layers for {self.num_experts} experts")
        self.gate_up_linears, self.down_linears = nn.ModuleList(gate_up), nn.ModuleList(down)
        self.gate_up_proj = self.down_proj = None

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                backend: AttentionBackend | None = None) -> torch.Tensor:
        """On the CPU backend the native call where the worker attached one; the backend's fused kernel where it has
        one (Triton's: nothing waits for the host, so steps can be captured in CUDA graphs); else the loop over
        experts (over their own layers where they hold them)."""
        down_bias = self.down_proj_bias if self.tp.rank == 0 else None  # the all-reduce sums it once
        if self.native is not None and backend is not None and backend.name == "cpu":
            return self.native(x, weights, experts)
        # the backend's SiLU gate where it has one (the CPU's), as the dense MLP's
        activation = self.activation or (backend.silu_mul if backend is not None else None)
        if self.gate_up_linears is not None:
            return grouped_experts(x, weights, experts, self.gate_up_linears, self.down_linears,
                                   self.gate_up_proj_bias, down_bias, activation)
        compute = backend.fused_experts if backend is not None and backend.fused_experts is not None else (
            grouped_experts)
        return compute(x, weights, experts, self.gate_up_proj, self.down_proj, self.gate_up_proj_bias, down_bias,
                       activation)


class SparseMoeBlock(nn.Module):
    """Router, experts, and Qwen2-MoE's shared expert (a dense MLP scaled by sigmoid(shared_expert_gate))."""

    def __init__(self, config: ModelConfig, tp: TPLayout, dense_mlp: type[nn.Module]) -> None:
        super().__init__()
        self.tp = tp
        self.top_k, self.renormalize = config.num_experts_per_tok, config.norm_topk_prob
        self.weights_fp32 = config.family.moe_weights_fp32
        self.top_k_first = config.family.moe_top_k_first
        self.gate = Gate(config.hidden_size, config.num_experts, config.family.moe_biases)  # replicated on every rank
        self.experts = Experts(config, tp)
        if config.shared_expert_intermediate_size:
            self.shared_expert = dense_mlp(config, tp, tp.shared_expert_intermediate_size)
            self.shared_expert_gate = Gate(config.hidden_size, 1)
        else:
            self.shared_expert = None

    def forward(self, x: torch.Tensor, backend: AttentionBackend | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H], all-reduced."""
        logits = self.gate(x)  # [T, E]
        routed = None
        if backend is not None and backend.route_topk is not None and not self.top_k_first:
            routed = backend.route_topk(logits, self.top_k, self.renormalize)  # the CPU's: its decoder's bits
        weights, experts = routed or route(logits, self.top_k, self.renormalize, self.weights_fp32, self.top_k_first)
        out = self.experts(x, weights, experts, backend)
        if self.shared_expert is not None:  # its partial sums scaled before the one all-reduce: the same sum
            shared = self.shared_expert(x, backend, reduce=False)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return all_reduce(out, self.tp)
