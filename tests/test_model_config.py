"""A config is honoured or refused, never partly ignored: every key that would change what the model computes and
that the engine does not compute is named at load, before any weight is read."""

from __future__ import annotations

import json

import pytest
import transformers

from pagedserve import LLM
from pagedserve.workers.models.model_config import ModelConfig

TINY = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)


def saved(tmp_path, config: transformers.PretrainedConfig, **extra) -> dict:
    """The config.json transformers writes for `config`, with `extra` keys set in it."""
    config.save_pretrained(tmp_path)
    d = json.loads((tmp_path / "config.json").read_text()) | extra
    (tmp_path / "config.json").write_text(json.dumps(d))
    return d


@pytest.mark.parametrize("config", [transformers.LlamaConfig(**TINY), transformers.MistralConfig(**TINY),
                                    transformers.Qwen2Config(**TINY), transformers.Qwen3Config(**TINY)],
                         ids=lambda c: c.model_type)
def test_the_configs_transformers_writes_for_the_served_families_load(tmp_path, config):
    if config.model_type == "mistral":
        config.sliding_window = None  # Mistral's default is a window of 4096 tokens, refused below
    d = saved(tmp_path, config)
    assert ModelConfig.from_dict(d).model_type == config.model_type


def test_a_mistral_window_is_refused_by_name_at_load(tmp_path):
    saved(tmp_path, transformers.MistralConfig(**TINY, sliding_window=16))
    with pytest.raises(ValueError, match=r"sliding_window=16 \(sliding-window attention is not supported\)"):
        LLM(f"random:{tmp_path / 'config.json'}", device="cpu")


def test_qwen2_with_use_sliding_window_is_refused_by_name(tmp_path):
    d = saved(tmp_path, transformers.Qwen2Config(**TINY, use_sliding_window=True, sliding_window=8,
                                                 max_window_layers=1))
    with pytest.raises(ValueError) as refused:
        ModelConfig.from_dict(d)
    message = str(refused.value)
    assert "use_sliding_window=true" in message and "sliding_window=8" in message
    assert "layer_types (layers of 'sliding_attention' are not supported" in message


def test_every_unknown_or_unhonoured_key_is_named(tmp_path):
    d = saved(tmp_path, transformers.LlamaConfig(**TINY), attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
              num_experts=8, quantization_config={"quant_method": "awq"}, layer_types=["full_attention",
                                                                                      "sliding_attention"])
    with pytest.raises(ValueError) as refused:
        ModelConfig.from_dict(d)
    message = str(refused.value)
    for key in ("attn_logit_softcapping", "final_logit_softcapping", "num_experts", "quantization_config",
                "layer_types"):
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
