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
                                    transformers.Phi3Config(**TINY), transformers.Olmo2Config(**TINY)],
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
], ids=["llama", "mistral", "mistral-none", "qwen2-off", "qwen2", "qwen3", "smollm3-off", "smollm3"])
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
    assert (config.norms, config.qk_norm, config.qk_norm_across_heads) == ("post", True, True)
    llama = ModelConfig.from_dict(saved(tmp_path, transformers.LlamaConfig(**TINY)))
    assert (llama.norms, llama.qk_norm, llama.qk_norm_across_heads) == ("pre", False, False)
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
    for rope, match in [({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
                         r"rope_scaling type 'yarn' is not supported"),
                        (longrope(8, original_max_position_embeddings=256, mscale=1.2),
                         r"rope_parameters.mscale \(not read for rope_type 'longrope'\)")]:
        d = saved(tmp_path, transformers.LlamaConfig(**TINY))
        d["rope_parameters"] = rope | {"rope_theta": 10000.0}
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_dict(d)
    d = saved(tmp_path, transformers.LlamaConfig(**TINY), partial_rotary_factor=0.5)  # Llama rotates whole heads
    with pytest.raises(ValueError, match=r"partial_rotary_factor \(not a setting of llama models"):
        ModelConfig.from_dict(d)
