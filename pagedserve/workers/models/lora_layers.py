"""The adapter slots of the decoder's projections: each adaptable projection gets a `LoRAProjection` holding every
slot's A and B (laid out as `kernels/lora_products.py` says), which its module adds after the base product where the
step has rows of an adapter (`AttentionContext.lora`). The base layer (nn.Linear, packed, GGUF blocks) is left as it
is."""

from __future__ import annotations

import torch

from pagedserve.kernels.lora_products import LoRAStep, add_lora
from pagedserve.lora.adapter import AdapterSpec, ProjectionShape, read_adapter
from pagedserve.workers.models.model_config import ModelConfig


class LoRAProjection:
    """A projection's adapter weights by slot: its `parts` (the HF projections a fused one is made of) with their
    output sizes on this rank, over `in_features` inputs on this rank."""

    def __init__(self, parts: tuple[str, ...], sizes: tuple[int, ...], in_features: int, max_loras: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        self.parts, self.sizes, self.max_rank = parts, sizes, max_rank
        self.a = torch.zeros(max_loras, len(parts) * max_rank, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, sum(sizes), max_rank, dtype=dtype, device=device)  # [S, out, R]

    def add(self, x: torch.Tensor, out: torch.Tensor, step: LoRAStep) -> torch.Tensor:
        """out [T, out] plus each adapter row's product of x [T, in], in place."""
        return add_lora(x, out, self.a, self.b, self.sizes, step)

    def load(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Slot `slot` takes each part's (A [r, in], B [out, r] scaled) of `weights` (this rank's shards); parts
        it lacks add nothing."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        offset = 0
        for i, (part, size) in enumerate(zip(self.parts, self.sizes, strict=True)):
            if part in weights:
                a, b = weights[part]
                rank = a.shape[0]
                self.a[slot, i * self.max_rank:i * self.max_rank + rank] = a
                self.b[slot, offset:offset + size, :rank] = b
            offset += size


def projection_shapes(config: ModelConfig) -> dict[str, ProjectionShape]:
    """Each adaptable projection's (in, out) features in the whole model."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return {"q_proj": ProjectionShape(hidden, q), "k_proj": ProjectionShape(hidden, kv),
            "v_proj": ProjectionShape(hidden, kv), "o_proj": ProjectionShape(q, hidden),
            "gate_proj": ProjectionShape(hidden, inter), "up_proj": ProjectionShape(hidden, inter),
            "down_proj": ProjectionShape(inter, hidden)}


def read_model_adapter(path: str, config: ModelConfig, max_rank: int) -> AdapterSpec:
    """The adapter directory at `path` checked against `config`'s model (ValueError naming what is wrong)."""
    return read_adapter(path, projection_shapes(config), config.num_layers, config.moe_layers, max_rank)


def attach_lora(model: torch.nn.Module, max_loras: int, max_rank: int) -> list[tuple[int, LoRAProjection]]:
    """Give every adaptable projection of `model` (a CausalLM) its slots; returns them by layer. The MLPs of
    mixture-of-experts layers have none (adapters of experts are refused when read)."""
    config = model.config
    dtype, device = model.model.norm.weight.dtype, model.model.norm.weight.device
    hidden = config.hidden_size
    made = []

    def holder(parts: tuple[str, ...], sizes: tuple[int, ...], in_features: int) -> LoRAProjection:
        return LoRAProjection(parts, sizes, in_features, max_loras, max_rank, dtype, device)

    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        attn.qkv_lora = holder(("q_proj", "k_proj", "v_proj"), (attn.q_size, attn.kv_size, attn.kv_size), hidden)
        attn.o_lora = holder(("o_proj",), (hidden,), attn.q_size)
        made += [(i, attn.qkv_lora), (i, attn.o_lora)]
        if not config.moe_layers[i]:
            mlp = layer.mlp
            mlp.gate_up_lora = holder(("gate_proj", "up_proj"), (mlp.intermediate_size,) * 2, hidden)
            mlp.down_lora = holder(("down_proj",), (hidden,), mlp.intermediate_size)
            made += [(i, mlp.gate_up_lora), (i, mlp.down_lora)]
    return made
