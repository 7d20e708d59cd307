"""A config is honoured or refused, never partly ignored: every key that would change what the model computes and
that the engine does not compute is named at load, before any weight is read."""

from __future__ import annotations

import json

import pytest
import transformers

from pagedserve import LLM
from pagedserve.workers.models.model_config import ModelConfig

TINY = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, pad_token_id=0)


def saved(tmp_path, config: transformers.PretrainedConfig, **extra) -> dict:
    """The config.json transformers writes for `config`, with `extra` keys set in it."""
    config.save_pretrained(tmp_path)
    d = json.loads((tmp_path / "config.json").read_text()) | extra
    (tmp_path / "config.json").write_text(json.dumps(d))
    return d


@pytest.mark.parametrize("config", [transformers.LlamaConfig(**TINY), transformers.MistralConfig(**TINY),
                                    transformers.Qwen2Config(**TINY), transformers.Qwen3Config(**TINY),
                                    transformers.GraniteConfig(**TINY), transformers.SmolLM3Config(**TINY),
                                    transformers.Phi3Config(**TINY), transformers.Olmo2Config(**TINY),
                                    transformers.Gemma2Config(**TINY), transformers.Gemma3TextConfig(**TINY),
                                    transformers.MixtralConfig(**TINY), transformers.Qwen3MoeConfig(**TINY),
                                    transformers.Qwen2MoeConfig(**TINY), transformers.GptOssConfig(**TINY)],
                         ids=lambda c: c.model_type)
def test_the_configs_transformers_writes_for_the_served_families_load(tmp_path, config):
    d = saved(tmp_path, config)
    assert ModelConfig.from_dict(d).model_type == config.model_type


@pytest.mark.parametrize("config, windows", [
    (transformers.LlamaConfig(**TINY), (None, None)),
    (transformers.MistralConfig(**TINY, sliding_window=16), (16, 16)),
    (transformers.MistralConfig(**TINY, sliding_window=None), (None, None)),
    (transformers.Qwen2Config(**TINY, sliding_window=8), (None, None)),  # without use_sliding_window: none
    (transformers.Qwen2Config(**TINY, use_sliding_window=True, sliding_window=8, max_window_layers=1), (None, 8)),
    (transformers.Qwen3Config(**TINY, use_sliding_window=True, sliding_window=8, max_window_layers=0), (8, 8)),
    (transformers.SmolLM3Config(**TINY, no_rope_layer_interval=2), (None, None)),
    (transformers.SmolLM3Config(**TINY, no_rope_layer_interval=2, use_sliding_window=True, sliding_window=8),
     (None, 8)),  # by default its layers without rotary embedding slide
    (transformers.Gemma2Config(**TINY | dict(num_hidden_layers=3), sliding_window=8), (8, None, 8)),
    (transformers.Gemma3TextConfig(**TINY | dict(num_hidden_layers=7), sliding_window=8), (8,) * 5 + (None, 8)),
    (transformers.Gemma3TextConfig(**TINY | dict(num_hidden_layers=3), sliding_window=8, sliding_window_pattern=2),
     (8, None, 8)),
], ids=["llama", "mistral", "mistral-none", "qwen2-off", "qwen2", "qwen3", "smollm3-off", "smollm3", "gemma2",
        "gemma3", "gemma3-pattern"])
def test_each_layer_has_the_window_transformers_gives_it(tmp_path, config, windows):
    d = saved(tmp_path, config)
    assert ModelConfig.from_dict(d).layer_windows == windows
    model = transformers.AutoModelForCausalLM.from_config(config)
    # Qwen2's and Qwen3's attention layers hold their window; Mistral's reads the config's in every layer.
    default = getattr(model.config, "sliding_window", None)
    assert tuple(getattr(layer.self_attn, "sliding_window", default) for layer in model.model.layers) == windows


def test_a_qwen2_checkpoint_without_layer_types_takes_its_windows_from_max_window_layers(tmp_path):
    """As configs written before transformers kept `layer_types` (Qwen2.5's) have them."""
    d = saved(tmp_path, transformers.Qwen2Config(**TINY))
    d = {k: v for k, v in d.items() if k != "layer_types"} | dict(use_sliding_window=True, sliding_window=8,
                                                                  max_window_layers=1)
    assert ModelConfig.from_dict(d).layer_windows == (None, 8)


def test_layer_types_a_family_does_not_have_are_refused_by_name(tmp_path):
    d = saved(tmp_path, transformers.LlamaConfig(**TINY), layer_types=["full_attention", "sliding_attention"])
    with pytest.raises(ValueError, match=r"layer_types \(layers of 'sliding_attention' are not supported for llama"):
        LLM(f"random:{tmp_path / 'config.json'}", device="cpu")
    d = saved(tmp_path, transformers.Qwen2Config(**TINY), layer_types=["full_attention", "chunked_attention"])
    with pytest.raises(ValueError, match=r"layers of 'chunked_attention' are not supported for qwen2"):
        ModelConfig.from_dict(d)
    d["layer_types"] = ["full_attention"] * 3
    with pytest.raises(ValueError, match=r"layer_types \(3 entries for num_hidden_layers=2\)"):
        ModelConfig.from_dict(d)


def test_every_unknown_or_unhonoured_key_is_named(tmp_path):
    d = saved(tmp_path, transformers.LlamaConfig(**TINY), attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
              num_experts=8, quantization_config={"quant_method": "awq"}, sliding_window=16,
              layer_types=["full_attention", "sliding_attention"])
    with pytest.raises(ValueError) as refused:
        ModelConfig.from_dict(d)
    message = str(refused.value)
    for key in ("attn_logit_softcapping", "final_logit_softcapping", "num_experts", "quantization_config",
                "sliding_window", "layer_types"):
        assert f"{key} (" in message, key


def test_rope_settings_its_scaling_type_does_not_read_are_refused(tmp_path):
    rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    d = saved(tmp_path, transformers.LlamaConfig(**TINY), rope_parameters=rope)
    with pytest.raises(ValueError, match=r"rope_parameters.partial_rotary_factor \(not read for rope_type 'linear'\)"):
        ModelConfig.from_dict(d)


def test_keys_that_change_nothing_pass(tmp_path):
    """Bookkeeping, training-only settings and generation defaults, as real checkpoints carry them."""
    d = saved(tmp_path, transformers.LlamaConfig(**TINY), architectures=["LlamaForCausalLM"], pretraining_tp=1,
              rope_interleaved=False, is_llama_config=True, attention_dropout=0.0, use_cache=True, max_length=20,
              temperature=0.7, pad_token_id=0, _name_or_path="x")
    assert ModelConfig.from_dict(d).num_layers == 2


def test_smollm3_layers_without_rotary_embedding_are_those_transformers_skips(tmp_path):
    config = transformers.SmolLM3Config(**TINY | dict(num_hidden_layers=4), no_rope_layer_interval=2)
    d = saved(tmp_path, config)
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert ModelConfig.from_dict(d).rope_layers == tuple(bool(layer.self_attn.use_rope) for layer in model.model.layers)
    assert ModelConfig.from_dict(d).rope_layers == (True, False, True, False)
    d["no_rope_layers"] = [1, 2, 1, 0]
    with pytest.raises(ValueError, match=r"no_rope_layers \(one 0 or 1 per layer, 4 of them\)"):
        ModelConfig.from_dict(d)


def test_olmo2_norms_sit_after_each_sublayer_and_its_qk_norms_span_all_heads(tmp_path):
    config = ModelConfig.from_dict(saved(tmp_path, transformers.Olmo2Config(**TINY)))
    assert (config.family.norms, config.family.qk_norm, config.family.qk_norm_across_heads) == ("post", True, True)
    llama = ModelConfig.from_dict(saved(tmp_path, transformers.LlamaConfig(**TINY)))
    assert (llama.family.norms, llama.family.qk_norm, llama.family.qk_norm_across_heads) == ("pre", False, False)
    d = saved(tmp_path, transformers.Olmo2Config(**TINY), mlp_bias=True)  # Olmo2MLP has no biases
    with pytest.raises(ValueError, match=r"mlp_bias \(not a setting of olmo2 models"):
        ModelConfig.from_dict(d)


def longrope(rotary_dim: int, **extra) -> dict:
    return {"rope_type": "longrope", "short_factor": [1.0] * (rotary_dim // 2),
            "long_factor": [2.0] * (rotary_dim // 2)} | extra


def test_phi3_partial_rotary_factor_sets_the_rotated_width(tmp_path):
    """Phi-4-mini's 0.75 of each head, at the top level (Phi3Config) or in rope_parameters."""
    d = saved(tmp_path, transformers.Phi3Config(**TINY, partial_rotary_factor=0.75, head_dim=16))
    assert ModelConfig.from_dict(d).rotary_dim == 12
    d = {k: v for k, v in d.items() if k != "partial_rotary_factor"}
    assert ModelConfig.from_dict(d).rotary_dim == 12  # from rope_parameters
    d["rope_parameters"]["partial_rotary_factor"] = 0.2  # int(3.2) = 3 of 16 dims: not pairs
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0.2 must rotate an even number"):
        ModelConfig.from_dict(d)
    assert ModelConfig.from_dict(saved(tmp_path, transformers.Phi3Config(**TINY))).rotary_dim == 8


def test_phi3_longrope_loads_as_checkpoints_write_it(tmp_path):
    """Phi-3-mini-128k's config.json: original_max_position_embeddings at the top level, rope_scaling of type
    longrope; transformers 5 writes both into rope_parameters as well."""
    d = saved(tmp_path, transformers.Phi3Config(**TINY, max_position_embeddings=4096,
                                                original_max_position_embeddings=256, rope_scaling=longrope(8)))
    scaling = ModelConfig.from_dict(d).rope_scaling
    assert scaling["rope_type"] == "longrope" and scaling["original_max_position_embeddings"] == 256
    old = {k: v for k, v in d.items() if k != "rope_parameters"} | {"rope_scaling": {
        "type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}}
    scaling = ModelConfig.from_dict(old).rope_scaling
    assert scaling["rope_type"] == "longrope" and scaling["original_max_position_embeddings"] == 256
    old["rope_scaling"]["long_factor"] = [2.0] * 8  # one per rotated pair of dims: 4
    with pytest.raises(ValueError, match=r"rope_scaling.long_factor must be a list of 4 numbers"):
        ModelConfig.from_dict(old)


def test_rope_scalings_this_engine_does_not_compute_stay_refused_by_name(tmp_path):
    for rope, match in [({"rope_type": "proportional", "factor": 4.0},
                         r"rope_scaling type 'proportional' is not supported"),
                        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                          "low_freq_factor": 1.0},
                         r"rope_parameters.low_freq_factor \(not read for rope_type 'yarn'\)"),
                        (longrope(8, original_max_position_embeddings=256, mscale=1.2),
                         r"rope_parameters.mscale \(not read for rope_type 'longrope'\)")]:
        d = saved(tmp_path, transformers.LlamaConfig(**TINY))
        d["rope_parameters"] = rope | {"rope_theta": 10000.0}
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_dict(d)
    d = saved(tmp_path, transformers.LlamaConfig(**TINY), partial_rotary_factor=0.5)  # Llama rotates whole heads
    with pytest.raises(ValueError, match=r"partial_rotary_factor \(not a setting of llama models"):
        ModelConfig.from_dict(d)


def test_gemma3_configs_written_before_rope_parameters_per_layer_type(tmp_path):
    """As Gemma 3 checkpoints hold them: rope_theta and rope_scaling for the full layers, rope_local_base_freq for
    the sliding ones, sliding_window_pattern and no layer_types; and transformers 5's dict per layer type."""
    d = dict(TINY, model_type="gemma3_text", num_hidden_layers=4, rope_theta=1e6, rope_local_base_freq=1e4,
             rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window=16, sliding_window_pattern=4,
             query_pre_attn_scalar=16, cache_implementation="hybrid", attn_logit_softcapping=None,
             final_logit_softcapping=None)
    config = ModelConfig.from_dict(d)
    assert (config.rope_theta, config.local_rope_theta, config.rope_scaling["factor"]) == (1e6, 1e4, 8.0)
    assert config.layer_windows == (16, 16, 16, None)
    assert config.attention_multiplier == 16 ** -0.5 and config.hidden_act == "gelu_pytorch_tanh"
    new = saved(tmp_path, transformers.Gemma3TextConfig(**TINY, rope_theta=1e6, rope_local_base_freq=1e4,
                                                        rope_scaling={"rope_type": "linear", "factor": 8.0}))
    config = ModelConfig.from_dict(new)
    assert (config.rope_theta, config.local_rope_theta, config.rope_scaling["factor"]) == (1e6, 1e4, 8.0)


def test_gemma_settings_it_does_not_compute_are_refused_by_name(tmp_path):
    d = saved(tmp_path, transformers.Gemma3TextConfig(**TINY))
    refused = {
        "use_bidirectional_attention": (True, r"use_bidirectional_attention \(attention here is causal\)"),
        # transformers' Gemma 3 holds the setting and never applies it: computing it would differ from it
        "attn_logit_softcapping": (50.0, r"attn_logit_softcapping=50.0 \(held by gemma3_text's config class, never"),
        "rope_parameters": ({"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
                            r"rope_parameters.sliding_attention.rope_type='linear'"),
        "hidden_activation": ("gelu", r"hidden_activation='gelu' is not supported"),
    }
    for key, (value, message) in refused.items():
        with pytest.raises(ValueError, match=message):
            ModelConfig.from_dict(d | {key: value})


def test_a_multimodal_gemma3_checkpoint_is_read_as_its_text_model():
    """As gemma-3-4b-it's config.json holds it: a text_config of a few keys (the rest Gemma3TextConfig's
    defaults), the image settings and eos ids at the top level."""
    d = dict(architectures=["Gemma3ForConditionalGeneration"], boi_token_index=255999, eoi_token_index=256000,
             eos_token_id=[1, 106], image_token_index=262144, initializer_range=0.02, mm_tokens_per_image=256,
             model_type="gemma3", torch_dtype="bfloat16", transformers_version="4.50.0.dev0",
             text_config=dict(hidden_size=2560, intermediate_size=10240, model_type="gemma3_text",
                              num_hidden_layers=34, rope_scaling={"factor": 8.0, "rope_type": "linear"},
                              sliding_window=1024),
             vision_config=dict(hidden_size=1152, image_size=896, model_type="siglip_vision_model"))
    config = ModelConfig.from_dict(d)
    expected = transformers.Gemma3Config(**{k: v for k, v in d.items() if k != "model_type"}).text_config
    assert (config.model_type, config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
            config.head_dim, config.vocab_size) == ("gemma3_text", 34, 2560, expected.num_attention_heads,
                                                    expected.num_key_value_heads, expected.head_dim,
                                                    expected.vocab_size)
    assert config.layer_windows == tuple(1024 if kind == "sliding_attention" else None
                                         for kind in expected.layer_types)
    assert (config.rope_theta, config.local_rope_theta, config.rope_scaling["factor"]) == (
        expected.rope_parameters["full_attention"]["rope_theta"],
        expected.rope_parameters["sliding_attention"]["rope_theta"], 8.0)
    assert config.eos_token_ids == (1, 106) and config.tie_word_embeddings and config.torch_dtype == "bfloat16"
    assert config.attention_multiplier == expected.query_pre_attn_scalar ** -0.5
    with pytest.raises(ValueError, match=r"model_type='gemma3' .* does not compute: audio_config"):
        ModelConfig.from_dict(d | {"audio_config": {}})
    with pytest.raises(ValueError, match=r"text_config.final_logit_softcapping=30.0 \(never applied by the"):
        ModelConfig.from_dict(d | {"text_config": d["text_config"] | {"final_logit_softcapping": 30.0}})
    with pytest.raises(ValueError, match=r"text_config.model_type='gemma2'"):
        ModelConfig.from_dict(d | {"text_config": {"model_type": "gemma2"}})


MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)


@pytest.mark.parametrize("config", [
    transformers.MixtralConfig(**TINY | dict(num_hidden_layers=4), num_local_experts=4, num_experts_per_tok=2),
    transformers.Qwen3MoeConfig(**TINY | dict(num_hidden_layers=4), **MOE, decoder_sparse_step=2),
    transformers.Qwen3MoeConfig(**TINY | dict(num_hidden_layers=4), **MOE, mlp_only_layers=[0, 2]),
    transformers.Qwen2MoeConfig(**TINY | dict(num_hidden_layers=4), **MOE, shared_expert_intermediate_size=24,
                                norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[3]),
], ids=["mixtral", "qwen3_moe-step", "qwen3_moe-mlp-only", "qwen2_moe"])
def test_moe_layers_and_sizes_are_those_transformers_builds(tmp_path, config):
    d = saved(tmp_path, config)
    ours = ModelConfig.from_dict(d)
    model = transformers.AutoModelForCausalLM.from_config(config)
    sparse = tuple(hasattr(layer.mlp, "experts") for layer in model.model.layers)
    assert ours.moe_layers == sparse and any(sparse)
    moe = next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts"))
    assert ours.num_experts == moe.experts.gate_up_proj.shape[0] == 4
    assert ours.moe_intermediate_size == moe.experts.down_proj.shape[2]
    assert ours.num_experts_per_tok == 2
    shared = getattr(moe, "shared_expert", None)
    assert ours.shared_expert_intermediate_size == (0 if shared is None else shared.down_proj.in_features)
    assert ours.norm_topk_prob == getattr(config, "norm_topk_prob", True)  # Mixtral always renormalizes


def test_moe_settings_it_does_not_compute_are_refused_by_name(tmp_path):
    d = saved(tmp_path, transformers.Qwen3MoeConfig(**TINY, **MOE), num_experts_per_tok=5, decoder_sparse_step=0,
              mlp_only_layers=[7], moe_layer_freq=2)
    with pytest.raises(ValueError) as refused:
        ModelConfig.from_dict(d)
    message = str(refused.value)
    for key in ("num_experts_per_tok=5 (", "decoder_sparse_step=0 (", "mlp_only_layers=[7] (", "moe_layer_freq ("):
        assert key in message, key
    # a dense family's config with experts stays refused
    d = saved(tmp_path, transformers.MistralConfig(**TINY), num_local_experts=4, num_experts_per_tok=2)
    with pytest.raises(ValueError, match=r"num_local_experts \(not a setting of mistral"):
        ModelConfig.from_dict(d)
    # Mixtral's renormalization is not a setting of its class
    d = saved(tmp_path, transformers.MixtralConfig(**TINY), norm_topk_prob=False)
    with pytest.raises(ValueError, match=r"norm_topk_prob \(not a setting of mixtral"):
        ModelConfig.from_dict(d)


def test_router_training_settings_change_nothing(tmp_path):
    d = saved(tmp_path, transformers.MixtralConfig(**TINY), router_aux_loss_coef=0.02, router_jitter_noise=0.1,
              output_router_logits=True)
    assert ModelConfig.from_dict(d).num_experts == 8


@pytest.mark.parametrize("config, windows", [
    (transformers.Qwen3MoeConfig(**TINY, sliding_window=8), (None, None)),  # without use_sliding_window: none
    (transformers.Qwen3MoeConfig(**TINY, use_sliding_window=True, sliding_window=8, max_window_layers=0), (8, 8)),
    (transformers.Qwen2MoeConfig(**TINY), (None, None)),
    (transformers.Qwen2MoeConfig(**TINY | dict(num_hidden_layers=4), use_sliding_window=True, sliding_window=8,
                                 max_window_layers=3), (8, None, 8, None)),
    (transformers.MixtralConfig(**TINY, sliding_window=8), (8, 8)),
    (transformers.GptOssConfig(**TINY | dict(num_hidden_layers=3), sliding_window=8), (8, None, 8)),
], ids=["qwen3_moe-off", "qwen3_moe", "qwen2_moe-off", "qwen2_moe", "mixtral", "gpt_oss"])
def test_moe_families_layers_have_the_windows_transformers_gives_them(tmp_path, config, windows):
    d = saved(tmp_path, config)
    assert ModelConfig.from_dict(d).layer_windows == windows
    d.pop("layer_types", None)  # as configs written before transformers kept them
    assert ModelConfig.from_dict(d).layer_windows == windows


def test_gpt_oss_configs_as_published_and_as_transformers_defaults_them(tmp_path):
    """OpenAI's config.json (rope_scaling at the top level, experts_per_token and initial_context_length beside
    transformers' keys, MXFP4 experts) loads; one without rope settings, windows or layer types gets what
    GptOssConfig gives (YaRN over a base of 150000, a window of 128 on alternate layers)."""
    yarn = {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
            "rope_type": "yarn", "truncate": False}
    published = {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "attention_bias": True,
                 "attention_dropout": 0.0, "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64,
                 "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
                 "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
                 "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4,
                 "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32,
                 "output_router_logits": False, "pad_token_id": 199999, "quantization_config": {
                     "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
                 "rms_norm_eps": 1e-05, "rope_scaling": yarn, "rope_theta": 150000, "router_aux_loss_coef": 0.9,
                 "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
                 "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088}
    config = ModelConfig.from_dict(published)
    assert config.layer_windows == (128, None) * 12 and config.moe_layers == (True,) * 24
    assert config.rope_scaling["rope_type"] == "yarn" and config.rope_theta == 150000.0
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (32, 4, 2880)
    assert (config.swiglu_limit, config.swiglu_alpha, config.qkv_bias, config.o_bias) == (7.0, 1.702, True, True)
    bare = {k: v for k, v in published.items() if k not in ("rope_scaling", "rope_theta", "sliding_window",
                                                             "layer_types", "quantization_config")}
    defaulted = ModelConfig.from_dict(bare)
    assert defaulted.layer_windows == config.layer_windows
    assert (defaulted.rope_scaling, defaulted.rope_theta) == (config.rope_scaling, 150000.0)


def test_gpt_oss_settings_it_does_not_compute_are_refused_by_name(tmp_path):
    d = saved(tmp_path, transformers.GptOssConfig(**TINY), experts_per_token=3, swiglu_limit=-1.0,
              quantization_config={"quant_method": "fp8"})
    with pytest.raises(ValueError) as refused:
        ModelConfig.from_dict(d)
    message = str(refused.value)
    for key in ("experts_per_token=3 and num_experts_per_tok=4 (", "swiglu_limit=-1.0 (",
                "quantization_config.quant_method='fp8' ("):
        assert key in message, key
    d = saved(tmp_path, transformers.Qwen3MoeConfig(**TINY), swiglu_limit=7.0)  # not a setting of other families
    with pytest.raises(ValueError, match=r"swiglu_limit \(not a setting of qwen3_moe"):
        ModelConfig.from_dict(d)
