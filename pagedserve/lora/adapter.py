"""A LoRA adapter in PEFT's format, read and checked against the model it adapts.

PEFT saves `adapter_config.json` and `adapter_model.safetensors`, whose tensors are each adapted projection's
`lora_A` [r, in] and `lora_B` [out, r]: the projection computes `x W^T + (x A^T) B^T * scaling`, scaling
`lora_alpha / r` (or `lora_alpha / sqrt(r)` with `use_rslora`). The projections adapted here are the decoder's
q/k/v/o and gate/up/down; a setting or a tensor that would compute anything else is refused by name, so that an
adapter either runs as PEFT runs it or not at all."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
# The projections an adapter may target, by their module names in transformers' decoders
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# PEFT settings that change what an adapted layer computes, with the value that computes plain LoRA
_PLAIN = {"bias": "none", "use_dora": False, "fan_in_fan_out": False, "lora_bias": False, "modules_to_save": None,
          "rank_pattern": {}, "alpha_pattern": {}, "target_parameters": None, "layer_replication": None,
          "trainable_token_indices": None, "use_qalora": False, "use_bdlora": None, "megatron_config": None}
_UNSET = (None, {}, [], False)
_WHY = {"target_parameters": ": adapters of parameters, such as a mixture of experts' stacked experts, are not run"}


@dataclass(frozen=True)
class ProjectionShape:
    """An adaptable projection's (in, out) features in the whole model (not a tensor-parallel rank's)."""

    in_features: int
    out_features: int


@dataclass(frozen=True)
class AdapterSpec:
    """An adapter checked against the model: where it is, and the scaling its B is loaded with."""

    path: Path
    scaling: float

    def load(self, dtype: torch.dtype) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
        """Each adapted (layer, projection)'s A [r, in] and B [out, r] * scaling, in `dtype`, on the CPU."""
        from safetensors.torch import load_file

        tensors = load_file(str(self.path / WEIGHTS_NAME))
        weights = {}
        for key, tensor in tensors.items():
            layer, _, name, which = _KEY.match(key).groups()
            weights.setdefault((int(layer), name), {})[which] = tensor
        return {module: (pair["A"].to(dtype), (pair["B"].double() * self.scaling).to(dtype))
                for module, pair in weights.items()}


def read_adapter(path: str | Path, shapes: dict[str, ProjectionShape], num_layers: int,
                 moe_layers: tuple[bool, ...], max_rank: int) -> AdapterSpec:
    """Check an adapter directory against the model: ValueError naming what is wrong (a missing file, a setting
    that is not plain LoRA, a target that is not one of `TARGETS`, a shape the model's projection does not have, a
    rank over `max_rank`, an MLP target on a mixture-of-experts layer)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"lora adapter {str(path)!r} is not a directory")
    config = _read_config(path)
    rank, alpha = config.get("r"), config.get("lora_alpha", 8)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"lora adapter {path}: {CONFIG_NAME} r={rank!r} must be an integer >= 1")
    if rank > max_rank:
        raise ValueError(f"lora adapter {path}: rank r={rank} is over max_lora_rank={max_rank}")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise ValueError(f"lora adapter {path}: {CONFIG_NAME} lora_alpha={alpha!r} must be a number")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    _check_targets(path, config.get("target_modules"))
    weights = path / WEIGHTS_NAME
    if not weights.is_file():
        found = "adapter_model.bin (a pickle, which is not loaded)" if (path / "adapter_model.bin").exists() else None
        raise ValueError(f"lora adapter {path}: no {WEIGHTS_NAME}" + (f"; found {found}" if found else ""))
    try:
        with safe_open(str(weights), "pt") as f:
            found_shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except (SafetensorError, OSError) as e:
        raise ValueError(f"lora adapter {path}: {WEIGHTS_NAME} cannot be read ({e})") from None
    pairs: dict[tuple[int, str], dict[str, tuple[int, ...]]] = {}
    for key, shape in found_shapes.items():
        module = _module_of(path, key, num_layers, moe_layers)
        pairs.setdefault(module, {})[_KEY.match(key).group(4)] = shape
    if not pairs:
        raise ValueError(f"lora adapter {path}: {WEIGHTS_NAME} holds no LoRA weights")
    for (layer, name), pair in sorted(pairs.items()):
        _check_pair(path, layer, name, pair, rank, shapes[name])
    return AdapterSpec(path, scaling)


def _read_config(path: Path) -> dict:
    try:
        config = json.loads((path / CONFIG_NAME).read_text())
    except FileNotFoundError:
        raise ValueError(f"lora adapter {path}: no {CONFIG_NAME}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"lora adapter {path}: {CONFIG_NAME} is not JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"lora adapter {path}: {CONFIG_NAME} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"lora adapter {path}: peft_type={config['peft_type']!r} is not LORA")
    for key, plain in _PLAIN.items():
        value = config.get(key, plain)
        if value != plain and not (plain in _UNSET and value in _UNSET):
            raise ValueError(f"lora adapter {path}: {CONFIG_NAME} {key}={value!r} is not supported (only {plain!r})"
                             + _WHY.get(key, ""))
    return config


def _check_targets(path: Path, targets: object) -> None:
    """`target_modules` as a list: names outside `TARGETS` refused (a regex string: the tensors say what it hit)."""
    if isinstance(targets, list):
        other = sorted({t for t in targets if t.rsplit(".", 1)[-1] not in TARGETS})
        if other:
            raise ValueError(f"lora adapter {path}: target_modules {other} are not supported (only {list(TARGETS)})")


def _module_of(path: Path, key: str, num_layers: int, moe_layers: tuple[bool, ...]) -> tuple[int, str]:
    match = _KEY.match(key)
    if match is None:
        raise ValueError(f"lora adapter {path}: tensor {key!r} is not a LoRA weight of a projection pagedserve "
                         f"adapts (only {list(TARGETS)} of the decoder layers)")
    layer, block, name = int(match.group(1)), match.group(2), match.group(3)
    wanted = ATTENTION_TARGETS if block == "self_attn" else MLP_TARGETS
    if name not in wanted:
        raise ValueError(f"lora adapter {path}: tensor {key!r} targets {block}.{name}, which pagedserve does not "
                         f"adapt (only {list(TARGETS)})")
    if layer >= num_layers:
        raise ValueError(f"lora adapter {path}: tensor {key!r} is for layer {layer}; the model has {num_layers}")
    if block == "mlp" and moe_layers[layer]:
        raise ValueError(f"lora adapter {path}: tensor {key!r} targets the MLP of layer {layer}, a mixture of "
                         "experts: adapters of experts are not supported")
    return layer, name


def _check_pair(path: Path, layer: int, name: str, pair: dict[str, tuple[int, ...]], rank: int,
                shape: ProjectionShape) -> None:
    where = f"lora adapter {path}: layer {layer} {name}"
    if set(pair) != {"A", "B"}:
        raise ValueError(f"{where} has lora_{next(iter(pair))} without lora_{'B' if 'A' in pair else 'A'}")
    want = {"A": (rank, shape.in_features), "B": (shape.out_features, rank)}
    for which in ("A", "B"):
        if pair[which] != want[which]:
            raise ValueError(f"{where}: lora_{which} has shape {list(pair[which])}, the model needs "
                             f"{list(want[which])} (r={rank})")
