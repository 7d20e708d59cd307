"""What llama.cpp's converter (`convert_hf_to_gguf.py`) writes for each architecture, and how to read it back as a
transformers config and transformers tensor names: one `GgufArch` per GGUF `general.architecture`.

The config is rebuilt from the metadata here for every architecture, not taken from transformers' GGUF loader:
that loader knows only some of these architectures, and for those it leaves keys it does not read at their config
class's defaults (Phi-3's window, Gemma 2's soft caps and query scale, Qwen3's head_dim), which are one
checkpoint's values and not this file's. Where llama.cpp writes nothing and computes a fixed value (SmolLM3's
layers without rotary embedding, Gemma's layer patterns and query scale), the config says that value, so the model
computes what llama.cpp computes from the same file. A key that would change the computation and that neither this
table nor the engine reads is refused by name.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ARCHS", "GgufArch", "Metadata", "hf_config"]


class Metadata:
    """A GGUF file's key/value metadata and tensor names, read by key without the `<arch>.` prefix."""

    def __init__(self, fields: dict[str, Any], tensor_names: set[str], rope_freqs: list[float] | None = None) -> None:
        self.fields, self.tensor_names = fields, tensor_names
        self.rope_freqs = rope_freqs  # the values of `rope_freqs.weight`, where the file has that tensor
        self.arch: str = fields["general.architecture"]

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(f"{self.arch}.{key}", default)

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {self.arch}.{key}, which a {self.arch} model needs")
        return value


# llama.cpp's leaf names -> transformers' module names, as gguf-py's tensor map pairs them for Llama.
_LEAVES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # mixtures of experts: the router, each layer's experts stacked ([E, I, H], down [E, H, I]), and Qwen2-MoE's
    # shared expert and its gate
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Gemma's four norms a layer: the one before the MLP is `ffn_norm`, the ones after attention and MLP their own.
_SANDWICH_NORMS = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                   "post_ffw_norm": "post_feedforward_layernorm"}


@dataclass(frozen=True)
class GgufArch:
    """How llama.cpp's converter wrote one architecture's checkpoint."""

    model_type: str  # the transformers model_type it came from
    # llama.cpp's `LlamaModel.permute`: q/k rows reordered from rotate-half to interleaved pairs (its LlamaModel
    # subclasses: Llama, Mistral, Granite, SmolLM3)
    permuted_qk: bool = False
    norm_offset: float = 0.0  # added to every norm weight (Gemma's RMSNorm multiplies by 1 + w)
    leaves: dict[str, str] = field(default_factory=dict)  # leaf names beyond or instead of `_LEAVES`
    # the rotary embedding may cover part of a head (`rope.dimension_count` < head_dim): not head_dim, then
    partial_rope: bool = False
    # the config keys this architecture adds to (or sets in place of) the common ones
    config: Callable[[Metadata, dict[str, Any]], dict[str, Any]] = lambda m, d: {}

    def hf_leaf(self, leaf: str) -> str | None:
        return self.leaves.get(leaf, _LEAVES.get(leaf))


def _phi3(m: Metadata, d: dict[str, Any]) -> dict[str, Any]:
    # llama.cpp writes 0 for Phi-4's "no window"; it also writes the length LongRoPE scales from, which
    # transformers' Phi3Config keeps beside max_position_embeddings.
    window = m.get("attention.sliding_window") or None
    out = {"sliding_window": window}
    if (original := m.get("rope.scaling.original_context_length")) is not None:
        out["original_max_position_embeddings"] = original
    return out


def _granite(m: Metadata, d: dict[str, Any]) -> dict[str, Any]:
    # llama.cpp's defaults where a key is absent: scores scaled by 1/sqrt(head_dim), no other scale. The logit
    # scale it requires.
    head_dim = d["hidden_size"] // d["num_attention_heads"]
    return {"attention_multiplier": m.get("attention.scale") or head_dim ** -0.5,
            "embedding_multiplier": m.get("embedding_scale") or 1.0,
            "residual_multiplier": m.get("residual_scale") or 1.0,
            "logits_scaling": m.need("logit_scale")}


def _smollm3(m: Metadata, d: dict[str, Any]) -> dict[str, Any]:
    # The file does not say which layers skip the rotary embedding: llama.cpp skips every fourth (its
    # n_no_rope_layer_step), and keeps no window.
    return {"no_rope_layers": [int((i + 1) % 4 != 0) for i in range(d["num_hidden_layers"])],
            "use_sliding_window": False, "sliding_window": None}


def _query_scale(m: Metadata, d: dict[str, Any], layers_27b: int) -> int:
    """Gemma's query_pre_attn_scalar, which the file does not hold: llama.cpp scales queries by 1/sqrt(head_dim),
    but the 27B models' by 1/sqrt(hidden_size / heads)."""
    if d["num_hidden_layers"] == layers_27b:
        return d["hidden_size"] // d["num_attention_heads"]
    return d["head_dim"]


def _layer_types(m: Metadata, n_layers: int, pattern: int) -> list[str]:
    """Sliding layers as llama.cpp's `load_swa_pattern`: the file's `sliding_window_pattern` flags, else all
    but every `pattern`-th layer."""
    flags = m.get("attention.sliding_window_pattern")
    if flags is None:
        flags = [i % pattern < pattern - 1 for i in range(n_layers)]
    if len(flags) != n_layers:
        raise ValueError(f"{m.arch}.attention.sliding_window_pattern has {len(flags)} entries for {n_layers} layers")
    return ["sliding_attention" if f else "full_attention" for f in flags]


def _gemma2(m: Metadata, d: dict[str, Any]) -> dict[str, Any]:
    n = d["num_hidden_layers"]
    # llama.cpp's Gemma 2 defaults where a key is absent: a window of 4096, caps of 50 and 30
    return {"sliding_window": m.get("attention.sliding_window", 4096), "layer_types": _layer_types(m, n, 2),
            "attn_logit_softcapping": m.get("attn_logit_softcapping", 50.0),
            "final_logit_softcapping": m.get("final_logit_softcapping", 30.0),
            "query_pre_attn_scalar": _query_scale(m, d, 46)}


def _gemma3(m: Metadata, d: dict[str, Any]) -> dict[str, Any]:
    n = d["num_hidden_layers"]
    window = m.get("attention.sliding_window") or None  # without one llama.cpp attends in full on every layer
    # The global layers' rope is the common one (scaling included); the local layers' has its own base, 10,000
    # unless the file says otherwise, and no scaling.
    local_theta = float(m.get("rope.freq_base_swa", 10000.0))
    rope = {"full_attention": d.pop("rope_parameters"),
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}}
    return {"sliding_window": window,
            "layer_types": _layer_types(m, n, 6) if window else ["full_attention"] * n,
            "final_logit_softcapping": m.get("final_logit_softcapping") or None,
            "query_pre_attn_scalar": _query_scale(m, d, 62), "rope_parameters": rope}


def _experts(m: Metadata, renormalize: bool) -> dict[str, Any]:
    """A mixture of experts' keys as llama.cpp computes it: a MoE block on every layer, the softmax's top
    `expert_used_count` renormalized where its graph for the architecture says so (Qwen3-MoE's and Mixtral's, not
    Qwen2-MoE's, whatever the checkpoint's norm_topk_prob was). What else it may scale or gate by is refused."""
    if (scale := m.get("expert_weights_scale")) not in (None, 0.0, 1.0):
        raise NotImplementedError(f"{m.arch}.expert_weights_scale={scale!r} is not converted")
    if (gating := m.get("expert_gating_func")) not in (None, 1):  # 1: softmax
        raise NotImplementedError(f"{m.arch}.expert_gating_func={gating!r} is not converted (only softmax)")
    return {"num_experts": m.need("expert_count"), "num_experts_per_tok": m.need("expert_used_count"),
            "norm_topk_prob": renormalize}


def _qwen3_moe(m: Metadata, d: dict[str, Any]) -> dict[str, Any]:
    return _experts(m, True) | {"moe_intermediate_size": m.need("expert_feed_forward_length"),
                                "decoder_sparse_step": 1, "mlp_only_layers": []}


def _qwen2_moe(m: Metadata, d: dict[str, Any]) -> dict[str, Any]:
    return _experts(m, False) | {
        "moe_intermediate_size": m.need("expert_feed_forward_length"),
        "shared_expert_intermediate_size": m.get("expert_shared_feed_forward_length", 0),
        "decoder_sparse_step": 1, "mlp_only_layers": [],
        "qkv_bias": "blk.0.attn_q.bias" in m.tensor_names}  # llama.cpp reads the biases where the file has them


def _llama(m: Metadata, d: dict[str, Any]) -> dict[str, Any]:
    """Mixtral, which llama.cpp writes as a llama model with experts (every layer's, renormalized; no window)."""
    if m.get("expert_count") is None:
        return {}
    experts = _experts(m, True)
    # Mixtral's class always renormalizes, and calls the count num_local_experts
    return {"model_type": "mixtral", "num_local_experts": experts["num_experts"],
            "num_experts_per_tok": experts["num_experts_per_tok"], "sliding_window": None}


def _olmo2(m: Metadata, d: dict[str, Any]) -> dict[str, Any]:
    if m.get("attention.sliding_window"):  # OLMo 3, which llama.cpp writes as olmo2 with windows
        raise NotImplementedError(f"{m.arch}.attention.sliding_window: OLMo 3's sliding windows are not converted")
    return {}


ARCHS = {
    "llama": GgufArch("llama", permuted_qk=True, config=_llama),
    "qwen2": GgufArch("qwen2"),
    "qwen3": GgufArch("qwen3"),
    "qwen2moe": GgufArch("qwen2_moe", config=_qwen2_moe),
    "qwen3moe": GgufArch("qwen3_moe", config=_qwen3_moe),
    # q/k/v and gate/up fused, as in Phi-3's own checkpoints
    "phi3": GgufArch("phi3", leaves={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
                     partial_rope=True, config=_phi3),
    "granite": GgufArch("granite", permuted_qk=True, config=_granite),
    "smollm3": GgufArch("smollm3", permuted_qk=True, config=_smollm3),
    "gemma2": GgufArch("gemma2", norm_offset=1.0, leaves=_SANDWICH_NORMS, config=_gemma2),
    "gemma3": GgufArch("gemma3_text", norm_offset=1.0, leaves=_SANDWICH_NORMS, config=_gemma3),
    # norms after attention and after the MLP only, and q/k norms over all heads at once
    "olmo2": GgufArch("olmo2", leaves={"post_attention_norm": "post_attention_layernorm",
                                       "post_ffw_norm": "post_feedforward_layernorm"}, config=_olmo2),
}


def _rope_parameters(m: Metadata, head_dim: int, partial: bool) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(m.get("rope.freq_base", 10000.0))}
    kind = m.get("rope.scaling.type", "none")
    if kind == "linear":
        rope |= {"rope_type": "linear", "factor": float(m.need("rope.scaling.factor"))}
    elif kind != "none":
        raise NotImplementedError(f"{m.arch}.rope.scaling.type={kind!r} is not converted (only linear)")
    dims = m.get("rope.dimension_count")
    if partial and dims is not None and dims != head_dim:
        rope["partial_rotary_factor"] = dims / head_dim
    return rope


def _vocab_size(m: Metadata) -> int:
    """The stated vocabulary size, else the vocabulary's own length, as llama.cpp reads it."""
    if (size := m.get("vocab_size")) is not None:
        return size
    if (tokens := m.fields.get("tokenizer.ggml.tokens")) is None:
        raise ValueError(f"GGUF metadata has neither {m.arch}.vocab_size nor tokenizer.ggml.tokens")
    return len(tokens)


def hf_config(m: Metadata) -> dict[str, Any]:
    """The transformers config dict of a GGUF file's model."""
    arch = ARCHS[m.arch]
    heads = m.need("attention.head_count")
    hidden = m.need("embedding_length")
    d: dict[str, Any] = {
        "model_type": arch.model_type,
        "hidden_size": hidden,
        "intermediate_size": m.need("feed_forward_length"),
        "num_hidden_layers": m.need("block_count"),
        "num_attention_heads": heads,
        # llama.cpp treats a missing KV head count as plain multi-head attention.
        "num_key_value_heads": m.get("attention.head_count_kv", heads),
        "rms_norm_eps": m.need("attention.layer_norm_rms_epsilon"),
        "vocab_size": _vocab_size(m),
        # llama.cpp writes the output projection only when it is not the embedding matrix.
        "tie_word_embeddings": "output.weight" not in m.tensor_names,
        "bos_token_id": m.fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": m.fields.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": m.fields.get("tokenizer.ggml.padding_token_id"),
    }
    if (context := m.get("context_length")) is not None:
        d["max_position_embeddings"] = context
    # llama.cpp writes key_length where the checkpoint's head_dim is not hidden_size / heads; older files only
    # the rotary width, which is the head's where the rotation covers it.
    head_dim = m.get("attention.key_length") or (None if arch.partial_rope else m.get("rope.dimension_count"))
    if head_dim is not None:
        d["head_dim"] = head_dim
    d["rope_parameters"] = _rope_parameters(m, head_dim or hidden // heads, arch.partial_rope)
    if m.rope_freqs is not None:
        d["rope_parameters"] = _llama3_rope(m.rope_freqs, d["rope_parameters"], head_dim or hidden // heads,
                                            m.get("rope.scaling.original_context_length"))
    d |= arch.config(m, d)
    return d


def llama3_rope_freqs(theta: float, head_dim: int, factor: float, low_freq_factor: float, high_freq_factor: float,
                      original: int) -> list[float]:
    """The frequency factors llama.cpp's converter writes as `rope_freqs.weight` for Llama 3's rope scaling (what
    each rotated pair's frequency is divided by), computed as it computes them."""
    import numpy as np

    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    low_freq_wavelen, high_freq_wavelen = original / low_freq_factor, original / high_freq_factor
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / float(freq)
        if wavelen < high_freq_wavelen:
            factors.append(1.0)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return [float(f) for f in np.array(factors, dtype=np.float32)]  # stored as float32


# Llama 3.1, 3.2 and 3.3 all scale with these (their checkpoints' low_freq_factor, high_freq_factor and
# original_max_position_embeddings); only the factor differs (8 or 32).
_LLAMA3_SETTINGS = ((1.0, 4.0, 8192),)


def _llama3_rope(file_factors: list[float], rope: dict[str, Any], head_dim: int,
                 original: int | None) -> dict[str, Any]:
    """Llama 3's rope settings, which the file keeps only as the frequency factors they yield: the settings whose
    factors (computed as llama.cpp's converter computes them) are the file's, else refused by name, since
    rotating without them, or by other factors than transformers computes, would answer wrongly."""
    import numpy as np

    factor = max(file_factors)
    settings = _LLAMA3_SETTINGS if original is None else tuple((lo, hi, original) for lo, hi, _ in _LLAMA3_SETTINGS)
    for low, high, context in settings:
        expected = llama3_rope_freqs(rope["rope_theta"], head_dim, factor, low, high, context)
        if len(expected) == len(file_factors) and np.allclose(expected, file_factors, rtol=1e-6, atol=0):
            return {"rope_type": "llama3", "rope_theta": rope["rope_theta"], "factor": factor,
                    "low_freq_factor": low, "high_freq_factor": high, "original_max_position_embeddings": context}
    raise NotImplementedError("GGUF tensor 'rope_freqs.weight': its frequency factors are not Llama 3's rope scaling "
                              f"(factor {factor}, low/high frequency factors 1 and 4, a trained context of "
                              f"{original or 8192}), the only one converted")

