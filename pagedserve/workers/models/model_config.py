"""The model facts the runner needs, read from a Hugging Face `config.json` dict."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Family:
    """What one model_type's transformers class computes beyond Llama's decoder: one place per family."""

    qkv_bias: bool | None = None  # q/k/v projections' biases; None: the config's attention_bias
    o_bias: bool | None = None  # the output projection's; None: the config's attention_bias
    qk_norm: bool = False  # an RMSNorm of q and k
    qk_norm_across_heads: bool = False  # that norm over all heads together (OLMo 2's), else over each head alone
    keys: frozenset[str] = frozenset()  # config keys its class reads besides the common ones (`_HONOURED`)
    layer_types: tuple[str, ...] = ("full_attention",)  # the attention types its layers may have
    window_on_every_layer: bool = False  # one `sliding_window` for all layers; else only with use_sliding_window
    # Where each layer's RMSNorms sit. "pre": Llama's (input_layernorm before attention, post_attention_layernorm
    # before the MLP). "sandwich": Gemma's (input_layernorm, then post_attention_layernorm on the attention's
    # output; pre_feedforward_layernorm before the MLP, post_feedforward_layernorm on its output). "post": OLMo 2's
    # (post_attention_layernorm and post_feedforward_layernorm on the sublayers' outputs, no norm before them).
    norms: str = "pre"
    # Gemma's RMSNorms multiply by (1 + weight): the checkpoint holds offsets from 1, which the loader adds.
    norm_weight_offset: float = 0.0
    embeddings_scaled: bool = False  # Gemma's: the embeddings times sqrt(hidden_size), rounded to the dtype
    # What transformers' config class sets for keys a config.json may lack (only those that change the
    # computation and differ from this module's own defaults).
    defaults: tuple[tuple[str, Any], ...] = ()
    # Keys its config class holds that its model never reads: refused when set, since a checkpoint that sets one
    # means a computation transformers does not do.
    unread: frozenset[str] = frozenset()
    # Mixture of experts: the top-k routing weights renormalized to sum to 1 (Mixtral's, always); None: as the
    # config's norm_topk_prob says (Qwen2-MoE's and Qwen3-MoE's, off by default).
    moe_renormalize: bool | None = None
    # The routing weights kept in fp32 as the experts' outputs are weighted and summed (Mixtral's), else rounded to
    # the model's dtype first (the Qwen families'): the same in fp32, not in bf16.
    moe_weights_fp32: bool = False
    # Qwen2-MoE's default layer_types under use_sliding_window: every other layer (the first, third, ...) below
    # max_window_layers slides, where Qwen2's slide from max_window_layers on.
    alternate_windows: bool = False
    # gpt-oss's: a learned logit per query head (`self_attn.sinks`) that joins each softmax's denominator and
    # attends to no value, so a query may give less than all of its weight to the keys.
    attention_sinks: bool = False
    # gpt-oss's router: biased logits, the top k of them, then a softmax over those k (the others' softmax first,
    # over all experts); its experts have biases and a clamped SwiGLU (`swiglu_limit`, `swiglu_alpha`).
    moe_top_k_first: bool = False
    moe_biases: bool = False


_GEMMA = frozenset({"sliding_window", "layer_types", "query_pre_attn_scalar", "attn_logit_softcapping",
                    "final_logit_softcapping", "use_bidirectional_attention", "attention_bias"})
_GEMMA_DEFAULTS = (("hidden_activation", "gelu_pytorch_tanh"), ("query_pre_attn_scalar", 256),
                   ("sliding_window", 4096), ("tie_word_embeddings", True))
# Gemma3TextConfig's shape, which the text_config of a multimodal checkpoint leaves out where it keeps it.
_GEMMA3_SHAPE = (("vocab_size", 262_208), ("hidden_size", 2304), ("intermediate_size", 9216),
                 ("num_hidden_layers", 26), ("num_attention_heads", 8), ("num_key_value_heads", 4), ("head_dim", 256),
                 ("max_position_embeddings", 131_072), ("rms_norm_eps", 1e-6))
_WINDOWS_BY_LAYER = frozenset({"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"})
_BIASES = frozenset({"attention_bias", "mlp_bias"})
# Mixtures of experts. The router's aux loss and jitter are training settings (inference never adds noise);
# num_experts is what Mixtral's and Qwen3-MoE's classes also call num_local_experts.
_MOE = frozenset({"num_experts", "num_local_experts", "num_experts_per_tok", "output_router_logits",
                  "router_aux_loss_coef", "router_jitter_noise"})
_QWEN_MOE = _MOE | {"moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"}
# gpt-oss: the checkpoints OpenAI published also hold `experts_per_token` (num_experts_per_tok's other name) and
# `initial_context_length` (the rope's original_max_position_embeddings, which is what transformers reads), and
# store the experts in MXFP4 (`quantization_config`, which the loader dequantizes).
_GPT_OSS = _MOE | {"sliding_window", "layer_types", "attention_bias", "swiglu_alpha", "swiglu_limit",
                   "experts_per_token", "initial_context_length", "quantization_config"}
_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
         "original_max_position_embeddings": 4096}
FAMILIES = {
    "llama": Family(keys=_BIASES),
    "mistral": Family(False, False, keys=frozenset({"sliding_window", "layer_types"}), window_on_every_layer=True),
    "qwen2": Family(True, False, keys=_WINDOWS_BY_LAYER, layer_types=("full_attention", "sliding_attention")),
    "qwen3": Family(qk_norm=True, keys=_WINDOWS_BY_LAYER | {"attention_bias"},
                    layer_types=("full_attention", "sliding_attention")),
    # Mistral's layers with a sparse MoE block in place of every MLP: softmax over all experts, the top k
    # renormalized.
    "mixtral": Family(False, False, keys=_MOE | {"sliding_window"}, window_on_every_layer=True,
                      moe_renormalize=True, moe_weights_fp32=True),
    # Qwen3's layers, MoE blocks on the layers `decoder_sparse_step` picks but `mlp_only_layers`; one window for
    # all layers under use_sliding_window (its model never reads max_window_layers, which its checkpoints hold).
    "qwen3_moe": Family(qk_norm=True, keys=_QWEN_MOE | (_WINDOWS_BY_LAYER - {"layer_types"}) | {"attention_bias"},
                        window_on_every_layer=True),
    # Qwen2's layers (q/k/v biases as its `qkv_bias` says), MoE blocks as Qwen3-MoE's plus a shared expert, a
    # dense MLP whose output is scaled by sigmoid(shared_expert_gate) and added.
    "qwen2_moe": Family(None, False, keys=_QWEN_MOE | _WINDOWS_BY_LAYER | {"qkv_bias",
                                                                         "shared_expert_intermediate_size"},
                        layer_types=("full_attention", "sliding_attention"), alternate_windows=True,
                        defaults=(("qkv_bias", True),)),
    # Attention sinks, biases on every projection, windows on alternate layers (the first, third, ...; a window of
    # 128 by default), YaRN, and MoE blocks on every layer: the top k of the biased router logits softmaxed, each
    # expert's clamped SwiGLU with biases (`GptOssExperts`).
    "gpt_oss": Family(keys=_GPT_OSS, layer_types=("full_attention", "sliding_attention"), attention_sinks=True,
                      moe_top_k_first=True, moe_biases=True,
                      defaults=(("sliding_window_pattern", 2), ("sliding_window", 128), ("attention_bias", True),
                                ("rope_theta", 150000.0), ("rope_parameters", _YARN), ("swiglu_alpha", 1.702),
                                ("swiglu_limit", 7.0), ("rms_norm_eps", 1e-5))),
    # Llama's layers from fused checkpoints (qkv_proj, gate_up_proj: the loader reads their parts), rotary
    # embedding over the first `partial_rotary_factor` of each head; original_max_position_embeddings is LongRoPE's.
    "phi3": Family(False, False, keys=frozenset({"sliding_window", "original_max_position_embeddings",
                                                 "partial_rotary_factor"}),
                   window_on_every_layer=True),
    # Llama's layers, scaled: the embeddings, each layer's output added to the residual stream, the attention
    # scores (in place of 1/sqrt(head_dim)) and the logits (divided).
    "granite": Family(keys=_BIASES | {"embedding_multiplier", "residual_multiplier", "attention_multiplier",
                                      "logits_scaling"}),
    # Llama's layers, some without rotary embedding (`no_rope_layers`), windows as Qwen2's but on those layers.
    "smollm3": Family(keys=_BIASES | (_WINDOWS_BY_LAYER - {"max_window_layers"})
                      | {"no_rope_layers", "no_rope_layer_interval"},
                      layer_types=("full_attention", "sliding_attention")),
    # Llama's layers with the norms after each sublayer, and q/k RMSNorms over all heads together.
    "olmo2": Family(keys=frozenset({"attention_bias"}), qk_norm=True, qk_norm_across_heads=True, norms="post"),
    # Gemma's: sandwich norms of (1 + weight), scaled embeddings, a GELU (tanh) MLP, attention scores scaled by
    # query_pre_attn_scalar ** -0.5 and soft-capped, soft-capped logits, windows on the layers `layer_types`
    # names sliding (every other one by default).
    "gemma2": Family(keys=_GEMMA, layer_types=("full_attention", "sliding_attention"), norms="sandwich",
                     norm_weight_offset=1.0, embeddings_scaled=True,
                     defaults=_GEMMA_DEFAULTS + (("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0),
                                                 ("sliding_window_pattern", 2))),
    # Gemma 2's layers with q/k norms, no logit soft cap by default and no attention soft cap (its class holds
    # one, which its attention never applies), five sliding layers to one full by default (`sliding_window_pattern`),
    # and rope of its own base on the sliding layers (`rope_local_base_freq`, or transformers 5's `rope_parameters`
    # per layer type).
    "gemma3_text": Family(qk_norm=True, keys=_GEMMA | {"sliding_window_pattern", "_sliding_window_pattern",
                                                       "rope_local_base_freq"},
                          layer_types=("full_attention", "sliding_attention"), norms="sandwich",
                          norm_weight_offset=1.0, embeddings_scaled=True, unread=frozenset({"attn_logit_softcapping"}),
                          defaults=_GEMMA_DEFAULTS + (("sliding_window_pattern", 6), ("rope_theta", 1_000_000.0),
                                                      ("rope_local_base_freq", 10_000.0), *_GEMMA3_SHAPE)),
}
# Gemma 3's multimodal checkpoints (model_type gemma3): the keys beside `text_config` that its text model does not
# read (the vision tower's, the image tokens'), and those it takes from the top level.
_MULTIMODAL_UNREAD = frozenset({"vision_config", "boi_token_index", "eoi_token_index", "image_token_index",
                                "mm_tokens_per_image"})
_MULTIMODAL_TOP = ("tie_word_embeddings", "eos_token_id", "bos_token_id", "pad_token_id", "torch_dtype", "dtype",
                   "initializer_range")
_LAYER_TYPE_ROPES = ("full_attention", "sliding_attention")  # the keys of Gemma 3's rope_parameters per layer type

# What a config may hold. A key outside these is refused by name at load: one this engine does not know may change
# what the model computes (a window, a soft cap, experts), and computing without it would answer wrongly.
# Read by `from_dict` for every family:
_HONOURED = frozenset({
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
    "max_position_embeddings", "tie_word_embeddings", "hidden_act", "hidden_activation", "eos_token_id",
    "bos_token_id", "torch_dtype", "dtype", "initializer_range",
})
# Never change what the model computes: bookkeeping, training-only settings (dropout, tensor-parallel training
# splits that sum to the same product), other token ids, and generation defaults (requests carry their own).
# `rope_interleaved` is a training framework's; transformers' Llama does not read it, and neither does this.
_INERT = frozenset({
    "_name_or_path", "_model_name_or_path", "name_or_path", "architectures", "transformers_version", "auto_map",
    "transformers.js_config", "is_llama_config", "rope_interleaved", "pretraining_tp", "attention_dropout",
    "hidden_dropout", "resid_pdrop", "embd_pdrop", "use_cache", "pad_token_id", "unk_token_id", "sep_token_id",
    "decoder_start_token_id", "cache_implementation",
    "output_attentions", "output_hidden_states", "return_dict", "id2label", "label2id", "problem_type",
    "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder", "add_cross_attention", "tie_encoder_decoder",
    "torchscript", "pruned_heads", "tokenizer_class", "prefix", "task_specific_params", "finetuning_task",
    "cross_attention_hidden_size", "use_bfloat16", "tf_legacy_loss", "output_scores", "return_dict_in_generate",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty",
    "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences",
    "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens",
})
# The rope settings read for each scaling type (`rope_type` / `type` and `rope_theta` besides).
_ROPE_KEYS = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "dynamic": frozenset({"factor"}),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
    "longrope": frozenset({"short_factor", "long_factor", "factor", "attention_factor",
                           "original_max_position_embeddings"}),
    "yarn": frozenset({"factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                       "original_max_position_embeddings", "truncate"}),
}


def layer_windows(d: dict[str, Any]) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention), as transformers' class for the family computes it.
    Mistral, Phi-3: `sliding_window` on every layer. Gemma, gpt-oss: on the layers `layer_types` names sliding (by
    default all but every `sliding_window_pattern`-th). Qwen2, Qwen3, SmolLM3: a window only with
    `use_sliding_window`, on the layers `layer_types` names sliding (by default those from `max_window_layers` on;
    SmolLM3's, those without rotary embedding)."""
    num_layers = d["num_hidden_layers"]
    model_type = d["model_type"]
    family = FAMILIES[model_type]
    gated = "use_sliding_window" in family.keys  # windows only with use_sliding_window
    if family.window_on_every_layer:  # Qwen3-MoE's too, under use_sliding_window
        return (d.get("sliding_window") if not gated or d.get("use_sliding_window") else None,) * num_layers
    if "sliding_window_pattern" in dict(FAMILIES[model_type].defaults):  # Gemma's, gpt-oss's: no use_sliding_window
        pattern = d["sliding_window_pattern"]  # every pattern-th layer attends in full
        types = d.get("layer_types") or ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                         for i in range(num_layers)]
        return tuple(d.get("sliding_window") if kind == "sliding_attention" else None for kind in types)
    if not gated or not d.get("use_sliding_window"):
        return (None,) * num_layers
    window = d.get("sliding_window")
    if family.alternate_windows:
        default = ["sliding_attention" if i % 2 == 0 and i < d.get("max_window_layers", 28) else "full_attention"
                   for i in range(num_layers)]
    elif "no_rope_layers" in family.keys:  # by default the layers without rotary embedding slide
        default = ["sliding_attention" if window is not None and not rope else "full_attention"
                   for rope in rope_layers(d)]
    else:
        default = ["sliding_attention" if window is not None and i >= d.get("max_window_layers", 28)
                   else "full_attention" for i in range(num_layers)]
    types = d.get("layer_types") or default
    return tuple(window if kind == "sliding_attention" else None for kind in types)


def rope_layers(d: dict[str, Any]) -> tuple[bool, ...]:
    """Whether each layer rotates its queries and keys: all do, but SmolLM3's `no_rope_layers` (1: rotary
    embedding, 0: none; by default every `no_rope_layer_interval`-th layer has none)."""
    num_layers = d["num_hidden_layers"]
    if "no_rope_layers" not in FAMILIES[d["model_type"]].keys:
        return (True,) * num_layers
    flags = d.get("no_rope_layers")
    if flags is None:
        interval = d.get("no_rope_layer_interval", 4)
        flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
    return tuple(bool(f) for f in flags)


def check_honoured(d: dict[str, Any]) -> None:
    """ValueError naming every key of the config `d` that would change the computation and is not honoured:
    keys this engine does not know, and known keys set to what it does not compute (layers of an attention type
    the family does not have, a rope setting its scaling type does not read)."""
    model_type = d.get("model_type")
    family = FAMILIES[model_type]
    known = _HONOURED | family.keys | _INERT
    num_layers = d.get("num_hidden_layers", dict(family.defaults).get("num_hidden_layers"))
    refused = [f"{key} (not a setting of {model_type} models that this engine knows)"
               for key in sorted(set(d) - known)]
    # Qwen2-MoE's config class writes sliding_window 0 where use_sliding_window is off: unread then
    window = d.get("sliding_window") if d.get("use_sliding_window", True) else None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        refused.append(f"sliding_window={window!r} (a number of positions, at least 1)")
    layer_types = d.get("layer_types")
    if layer_types is not None:
        other_layers = sorted({kind for kind in layer_types if kind not in family.layer_types})
        if other_layers:
            refused.append(f"layer_types (layers of {', '.join(map(repr, other_layers))} are not supported for "
                           f"{model_type}: {', '.join(family.layer_types)})")
        if len(layer_types) != num_layers:
            refused.append(f"layer_types ({len(layer_types)} entries for num_hidden_layers={num_layers})")
    no_rope = d.get("no_rope_layers")
    if no_rope is not None and (len(no_rope) != num_layers or set(no_rope) - {0, 1}):
        refused.append(f"no_rope_layers (one 0 or 1 per layer, {num_layers} of them)")
    refused += [f"{key}={d[key]!r} (held by {model_type}'s config class, never applied by its model)"
                for key in sorted(family.unread) if d.get(key)]
    refused += _moe_refusals(d, num_layers)
    if d.get("use_bidirectional_attention"):
        refused.append("use_bidirectional_attention (attention here is causal)")
    for name, rope in _rope_settings(d):
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind in _ROPE_KEYS:
            # a rotary embedding over the whole head (factor 1.0) is what a family without the key computes
            unread = sorted(key for key in set(rope) - _ROPE_KEYS[kind] - {"rope_type", "type", "rope_theta"}
                            if not (key == "partial_rotary_factor"
                                    and (rope[key] == 1.0 or key in family.keys)))
            refused += [f"{name}.{key} (not read for rope_type {kind!r})" for key in unread]
        if name.endswith("sliding_attention") and kind != "default":
            refused.append(f"{name}.rope_type={kind!r} (the sliding layers' rope is the default type here)")
    if refused:
        raise ValueError(f"config of model_type={model_type!r} asks for what this engine does not compute: "
                         + "; ".join(refused))


def _moe_refusals(d: dict[str, Any], num_layers: int) -> list[str]:
    """What a mixture-of-experts config asks for that this engine does not compute (no experts on a MoE block,
    more experts per token than there are, a dense layer that is not one)."""
    refused = []
    experts = d.get("num_experts", d.get("num_local_experts"))
    if "num_experts" in d and "num_local_experts" in d and d["num_experts"] != d["num_local_experts"]:
        refused.append(f"num_experts={d['num_experts']!r} and num_local_experts={d['num_local_experts']!r} (one "
                       "count of experts, under either name)")
    per_token = d.get("num_experts_per_tok")
    if experts is not None and per_token is not None and not 0 < per_token <= experts:
        refused.append(f"num_experts_per_tok={per_token!r} (between 1 and num_experts={experts})")
    step = d.get("decoder_sparse_step")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 1):
        refused.append(f"decoder_sparse_step={step!r} (every how many layers a MoE block sits, at least 1)")
    if experts and d.get("hidden_act", "silu") != "silu":
        refused.append(f"hidden_act={d['hidden_act']!r} (the experts here are SiLU-gated)")
    dense = d.get("mlp_only_layers") or []
    if any(not isinstance(i, int) or not 0 <= i < (num_layers or 0) for i in dense):
        refused.append(f"mlp_only_layers={dense!r} (layer indices below num_hidden_layers={num_layers})")
    if "experts_per_token" in d and d["experts_per_token"] != per_token:
        refused.append(f"experts_per_token={d['experts_per_token']!r} and num_experts_per_tok={per_token!r} (one "
                       "count of experts per token, under either name)")
    quantization = d.get("quantization_config")
    if quantization is not None and (not isinstance(quantization, dict)
                                     or quantization.get("quant_method") != "mxfp4"):
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        refused.append(f"quantization_config.quant_method={method!r} (mxfp4 experts are loaded; no other method)")
    for key in ("swiglu_limit", "swiglu_alpha"):
        if key in d and (isinstance(d[key], bool) or not isinstance(d[key], int | float) or not d[key] > 0):
            refused.append(f"{key}={d[key]!r} (a positive number)")
    return refused


def moe_layers(d: dict[str, Any]) -> tuple[bool, ...]:
    """Whether each layer has a sparse MoE block in place of its MLP, as transformers' classes choose: every layer
    (Mixtral), or those whose index + 1 is a multiple of `decoder_sparse_step` and not in `mlp_only_layers`
    (Qwen2-MoE, Qwen3-MoE); none without experts."""
    experts = d.get("num_experts", d.get("num_local_experts")) or 0
    step, dense = d.get("decoder_sparse_step", 1), set(d.get("mlp_only_layers") or [])
    return tuple(experts > 0 and "num_experts_per_tok" in FAMILIES[d["model_type"]].keys
                 and i not in dense and (i + 1) % step == 0 for i in range(d["num_hidden_layers"]))


def text_part(d: dict[str, Any]) -> dict[str, Any]:
    """The text model's config (a gemma3_text one) of a multimodal Gemma 3 checkpoint's config `d`: its
    `text_config`, with the settings the top level holds for it. ValueError naming the keys that mean more than
    text (images are not supported: the vision tower's weights are never read)."""
    text = dict(d.get("text_config") or {})
    if text.get("model_type", "gemma3_text") != "gemma3_text":
        raise ValueError(f"text_config.model_type={text['model_type']!r}: a gemma3 checkpoint's text model is "
                         "gemma3_text")
    unknown = sorted(set(d) - _MULTIMODAL_UNREAD - set(_MULTIMODAL_TOP) - _INERT - {"model_type", "text_config"})
    if text.get("final_logit_softcapping"):  # Gemma3ForConditionalGeneration's head never applies it
        unknown.append(f"text_config.final_logit_softcapping={text['final_logit_softcapping']!r} (never applied by "
                       "the multimodal model's head)")
    if unknown:
        raise ValueError("config of model_type='gemma3' (Gemma 3's multimodal checkpoint, whose text model is "
                         f"served) asks for what this engine does not compute: {', '.join(unknown)}")
    return text | {key: d[key] for key in _MULTIMODAL_TOP if key in d} | {"model_type": "gemma3_text"}


def _rope_settings(d: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The config's rope settings, each with the name it is refused by: `rope_scaling`, `rope_parameters`, or
    each entry of Gemma 3's `rope_parameters` per layer type (transformers 5)."""
    settings = [("rope_scaling", d.get("rope_scaling") or {})]
    rope = d.get("rope_parameters") or {}
    if set(rope) & set(_LAYER_TYPE_ROPES) and "rope_local_base_freq" in FAMILIES[d["model_type"]].keys:
        settings += [(f"rope_parameters.{kind}", rope.get(kind) or {}) for kind in _LAYER_TYPE_ROPES]
    else:
        settings.append(("rope_parameters", rope))
    return settings


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    rotary_dim: int  # the leading dims of each head that rotary embedding rotates (head_dim but for Phi-3's partial)
    layer_windows: tuple[int | None, ...]  # per layer: its sliding window, None for full attention
    rope_layers: tuple[bool, ...]  # per layer: whether it rotates queries and keys
    # Granite's scales (1 elsewhere): the embeddings, the layers' outputs added to the residual stream, the
    # attention scores (None: 1 / sqrt(head_dim)) and the logits (divided by logits_scaling).
    embedding_multiplier: float
    residual_multiplier: float
    attention_multiplier: float | None
    logits_scaling: float
    # Soft caps (None: none): attention scores, before the mask, and the logits become cap * tanh(x / cap) (Gemma's)
    attn_logit_softcapping: float | None
    final_logit_softcapping: float | None
    local_rope_theta: float | None  # the sliding layers' rope base where it is their own (Gemma 3's), else None
    hidden_act: str  # silu, or gelu_pytorch_tanh (GELU's tanh approximation)
    # Mixture of experts (num_experts 0: none). The layers `moe_layers` marks have a sparse MoE block in place of
    # the MLP: a router picks num_experts_per_tok of num_experts SiLU-gated experts of moe_intermediate_size per
    # token (softmax over all, then the top k, renormalized with norm_topk_prob), plus Qwen2-MoE's shared expert
    # (shared_expert_intermediate_size, 0: none). The other layers keep the dense MLP of intermediate_size.
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    moe_layers: tuple[bool, ...]
    # gpt-oss's experts: SiLU's gate clamped from above and the up projection on both sides at swiglu_limit, the
    # gate's sigmoid taken of swiglu_alpha times it, and (up + 1) multiplied in. None: plain SiLU experts.
    swiglu_limit: float | None
    swiglu_alpha: float
    initializer_range: float
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str | None

    @property
    def long_rope_after(self) -> int | None:
        """LongRoPE: the sequence length past which the long factors apply (None: another rotary embedding)."""
        if self.rope_scaling is None or self.rope_scaling["rope_type"] != "longrope":
            return None
        return self.rope_scaling["original_max_position_embeddings"]

    @property
    def family(self) -> Family:
        """What its model_type computes beyond Llama's decoder (q/k norms, where the norms sit, ...): read from
        here, never copied."""
        return FAMILIES[self.model_type]

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        with open(path) as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        model_type = d.get("model_type")
        if model_type == "gemma3":
            d = text_part(d)
            model_type = d["model_type"]
        if model_type not in FAMILIES:
            raise ValueError(f"model_type={model_type!r} is not supported (supported: {sorted(FAMILIES)})")
        check_honoured(d)
        family = FAMILIES[model_type]
        defaults = dict(family.defaults)
        # transformers 5 keeps rope settings only in `rope_parameters` (Gemma 3's: one per layer type); older
        # configs at top level. The family's default bases apply where neither gives one.
        # (gpt-oss's class defaults to YaRN where a config gives no rope settings at all)
        rope = dict(d.get("rope_parameters") or (None if d.get("rope_scaling") else defaults.get("rope_parameters"))
                    or {})
        local_theta = d.get("rope_local_base_freq", defaults.get("rope_local_base_freq"))
        if "full_attention" in rope and local_theta is not None:
            local_theta = (rope.get("sliding_attention") or {}).get("rope_theta", local_theta)
            rope = dict(rope["full_attention"])
        rope_theta = d.get("rope_theta", rope.get("rope_theta", defaults.get("rope_theta", 10000.0)))
        d = defaults | d
        attention_bias = bool(d.get("attention_bias", False))
        num_heads = d["num_attention_heads"]
        hidden = d["hidden_size"]
        scaling = d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            scaling = dict(scaling)
            scaling.setdefault("rope_type", scaling.get("type", "default"))
            if scaling["rope_type"] == "default":
                scaling = None
        if scaling is not None and scaling["rope_type"] not in ("linear", "dynamic", "llama3", "longrope", "yarn"):
            raise ValueError(f"rope_scaling type {scaling['rope_type']!r} is not supported "
                             "(supported: linear, dynamic, llama3, longrope, yarn)")
        head_dim = d.get("head_dim") or hidden // num_heads
        rotary_dim = _rotary_dim(d, rope, head_dim)
        if scaling is not None and scaling["rope_type"] == "longrope":
            scaling = _longrope(scaling, d, rotary_dim)
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        # Gemma's classes read hidden_activation (their configs may hold a hidden_act too, unread)
        act_key = "hidden_activation" if "hidden_activation" in d else "hidden_act"
        hidden_act = d.get(act_key, "silu")
        if hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"{act_key}={hidden_act!r} is not supported (silu, gelu_pytorch_tanh)")
        if model_type == "granite":  # Granite's default is 1.0 (GraniteConfig's), not 1 / sqrt(head_dim)
            attention_multiplier = float(d.get("attention_multiplier", 1.0))
        elif "query_pre_attn_scalar" in family.keys:
            attention_multiplier = d["query_pre_attn_scalar"] ** -0.5
        else:
            attention_multiplier = None
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=hidden,
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=bool(d.get("qkv_bias", attention_bias)) if family.qkv_bias is None else family.qkv_bias,
            o_bias=attention_bias if family.o_bias is None else family.o_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            rotary_dim=rotary_dim,
            layer_windows=layer_windows(d),
            rope_layers=rope_layers(d),
            embedding_multiplier=(hidden ** 0.5 if family.embeddings_scaled
                                  else float(d.get("embedding_multiplier", 1.0))),
            residual_multiplier=float(d.get("residual_multiplier", 1.0)),
            attention_multiplier=attention_multiplier,
            logits_scaling=float(d.get("logits_scaling", 1.0)),
            attn_logit_softcapping=_cap(d, "attn_logit_softcapping"),
            final_logit_softcapping=_cap(d, "final_logit_softcapping"),
            local_rope_theta=None if local_theta is None else float(local_theta),
            hidden_act=hidden_act,
            **_moe_fields(d, family),
            initializer_range=d.get("initializer_range", 0.02),
            eos_token_ids=eos_ids,
            bos_token_id=d.get("bos_token_id"),
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
        )


def _moe_fields(d: dict[str, Any], family: Family) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts values (none for a dense family). Mixtral's experts are intermediate_size
    wide, Qwen's moe_intermediate_size."""
    layers = moe_layers(d)
    if not any(layers):
        return dict(num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0, shared_expert_intermediate_size=0,
                    norm_topk_prob=False, moe_layers=layers, swiglu_limit=None, swiglu_alpha=1.0)
    renormalize = family.moe_renormalize
    return dict(num_experts=d.get("num_experts", d.get("num_local_experts")),
                num_experts_per_tok=d["num_experts_per_tok"],
                moe_intermediate_size=d.get("moe_intermediate_size", d["intermediate_size"]),
                shared_expert_intermediate_size=d.get("shared_expert_intermediate_size", 0),
                norm_topk_prob=bool(d.get("norm_topk_prob", False)) if renormalize is None else renormalize,
                moe_layers=layers,
                swiglu_limit=float(d["swiglu_limit"]) if "swiglu_limit" in family.keys else None,
                swiglu_alpha=float(d.get("swiglu_alpha", 1.0)))


def _rotary_dim(d: dict[str, Any], rope: dict[str, Any], head_dim: int) -> int:
    """How many leading dims of each head are rotated: int(head_dim * partial_rotary_factor), as transformers' rope
    init functions compute it, for a family that reads the factor (`check_honoured` refuses it elsewhere)."""
    if "partial_rotary_factor" not in FAMILIES[d["model_type"]].keys:
        return head_dim
    factor = d.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * factor)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ValueError(f"partial_rotary_factor={factor!r} must rotate an even number of each head's {head_dim} "
                         f"dims, at least 2 (it rotates {rotary_dim})")
    return rotary_dim


def _longrope(scaling: dict[str, Any], d: dict[str, Any], rotary_dim: int) -> dict[str, Any]:
    """LongRoPE's settings, whole: original_max_position_embeddings (in rope_scaling, or at the top level as Phi-3
    configs keep it), each factor list checked for one entry per rotated pair of dims."""
    original = scaling.get("original_max_position_embeddings", d.get("original_max_position_embeddings"))
    if not isinstance(original, int) or original < 1:
        raise ValueError(f"rope_scaling.original_max_position_embeddings={original!r}: LongRoPE needs the trained "
                         "context length, a positive integer")
    for key in ("short_factor", "long_factor"):
        factors = scaling.get(key)
        if not isinstance(factors, list) or len(factors) != rotary_dim // 2:
            raise ValueError(f"rope_scaling.{key} must be a list of {rotary_dim // 2} numbers (one per rotated pair "
                             f"of dims), got {factors!r}")
    return {**scaling, "original_max_position_embeddings": original}


def _cap(d: dict[str, Any], key: str) -> float | None:
    """A soft cap's value (None or 0: none); ValueError naming `key` unless it is a positive number."""
    cap = d.get(key)
    if not cap:
        return None
    if isinstance(cap, bool) or not isinstance(cap, int | float) or cap < 0:
        raise ValueError(f"{key}={cap!r} must be a positive number (or null: no cap)")
    return float(cap)
