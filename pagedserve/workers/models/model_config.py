"""The model facts the runner needs, read from a Hugging Face `config.json` dict."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED = {
    # model_type: (q/k/v bias default, o bias default, q/k RMSNorm)
    "llama": (None, None, False),
    "mistral": (False, False, False),
    "qwen2": (True, False, False),
    "qwen3": (None, None, True),
}


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
    qk_norm: bool
    hidden_act: str
    initializer_range: float
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str | None

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        with open(path) as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        model_type = d.get("model_type")
        if model_type not in SUPPORTED:
            raise ValueError(f"model_type={model_type!r} is not supported (supported: {sorted(SUPPORTED)})")
        qkv_default, o_default, qk_norm = SUPPORTED[model_type]
        attention_bias = bool(d.get("attention_bias", False))
        num_heads = d["num_attention_heads"]
        hidden = d["hidden_size"]
        # transformers 5 keeps rope settings only in `rope_parameters`; older configs at top level.
        rope = dict(d.get("rope_parameters") or {})
        rope_theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
        scaling = d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            scaling = dict(scaling)
            scaling.setdefault("rope_type", scaling.get("type", "default"))
            if scaling["rope_type"] == "default":
                scaling = None
        if scaling is not None and scaling["rope_type"] not in ("linear", "dynamic", "llama3"):
            raise ValueError(f"rope_scaling type {scaling['rope_type']!r} is not supported "
                             "(supported: linear, dynamic, llama3)")
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        hidden_act = d.get("hidden_act", d.get("hidden_activation", "silu"))
        if hidden_act != "silu":
            raise ValueError(f"hidden_act={hidden_act!r} is not supported (only silu)")
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=hidden,
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=d.get("head_dim") or hidden // num_heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias if qkv_default is None else qkv_default,
            o_bias=attention_bias if o_default is None else o_default,
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=qk_norm,
            hidden_act=hidden_act,
            initializer_range=d.get("initializer_range", 0.02),
            eos_token_ids=eos_ids,
            bos_token_id=d.get("bos_token_id"),
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
        )
