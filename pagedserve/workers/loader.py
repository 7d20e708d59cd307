"""Find a model's files and build its `CausalLM`: a Hugging Face checkpoint directory, a GGUF file
(converted once to a cached directory), or random weights from a config file."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedserve.workers import gpt_oss_weights
from pagedserve.workers.gguf import GGUF_BLOCKS_NAME
from pagedserve.workers.models.llama import CausalLM
from pagedserve.workers.models.model_config import ModelConfig
from pagedserve.workers.models.parallel import TPLayout, shard_range

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


# A checkpoint that stores them fused (Phi-3's): read as its parts, which the loader then places as any other.
_FUSED_IN_CHECKPOINT = re.compile(r"(.*)\.(self_attn\.qkv_proj|mlp\.gate_up_proj)\.(weight|bias)$")
# Experts stacked and gate|up fused as transformers 5 writes them ([E, 2I, H]): read as stacked gate and up parts.
_FUSED_EXPERTS = re.compile(r"(.*\.mlp\.experts)\.gate_up_proj$")
# Mixtral's original names: block_sparse_moe for mlp; each expert's w1 (gate), w3 (up), w2 (down).
_MIXTRAL_NAMES = re.compile(r"(.*)\.block_sparse_moe\.(gate|experts\.\d+\.(w1|w2|w3))\.weight$")
_MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _unfused(tensors: Iterator[tuple[str, tuple[int, ...], Reader]],
             config: ModelConfig) -> Iterator[tuple[str, tuple[int, ...], Reader]]:
    """The tensors, a fused q/k/v or gate/up one given as its parts (`q_proj`, `k_proj`, `v_proj`; `gate_proj`,
    `up_proj`): each part reads its own rows of the fused tensor, so a rank reads only its shard of each."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    if config.model_type == "gpt_oss":  # its experts' own layout (transposed, interleaved; MXFP4)
        tensors = gpt_oss_weights.expert_tensors(tensors)
    for name, shape, read in tensors:
        if m := _MIXTRAL_NAMES.match(name):
            part = m.group(2) if m.group(3) is None else m.group(2)[:-2] + _MIXTRAL_EXPERT[m.group(3)]
            name = f"{m.group(1)}.mlp.{part}.weight"
        if m := _FUSED_EXPERTS.match(name):
            half = shape[1] // 2
            for i, part in enumerate(("gate_proj", "up_proj")):
                yield (f"{m.group(1)}.{part}", (shape[0], half, shape[2]),
                       functools.partial(_read_part_of, read, i * half, 1))
            continue
        m = _FUSED_IN_CHECKPOINT.match(name)
        if m is None:
            yield name, shape, read
            continue
        prefix, fused, kind = m.groups()
        module, sizes = (("self_attn", {"q": q, "k": kv, "v": kv}) if fused.startswith("self_attn")
                         else ("mlp", {"gate": inter, "up": inter}))
        if shape[0] != sum(sizes.values()):
            raise ValueError(f"checkpoint tensor {name!r} has {shape[0]} rows, the config implies "
                             f"{sum(sizes.values())}")
        first = 0
        for part, rows in sizes.items():
            yield (f"{prefix}.{module}.{part}_proj.{kind}", (rows, *shape[1:]),
                   functools.partial(_read_rows_from, read, first))
            first += rows


def _read_part_of(read: Reader, first: int, part_dim: int, dim: int, start: int, stop: int) -> torch.Tensor:
    """A part's slice along `dim`, read from the fused tensor whose entries along `part_dim` from `first` on are
    the part's."""
    if dim != part_dim:
        raise ValueError("stacked experts' fused gate|up tensor is split along its intermediate dimension only")
    return read(dim, first + start, first + stop)


def _read_rows_from(read: Reader, first: int, dim: int, start: int, stop: int) -> torch.Tensor:
    """A part's slice, read from the fused tensor whose rows from `first` on are the part's."""
    if dim != 0:
        raise ValueError("a fused checkpoint tensor is split by rows only")
    return read(0, first + start, first + stop)


# HF name -> (our fused parameter, which part of it). Parts are in concatenation order. A MoE block's experts are
# stacked: one expert's tensor (`experts.<e>.gate_proj.weight`) fills its slab of `experts.gate_up_proj`; the
# stacked parts (`experts.gate_proj`) fill theirs of every slab at once.
_FUSED = [
    (re.compile(r"(.*\.self_attn)\.(q|k|v)_proj\.(weight|bias)$"), "qkv_proj", ("q", "k", "v")),
    (re.compile(r"(.*\.(?:mlp|shared_expert))\.(gate|up)_proj\.(weight|bias)$"), "gate_up_proj", ("gate", "up")),
    (re.compile(r"(.*\.experts)\.\d+\.(gate|up)_proj\.(weight)$"), "gate_up_proj", ("gate", "up")),
    (re.compile(r"(.*\.experts)\.(gate|up)_proj()$"), "gate_up_proj", ("gate", "up")),
    (re.compile(r"(.*\.experts)\.(gate|up)_proj_bias()$"), "gate_up_proj_bias", ("gate", "up")),
]
_ONE_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def build_model(source: ModelSource, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                max_positions: int, seed: int = 0, tp: TPLayout | None = None,
                held_by: Callable[[CausalLM], set[str]] | None = None) -> CausalLM:
    """The model (this rank's shard of it) with its weights, on `device` in `dtype`, in eval mode. `held_by`
    runs on the model before its parameters are made: it swaps in modules that hold their own weights (a GGUF's
    blocks) and returns the checkpoint tensors they hold, which are then never read."""
    tp = tp or TPLayout.make(config)
    with torch.device("meta"):
        model = CausalLM(config, max_positions, tp, ropes=False)
    held = held_by(model) if held_by is not None else set()
    # Storage for every parameter and buffer, floating ones in `dtype` at once (not made in fp32, then converted: a
    # second copy of the weights); as `to_empty` makes it but without its meta-tensor path (torch's Python refs, whose
    # import of sympy was most of a worker process's model build)
    model = model._apply(lambda t: torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype,
                                               device=device))
    # RoPE tables are computed, not loaded: built now, on the device (the meta model was made without them).
    model.model.build_ropes(config, max_positions, device)
    if source.is_random:
        _load(model, _random_tensors(config, seed), "random weights", held)
    else:
        _load(model, _text_model(_safetensors(source.weights_dir)), source.weights_dir.name, held)
    return model.eval().requires_grad_(False)


# A tensor source yields (HF name, full shape, read(dim, start, stop) -> that slice of the tensor).
Reader = Callable[[int, int, int], torch.Tensor]


def _safetensors(weights_dir: Path) -> Iterator[tuple[str, tuple[int, ...], Reader]]:
    from safetensors import safe_open

    for f in sorted(weights_dir.glob("*.safetensors")):
        if f.name == GGUF_BLOCKS_NAME:  # the same weights again, as GGUF blocks (kernels/cpu/quant_linear.py)
            continue
        with safe_open(f, framework="pt") as st:
            for key in st.keys():
                sl = st.get_slice(key)
                yield key, tuple(sl.get_shape()), functools.partial(_read_slice, sl)  # reads only this slice


# A multimodal checkpoint's text model (Gemma 3's) under the names of a text-only one; its vision tower and
# projector are never read. Both layouts transformers has saved them in.
_TEXT_MODEL_NAMES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                     ("language_model.lm_head.", "lm_head."))
_NOT_TEXT = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def _text_model(tensors: Iterator[tuple[str, tuple[int, ...], Reader]]
                ) -> Iterator[tuple[str, tuple[int, ...], Reader]]:
    for name, shape, read in tensors:
        if name.startswith(_NOT_TEXT):
            continue
        for prefix, text_prefix in _TEXT_MODEL_NAMES:
            if name.startswith(prefix):
                name = text_prefix + name[len(prefix):]
                break
        yield name, shape, read


def _read_slice(sl, dim: int, start: int, stop: int) -> torch.Tensor:
    return sl[(slice(None),) * dim + (slice(start, stop),)]


# Each layer's RMSNorms, by where they sit (`Family.norms`)
_LAYER_NORMS = {
    "pre": ("input_layernorm", "post_attention_layernorm"),
    "post": ("post_attention_layernorm", "post_feedforward_layernorm"),
    "sandwich": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"),
}


def hf_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of a transformers checkpoint of this config."""
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_heads * d, config.num_kv_heads * d
    shapes = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes |= {p + norm + ".weight": (h,) for norm in _LAYER_NORMS[config.family.norms]}
        shapes |= {p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q)}
        shapes |= _moe_shapes(config, p + "mlp.") if config.moe_layers[i] else _mlp_shapes(p + "mlp.", h, inter)
        if config.qkv_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
        if config.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if config.mlp_bias:
            shapes |= {p + "mlp.gate_proj.bias": (inter,), p + "mlp.up_proj.bias": (inter,),
                       p + "mlp.down_proj.bias": (h,)}
        if config.family.attention_sinks:
            shapes[p + "self_attn.sinks"] = (config.num_heads,)
        if config.family.qk_norm:  # each head's, or (OLMo 2) all heads' at once
            q_norm, k_norm = ((q,), (kv,)) if config.family.qk_norm_across_heads else ((d,), (d,))
            shapes |= {p + "self_attn.q_norm.weight": q_norm, p + "self_attn.k_norm.weight": k_norm}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def _mlp_shapes(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "gate_proj.weight": (inter, hidden), prefix + "up_proj.weight": (inter, hidden),
            prefix + "down_proj.weight": (hidden, inter)}


def _moe_shapes(config: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """A sparse MoE block's tensors as transformers 5 writes them: the router, the experts stacked (gate|up
    fused), and Qwen2-MoE's shared expert and its gate."""
    h, e, inter = config.hidden_size, config.num_experts, config.moe_intermediate_size
    if config.model_type == "gpt_oss":  # `GptOssExperts`: transposed, biased; a biased router
        return {prefix + "router.weight": (e, h), prefix + "router.bias": (e,),
                prefix + "experts.gate_up_proj": (e, h, 2 * inter),
                prefix + "experts.gate_up_proj_bias": (e, 2 * inter),
                prefix + "experts.down_proj": (e, inter, h), prefix + "experts.down_proj_bias": (e, h)}
    shapes = {prefix + "gate.weight": (e, h), prefix + "experts.gate_up_proj": (e, 2 * inter, h),
              prefix + "experts.down_proj": (e, h, inter)}
    if config.shared_expert_intermediate_size:
        shapes |= _mlp_shapes(prefix + "shared_expert.", h, config.shared_expert_intermediate_size)
        shapes[prefix + "shared_expert_gate.weight"] = (1, h)
    return shapes


def _random_tensors(config: ModelConfig, seed: int) -> Iterator[tuple[str, tuple[int, ...], Reader]]:
    import xxhash

    for name, shape in hf_tensor_shapes(config).items():
        # Seeded by name, not by order: every rank and every tp size draws the same full tensor.
        gen = torch.Generator().manual_seed(xxhash.xxh64_intdigest(f"{seed}:{name}".encode()) & (2**63 - 1))
        if name.endswith("norm.weight"):  # the identity norm: weights of 1 (Gemma's: offsets of 0 from 1)
            full = torch.full(shape, 1.0 - config.family.norm_weight_offset)
        else:
            full = torch.randn(shape, generator=gen) * config.initializer_range
        yield name, shape, functools.partial(_narrow, full)


def _narrow(full: torch.Tensor, dim: int, start: int, stop: int) -> torch.Tensor:
    return full.narrow(dim, start, stop - start)


def _shapes_checked(tensors: Iterator[tuple[str, tuple[int, ...], Reader]], expected: dict[str, tuple[int, ...]]
                    ) -> Iterator[tuple[str, tuple[int, ...], Reader]]:
    """The checkpoint's tensors; ValueError at the first whose shape is not the one its name has in a transformers
    checkpoint of the config (before any is read in another layout)."""
    for name, shape, read in tensors:
        if name in expected and tuple(shape) != expected[name]:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(shape)}, "
                             f"the config implies {expected[name]}")
        yield name, shape, read


def _load(model: CausalLM, tensors: Iterator[tuple[str, tuple[int, ...], Reader]], label: str,
          held: set[str]) -> None:
    from tqdm import tqdm

    config, tp = model.config, model.tp
    params = dict(model.named_parameters())
    filled: dict[str, int] = {name: 0 for name in params}  # elements written per parameter
    local = {"q": tp.num_heads * config.head_dim, "k": tp.num_kv_heads * config.head_dim,
             "v": tp.num_kv_heads * config.head_dim, "gate": tp.intermediate_size, "up": tp.intermediate_size}
    expected = hf_tensor_shapes(config)
    for name, shape, read in tqdm(_unfused(_shapes_checked(tensors, expected), config), desc=f"Loading {label}",
                                  unit="tensor", leave=False, total=len(expected)):
        if "rotary_emb" in name or (name == "lm_head.weight" and config.tie_word_embeddings) or name in held:
            continue
        target, offset, expert = name, 0, None
        if m := _ONE_EXPERT.match(name):  # one expert's: its slab of the stacked parameter
            target, expert = f"{m.group(1)}.{m.group(3)}.weight", int(m.group(2))
        for pattern, fused, parts in _FUSED:
            if m := pattern.match(name):
                target = f"{m.group(1)}.{fused}" + (f".{m.group(3)}" if m.group(3) else "")
                offset = (tp.mlp_columns(name) * parts.index(m.group(2)) if fused.startswith("gate_up_proj")
                          else sum(local[p] for p in parts[: parts.index(m.group(2))]))
                break
        target = target.removesuffix(".weight") if ".experts." in target else target  # stacked: no suffix
        param = params.get(target)
        if param is None or (expert is not None and expert >= param.shape[0]):
            raise ValueError(f"checkpoint tensor {name!r} has no place in the {config.model_type} model")
        dim, start, length = shard_range(name, tp, config) or (0, 0, shape[0])
        stop = min(start + length, shape[dim])
        tensor = read(dim, start, stop)
        if name.endswith("norm.weight") and config.family.norm_weight_offset:
            # Gemma's norms multiply by (1 + weight), in fp32: added here once, so every norm kernel takes them
            tensor = tensor.float() + config.family.norm_weight_offset
        base = param.data if expert is None else param.data[expert]
        # where fused parts lie side by side: after the expert dim of stacked experts (and of their biases)
        parts_dim = 1 if expert is None and ".experts." in target else 0
        region = base.narrow(parts_dim, offset, length) if dim == parts_dim else base  # what this tensor fills
        dest = region.narrow(dim, 0, stop - start)
        if stop - start < length:  # the last vocabulary shard's padding rows
            region.narrow(dim, stop - start, length - (stop - start)).zero_()
        if dest.shape != tensor.shape:
            raise ValueError(f"checkpoint tensor {name!r}: slice {tuple(tensor.shape)} does not fit "
                             f"{target} {tuple(dest.shape)}")
        dest.copy_(tensor)
        filled[target] += region.numel()
    missing = [n for n, p in params.items() if filled[n] != p.numel()]
    if missing:
        raise ValueError(f"{label} lacks weights for: {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else ""))
