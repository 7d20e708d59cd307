"""Llama, Mistral, Qwen2, Qwen3, Phi-3, Granite, SmolLM3, OLMo 2, Gemma 2 / 3, Mixtral, Qwen2-MoE, Qwen3-MoE and
gpt-oss as one decoder: their differences are `ModelConfig`'s values (biases, q/k norms, where the norms sit, each
layer's window and rotary embedding, Granite's scales, Gemma's soft caps and GELU, gpt-oss's attention sinks, which
layers have a sparse MoE block (`moe.py`) in place of the MLP), read where each applies.

Tokens of all rows are flattened into one [T, ...] batch; attention reads and writes the
paged KV pool through `AttentionContext`. q/k/v and gate/up projections are fused. Under
tensor parallelism (`TPLayout`) each rank holds its heads, MLP columns and vocabulary shard;
o_proj and down_proj outputs are all-reduced, logits gathered.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels import reference
from pagedserve.kernels.backend import AttentionBackend, AttentionContext, RMSNormHeads, RMSNormRows
from pagedserve.kernels.lora_products import LoRAStep
from pagedserve.scheduler.kv_groups import kv_groups, layer_group_slots
from pagedserve.workers.models.lora_layers import LoRAProjection
from pagedserve.workers.models.model_config import ModelConfig
from pagedserve.workers.models.moe import SparseMoeBlock
from pagedserve.workers.models.parallel import TPLayout, all_gather_last_dim, all_reduce
from pagedserve.workers.models.rotary_embedding import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, kernel: RMSNormRows | None = None) -> torch.Tensor:
        """`kernel`: the backend's one-call RMSNorm, where `x` is rows [T, H] it takes (else torch ops)."""
        if kernel is not None and _rows(x):
            return kernel(x, self.weight, self.eps)
        return reference.rms_norm(x, self.weight, self.eps)

    def heads_forward(self, x: torch.Tensor, kernel: RMSNormHeads | None = None) -> torch.Tensor:
        """RMSNorm of each head of `x` [T, heads, D] (the q/k norms); `kernel`: the backend's, in one call."""
        if kernel is not None and x.dim() == 3 and x.stride(-1) == 1:
            return kernel(x, self.weight, self.eps)
        return reference.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor,
                    kernel: RMSNormRows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm of `residual + x`, and that sum (the residual stream's next value, `residual` updated in
        place). `kernel`: the backend's, which adds and normalizes in one call."""
        if kernel is not None and _rows(x) and _rows(residual):
            return kernel(x, self.weight, self.eps, residual), residual
        return reference.rms_norm(x, self.weight, self.eps, residual), residual


class AcrossHeadsRMSNorm(nn.Module):
    """OLMo 2's q/k norm: one RMSNorm over all heads of a token together (weight [heads * D]). Under tensor
    parallelism a rank holds some of the heads, and their weights: the mean of squares is the all-reduced sum of
    each rank's partial sums, over the `width` of all heads (KV heads held by several ranks counted once)."""

    def __init__(self, local_width: int, width: int, eps: float, tp: TPLayout, copies: int = 1) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(local_width))
        self.width, self.eps, self.tp, self.copies = width, eps, tp, copies

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, local_width] -> a new [T, local_width]."""
        dtype = x.dtype
        xf = x.float()
        if self.tp.size == 1:
            variance = xf.pow(2).mean(-1, keepdim=True)  # transformers' op, so fp32 matches it bit for bit
        else:
            variance = all_reduce(xf.pow(2).sum(-1, keepdim=True), self.tp) / (self.width * self.copies)  # [T, 1]
        # The weight multiplies in fp32 before the one cast (transformers' Olmo2RMSNorm), where Llama's norm casts
        # first: the same bits in fp32; in bf16 this rounds once where Llama's order rounds twice.
        return (self.weight * (xf * torch.rsqrt(variance + self.eps))).to(dtype)


def _rows(x: torch.Tensor) -> bool:
    """Whether `x` is rows a backend's RMSNorm takes: [T, H], contiguous in H."""
    return x.dim() == 2 and x.stride(-1) == 1


def linear_product(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`x @ weight.T` without the bias, for an nn.Linear or a layer with its own `product` (PackedLinear,
    QuantLinear)."""
    return F.linear(x, linear.weight) if isinstance(linear, nn.Linear) else linear.product(x)


def row_parallel(linear: nn.Module, x: torch.Tensor, tp: TPLayout, lora: LoRAProjection | None = None,
                 step: LoRAStep | None = None) -> torch.Tensor:
    """A projection whose input dim is split: partial products summed across ranks, bias added once. With a
    step's adapter rows (`lora`, `step`), each rank adds its partial LoRA products before the sum."""
    adapted = lora is not None and step is not None
    if tp.size == 1:
        return lora.add(x, linear(x), step) if adapted else linear(x)
    partial = linear_product(linear, x)
    out = all_reduce(lora.add(x, partial, step) if adapted else partial, tp)
    return out if linear.bias is None else out + linear.bias


def column_parallel(linear: nn.Module, x: torch.Tensor, lora: LoRAProjection | None,
                    step: LoRAStep | None) -> torch.Tensor:
    """A projection whose output dim is split (each rank its columns), plus its adapter rows' LoRA products."""
    out = linear(x)
    return lora.add(x, out, step) if lora is not None and step is not None else out


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPLayout, window: int | None = None, rope: bool = True,
                 kv_group: int = 0) -> None:
        super().__init__()
        self.tp = tp
        self.window = window  # a sliding-window layer's: it attends to the last `window` positions only
        self.kv_group = kv_group  # whose block tables and slots it reads and writes through (`kv_groups.py`)
        self.rope = rope  # False: positions reach this layer through the causal mask alone (SmolLM3's)
        self.num_heads = tp.num_heads
        self.num_kv_heads = tp.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5 if config.attention_multiplier is None else config.attention_multiplier
        self.softcap = config.attn_logit_softcapping
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.qk_norm_across_heads = config.family.qk_norm_across_heads
        if config.family.qk_norm and self.qk_norm_across_heads:
            # KV heads replicated across ranks (tp > num_kv_heads) are held by tp / num_kv_heads ranks each
            kv_copies = max(1, tp.size // config.num_kv_heads)
            self.q_norm = AcrossHeadsRMSNorm(self.q_size, config.num_heads * self.head_dim, config.rms_norm_eps, tp)
            self.k_norm = AcrossHeadsRMSNorm(self.kv_size, config.num_kv_heads * self.head_dim, config.rms_norm_eps,
                                             tp, kv_copies)
        elif config.family.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # gpt-oss's sink logits, this rank's heads' (kept in the model's dtype, as transformers holds them)
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if config.family.attention_sinks else None
        self.qkv_lora: LoRAProjection | None = None  # adapter slots (`attach_lora`), where LoRA is on
        self.o_lora: LoRAProjection | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                ctx: AttentionContext) -> torch.Tensor:
        qkv = column_parallel(self.qkv_proj, x, self.qkv_lora, ctx.lora)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm_across_heads:  # before the view into heads: one norm over them all
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.qk_norm_across_heads:
            q = self.q_norm.heads_forward(q, ctx.backend.rms_norm_heads)
            k = self.k_norm.heads_forward(k, ctx.backend.rms_norm_heads)
        rotate = ctx.backend.rotate_qk
        if self.rope and rotate is not None and q.stride(-1) == 1 and k.stride(-1) == 1:
            rotate(q, k, cos, sin)  # in place
        elif self.rope:
            q, k = reference.rotate_qk(q, k, cos, sin)
        slot_mapping, block_tables = ctx.tables(self.kv_group)
        ctx.backend.write_kv_cache(k, v, kv_cache, slot_mapping)
        o = ctx.backend.paged_attention(q, kv_cache, ctx.cu_seqlens_q, ctx.context_lens, block_tables,
                                        self.scale, max_query_len=ctx.max_query_len,
                                        max_context_len=ctx.max_context_len, window=self.window,
                                        softcap=self.softcap, sinks=None if self.sinks is None else self.sinks.float())
        return row_parallel(self.o_proj, o.reshape(-1, self.q_size), self.tp, self.o_lora, ctx.lora)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPLayout, intermediate_size: int | None = None) -> None:
        """`intermediate_size`: this rank's columns (None: the dense MLP's; a shared expert's has its own)."""
        super().__init__()
        self.tp = tp
        self.intermediate_size = tp.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(self.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"  # else silu
        self.gate_up_lora: LoRAProjection | None = None  # adapter slots (`attach_lora`), where LoRA is on
        self.down_lora: LoRAProjection | None = None

    def forward(self, x: torch.Tensor, backend: AttentionBackend | None = None, reduce: bool = True,
                lora: LoRAStep | None = None) -> torch.Tensor:
        """The backend's one-call SiLU gate (`silu_mul`) where it has one and the projection's output is rows it
        takes. `reduce=False`: this rank's partial sums of the down projection, without its bias (a MoE block adds them
        to its experts' before its one all-reduce). `lora`: the step's adapter rows."""
        gate_up = column_parallel(self.gate_up_proj, x, self.gate_up_lora, lora)
        silu_mul = backend.silu_mul if backend is not None else None
        if silu_mul is not None and not self.gelu and gate_up.dim() == 2:
            act = silu_mul(gate_up)
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            act = (F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)).mul_(up)
        if reduce:
            return row_parallel(self.down_proj, act, self.tp, self.down_lora, lora)
        return linear_product(self.down_proj, act)


class VocabParallelEmbedding(nn.Module):
    """Each rank holds `vocab_shard` rows; ids outside the shard contribute zeros to the all-reduce."""

    def __init__(self, config: ModelConfig, tp: TPLayout) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(tp.vocab_shard, config.hidden_size))
        # Where the CPU's linear kernel holds the table (a QuantLinear: the tied LM head, or the table's own GGUF
        # blocks or 16-bit values), rows are read from it and `weight` is None: the table is not held twice.
        self.table: nn.Module | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._rows(ids)
        local = ids - self.tp.vocab_start
        inside = (local >= 0) & (local < self.tp.vocab_shard)
        out = self._rows(local.clamp(0, self.tp.vocab_shard - 1)) * inside[:, None]
        return all_reduce(out, self.tp)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight) if self.table is None else self.table.rows(ids)  # [T, H]


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPLayout, window: int | None = None, rope: bool = True,
                 kv_group: int = 0, moe: bool = False) -> None:
        super().__init__()
        self.self_attn = Attention(config, tp, window, rope, kv_group)
        # Granite scales what each sublayer adds to the residual stream; the norm after it does the add
        self.residual_multiplier = config.residual_multiplier
        self.mlp = SparseMoeBlock(config, tp, MLP) if moe else MLP(config, tp)  # `moe`: a sparse MoE block
        self.norms = norms = config.family.norms  # where its RMSNorms sit
        if norms not in ("pre", "sandwich", "post"):
            raise ValueError(f"norms={norms!r} is not a placement this decoder computes (pre, sandwich, post)")
        if norms != "post":
            self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if norms == "sandwich":  # Gemma's: the sublayers' outputs are normalized too, before their adds
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if norms != "pre":
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, ctx: AttentionContext) -> tuple[torch.Tensor, torch.Tensor]:
        """`x`: the layer before's output, still to be added to the residual stream `residual` (before the
        first layer: the stream itself, and `residual` None). Returns this layer's output and the stream
        before it: each residual add is done by the norm after it, in one call where the backend has one."""
        norm = ctx.backend.rms_norm
        if self.norms == "post":
            return self._post_norms(x, residual, cos, sin, kv_cache, ctx)
        if residual is None:
            residual, h = x, self.input_layernorm(x, norm)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual, norm)
        attn = self.self_attn(h, cos, sin, kv_cache, ctx)
        if self.norms == "sandwich":
            h, residual = self.pre_feedforward_layernorm.add_forward(
                self.post_attention_layernorm(attn, norm), residual, norm)
            return self.post_feedforward_layernorm(self._mlp(h, ctx), norm), residual
        h, residual = self.post_attention_layernorm.add_forward(self._scaled(attn), residual, norm)
        return self._scaled(self._mlp(h, ctx)), residual

    def _post_norms(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                    kv_cache: torch.Tensor, ctx: AttentionContext) -> tuple[torch.Tensor, torch.Tensor]:
        """OLMo 2's layer: the sublayers read the residual stream itself, and each one's output is normalized
        before it is added; the MLP's is returned unadded, as the pre-norm layer returns its own."""
        norm = ctx.backend.rms_norm
        stream = x if residual is None else residual + x
        attn = self.post_attention_layernorm(self.self_attn(stream, cos, sin, kv_cache, ctx), norm)
        stream = stream + self._scaled(attn)
        return self._scaled(self.post_feedforward_layernorm(self._mlp(stream, ctx), norm)), stream

    def _mlp(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """The MLP (with the step's adapter rows), or the sparse MoE block (which adapters do not reach)."""
        if isinstance(self.mlp, MLP):
            return self.mlp(x, ctx.backend, lora=ctx.lora)
        return self.mlp(x, ctx.backend)

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.residual_multiplier == 1.0 else x * self.residual_multiplier


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int, tp: TPLayout, ropes: bool = True) -> None:
        super().__init__()
        self.rope: RotaryEmbedding | None = None
        self.local_rope: RotaryEmbedding | None = None
        if ropes:
            self.build_ropes(config, max_positions)
        self.embed_tokens = VocabParallelEmbedding(config, tp)
        groups = layer_group_slots(kv_groups(config.layer_windows))
        self.layers = nn.ModuleList([
            DecoderLayer(config, tp, window, rope, groups[i][0], moe) for i, (window, rope, moe)
            in enumerate(zip(config.layer_windows, config.rope_layers, config.moe_layers, strict=True))])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def build_ropes(self, config: ModelConfig, max_positions: int, device: torch.device | None = None) -> None:
        """The rotary embeddings' tables (computed, never loaded): `rope` for every layer, but the sliding ones
        where they have a base of their own (`local_rope`, Gemma 3's; else None)."""
        self.rope = RotaryEmbedding(config, max_positions).to(device)
        self.local_rope = (None if config.local_rope_theta is None
                           else RotaryEmbedding(config, max_positions, local=True).to(device))


class CausalLM(nn.Module):
    """Decoder + LM head. Parameter names follow Hugging Face, except the fused
    `qkv_proj` / `gate_up_proj` (the loader fills them from q/k/v and gate/up)."""

    def __init__(self, config: ModelConfig, max_positions: int, tp: TPLayout | None = None,
                 ropes: bool = True) -> None:
        """`ropes`: compute the rotary tables now; False leaves them to `model.build_ropes` (a model made on the meta
        device, whose storage is made afterwards: tables on meta hold no values, and computing them there costs a
        process the import of torch's compiler)."""
        super().__init__()
        self.config = config
        self.tp = tp = tp or TPLayout.make(config)
        self.model = DecoderModel(config, max_positions, tp, ropes)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, tp.vocab_shard, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                ctx: AttentionContext) -> torch.Tensor:
        """input_ids, positions [T]; kv_caches: each layer's [2, N, B, Hkv, D]. Returns hidden states [T, H]."""
        h = self.model.embed_tokens(input_ids)
        if self.config.family.embeddings_scaled:  # Gemma's: by sqrt(hidden_size) rounded to the dtype, as its own
            h = h * torch.tensor(self.config.embedding_multiplier).to(h.dtype)
        elif self.config.embedding_multiplier != 1.0:
            h = h * self.config.embedding_multiplier
        cos_sin = self.model.rope.cos_sin(positions, ctx.token_seq_lens, h.dtype)
        local = self.model.local_rope
        local_cos_sin = cos_sin if local is None else local.cos_sin(positions, None, h.dtype)
        residual = None
        for i, layer in enumerate(self.model.layers):
            cos, sin = local_cos_sin if layer.self_attn.window is not None else cos_sin
            h, residual = layer(h, residual, cos, sin, kv_caches[i], ctx)
        norm = ctx.backend.rms_norm
        if residual is None:  # no layers
            return self.model.norm(h, norm)
        return self.model.norm.add_forward(h, residual, norm)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, H] -> fp32 logits [S, V] (on every rank)."""
        # A tied head has no module of its own unless a CPU path gave it one (packed, or GGUF blocks).
        head = getattr(self, "lm_head", None)
        local = head(hidden) if head is not None else F.linear(hidden, self.model.embed_tokens.weight)
        logits = all_gather_last_dim(local, self.tp)[:, : self.config.vocab_size]  # [S, V]
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        cap = self.config.final_logit_softcapping
        if cap is not None:  # in the model's dtype, as transformers caps them
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
