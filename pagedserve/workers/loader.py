"""Find a model's files and build its `CausalLM`: a Hugging Face checkpoint directory, a GGUF file
(converted once to a cached directory), or random weights from a config file."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedserve.workers.models.config import ModelConfig
from pagedserve.workers.models.llama import CausalLM
from pagedserve.workers.models.rope import RotaryEmbedding

RANDOM_PREFIX = "random:"


@dataclass
class ModelSource:
    """Where a model's config, weights and tokenizer come from."""

    name: str  # what the user asked for, for messages and ModelInfo
    config_path: Path
    weights_dir: Path | None  # None: random weights
    tokenizer_dir: Path | None  # None: token ids in and out only

    @property
    def is_random(self) -> bool:
        return self.weights_dir is None


def resolve_model(model: str | None) -> ModelSource:
    """None: the embedded SmolLM2; "random:<config.json>"; a .gguf file; or an HF checkpoint dir."""
    if model is None:
        from pagedserve.workers.gguf import cached_gguf_dir, embedded_model_gguf

        d = cached_gguf_dir(embedded_model_gguf())
        return ModelSource("SmolLM2-135M-Instruct", d / "config.json", d, d)
    if model.startswith(RANDOM_PREFIX):
        config_path = Path(model[len(RANDOM_PREFIX):]).expanduser()
        if not config_path.is_file():
            raise FileNotFoundError(f"model={model!r}: no config file at {config_path}")
        tok_dir = config_path.parent if _has_tokenizer(config_path.parent) else None
        return ModelSource(model, config_path, None, tok_dir)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        from pagedserve.workers.gguf import cached_gguf_dir

        d = cached_gguf_dir(path)
        return ModelSource(path.name, d / "config.json", d, d)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model={model!r}: directory has no config.json")
        if not list(path.glob("*.safetensors")):
            raise FileNotFoundError(f"model={model!r}: directory has no *.safetensors weights")
        return ModelSource(path.name, path / "config.json", path, path if _has_tokenizer(path) else None)
    raise FileNotFoundError(
        f"model={model!r}: not a checkpoint directory, a .gguf file or 'random:<config.json>' "
        "(pagedserve never downloads from a model hub)")


def _has_tokenizer(d: Path) -> bool:
    return (d / "tokenizer.json").is_file() or (d / "tokenizer_config.json").is_file()


# HF name -> (our fused parameter, which part of it). Parts are in concatenation order.
_FUSED = [
    (re.compile(r"(.*\.self_attn)\.(q|k|v)_proj\.(weight|bias)$"), "qkv_proj", ("q", "k", "v")),
    (re.compile(r"(.*\.mlp)\.(gate|up)_proj\.(weight|bias)$"), "gate_up_proj", ("gate", "up")),
]


def build_model(source: ModelSource, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                max_positions: int, seed: int = 0) -> CausalLM:
    """The model with its weights, on `device` in `dtype`, in eval mode."""
    with torch.device("meta"):
        model = CausalLM(config, max_positions)
    model = model.to_empty(device=device).to(dtype)
    # RoPE tables are computed, not loaded: build them for real (meta tensors hold no values).
    model.model.rope = RotaryEmbedding(config, max_positions).to(device)
    if source.is_random:
        _init_random(model, config, seed)
    else:
        _load_safetensors(model, source.weights_dir)
    return model.eval().requires_grad_(False)


def _init_random(model: CausalLM, config: ModelConfig, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        else:  # weights and biases alike, so bias code paths see non-zero values
            p.data.copy_(torch.randn(p.shape, generator=gen) * config.initializer_range)


def _load_safetensors(model: CausalLM, weights_dir: Path) -> None:
    from safetensors import safe_open
    from tqdm import tqdm

    config = model.config
    params = dict(model.named_parameters())
    filled: dict[str, int] = {name: 0 for name in params}  # elements written per parameter
    files = sorted(weights_dir.glob("*.safetensors"))
    names = []
    for f in files:
        with safe_open(f, framework="pt") as st:
            names.extend((f, k) for k in st.keys())
    sizes = {
        "q": config.num_heads * config.head_dim,
        "k": config.num_kv_heads * config.head_dim,
        "v": config.num_kv_heads * config.head_dim,
        "gate": config.intermediate_size,
        "up": config.intermediate_size,
    }
    handles = {f: safe_open(f, framework="pt") for f in files}
    for f, key in tqdm(names, desc=f"Loading {weights_dir.name}", unit="tensor", leave=False):
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if "rotary_emb" in key:
            continue
        tensor = handles[f].get_tensor(key)
        target, offset = key, 0
        for pattern, fused, parts in _FUSED:
            m = pattern.match(key)
            if m:
                target = f"{m.group(1)}.{fused}.{m.group(3)}"
                offset = sum(sizes[p] for p in parts[: parts.index(m.group(2))])
                break
        param = params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {key!r} has no place in the {config.model_type} model")
        part = param.data[offset: offset + tensor.shape[0]]
        if part.shape != tensor.shape:
            raise ValueError(f"checkpoint tensor {key!r} has shape {tuple(tensor.shape)}, "
                             f"the model expects {tuple(part.shape)}")
        part.copy_(tensor)
        filled[target] += tensor.numel()
    missing = [n for n, p in params.items() if filled[n] != p.numel()]
    if missing:
        raise ValueError(f"checkpoint in {weights_dir} lacks weights for: {', '.join(missing[:8])}"
                         + (" ..." if len(missing) > 8 else ""))
