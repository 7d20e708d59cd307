"""A transformers checkpoint written as a GGUF file in llama.cpp's layout (`convert_hf_to_gguf.py`): its metadata keys,
tensor names (gguf-py's tensor map, as llama.cpp's converter uses it), q/k rows permuted for its LlamaModel
subclasses, Gemma's norms stored as 1 + w. The tests write such a file from a tiny random checkpoint and check the
converter against it; `tests/test_gguf_families.py` says how this layout was checked against llama.cpp's own."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

# transformers model_type -> llama.cpp's GGUF architecture
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
             "granite": "granite", "smollm3": "smollm3", "gemma2": "gemma2", "gemma3_text": "gemma3", "olmo2": "olmo2",
             "mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
_PERMUTED = {"llama", "granite", "smollm3"}  # llama.cpp's LlamaModel and its subclasses
_NORM_PLUS_ONE = {"gemma2", "gemma3"}

# (GGUF name, HF layout's fp32 values) -> (the file's rows, their type) or None for F32
Quantizer = Callable[[str, np.ndarray], tuple[np.ndarray, Q] | None]


def q8_0(name: str, values: np.ndarray) -> tuple[np.ndarray, Q] | None:
    """llama.cpp's `--outtype q8_0`, near enough: 2-D tensors (and stacked experts) in Q8_0, vectors in F32; the
    routers in F32, as llama.cpp's converter keeps them."""
    if values.ndim in (2, 3) and values.shape[-1] % 32 == 0 and ".ffn_gate_inp" not in name:
        return gguf.quants.quantize(values, Q.Q8_0), Q.Q8_0
    return None


def q8_0_and_q6_k(seed: int) -> Quantizer:
    """Q8_0, but v, o and down in Q6_K (as llama-quantize's _M mixes give some layers): random blocks, which gguf
    cannot quantize to, each one llama.cpp could write, with weights of about 0.02."""
    rng = np.random.default_rng(seed)

    def quantize(name: str, values: np.ndarray) -> tuple[np.ndarray, Q] | None:
        if name.split(".")[-2] in ("attn_v", "attn_output", "ffn_down", "ffn_down_exps", "ffn_down_shexp") and (
                values.shape[-1] % 256 == 0):
            blocks = rng.integers(0, 256, size=(*values.shape[:-1], values.shape[-1] // 256, 210), dtype=np.uint8)
            d = np.abs(rng.standard_normal(blocks.shape[:-1] + (1,))) * 2e-5
            blocks[..., 208:210] = d.astype(np.float16).view(np.uint8)
            return blocks.reshape(*values.shape[:-1], -1), Q.Q6_K
        return q8_0(name, values)

    return quantize


def _permute(w: torch.Tensor, n_head: int, n_head_kv: int | None) -> torch.Tensor:
    """llama.cpp's `LlamaModel.permute`."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_metadata(writer: gguf.GGUFWriter, arch: str, hp: dict) -> None:
    """The keys llama.cpp's converter writes for `arch` from the checkpoint's config.json `hp`."""
    rope = hp.get("rope_parameters") or {}
    rope_full = rope.get("full_attention", rope)
    n_head = hp["num_attention_heads"]
    if arch == "granite":  # llama.cpp ignores Granite's head_dim
        hp = {k: v for k, v in hp.items() if k != "head_dim"}
    if arch == "phi3":
        writer.add_context_length(hp["max_position_embeddings"])
        writer.add_rope_scaling_orig_ctx_len(hp["original_max_position_embeddings"])
        writer.add_embedding_length(hp["hidden_size"])
        writer.add_feed_forward_length(hp["intermediate_size"])
        writer.add_block_count(hp["num_hidden_layers"])
        writer.add_head_count(n_head)
        writer.add_head_count_kv(hp["num_key_value_heads"])
        writer.add_layer_norm_rms_eps(hp["rms_norm_eps"])
        writer.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * hp["hidden_size"]) // n_head)
        writer.add_rope_freq_base(rope["rope_theta"])
        writer.add_sliding_window(hp.get("sliding_window") or 0)
        return
    if arch == "gemma2":
        writer.add_context_length(hp["max_position_embeddings"])
        writer.add_embedding_length(hp["hidden_size"])
        writer.add_block_count(hp["num_hidden_layers"])
        writer.add_feed_forward_length(hp["intermediate_size"])
        writer.add_head_count(n_head)
        writer.add_head_count_kv(hp["num_key_value_heads"])
        writer.add_layer_norm_rms_eps(hp["rms_norm_eps"])
        writer.add_key_length(hp["head_dim"])
        writer.add_value_length(hp["head_dim"])
        writer.add_attn_logit_softcapping(hp["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(hp["final_logit_softcapping"])
        writer.add_sliding_window(hp["sliding_window"])
        return
    # TextModel.set_gguf_parameters
    writer.add_block_count(hp["num_hidden_layers"])
    writer.add_context_length(hp["max_position_embeddings"])
    writer.add_embedding_length(hp["hidden_size"])
    writer.add_feed_forward_length(hp["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(hp["num_key_value_heads"])
    writer.add_rope_freq_base(rope_full["rope_theta"])
    if (local := rope.get("sliding_attention", {}).get("rope_theta")) is not None:
        writer.add_rope_freq_base_swa(local)
    writer.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if hp.get("head_dim") is not None:
        writer.add_key_length(hp["head_dim"])
        writer.add_value_length(hp["head_dim"])
    if arch in _PERMUTED:  # LlamaModel.set_gguf_parameters
        writer.add_vocab_size(hp["vocab_size"])
        writer.add_rope_dimension_count(hp.get("head_dim") or hp["hidden_size"] // n_head)
    if arch == "granite":
        for key, add in (("attention_multiplier", writer.add_attention_scale),
                         ("embedding_multiplier", writer.add_embedding_scale),
                         ("residual_multiplier", writer.add_residual_scale),
                         ("logits_scaling", writer.add_logit_scale)):
            if hp.get(key):
                add(hp[key])
    experts = hp.get("num_local_experts", hp.get("num_experts"))
    if experts:  # TextModel.set_gguf_parameters, then Qwen2MoeModel's
        writer.add_expert_count(experts)
        writer.add_expert_used_count(hp["num_experts_per_tok"])
    if arch in ("qwen2moe", "qwen3moe"):
        writer.add_expert_feed_forward_length(hp["moe_intermediate_size"])
        if hp.get("shared_expert_intermediate_size") is not None:
            writer.add_expert_shared_feed_forward_length(hp["shared_expert_intermediate_size"])
    if arch == "gemma3":
        if hp.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(hp["final_logit_softcapping"])
        if hp.get("sliding_window_pattern") != 1:
            writer.add_sliding_window(hp["sliding_window"])


def write_tokenizer(writer: gguf.GGUFWriter, hp: dict) -> None:
    """A byte-level BPE vocabulary of vocab_size tokens: the 256 bytes, one merge, and placeholders."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values()) + ["\u0120t"]
    tokens += [f"<t{i}>" for i in range(hp["vocab_size"] - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    writer.add_token_merges(["\u0120 t"])
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                     ("pad_token_id", writer.add_pad_token_id)):
        if isinstance(hp.get(key), int):
            add(hp[key])


def gguf_tensors(model_dir: Path, arch: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under llama.cpp's names and in its layout, fp32."""
    from safetensors.torch import load_file

    hp = json.loads((model_dir / "config.json").read_text())
    n_head, n_kv = hp["num_attention_heads"], hp["num_key_value_heads"]
    name_map = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                        hp["num_hidden_layers"])
    out = {}
    for name, w in load_file(str(model_dir / "model.safetensors")).items():
        if arch == "gemma2" and name == "lm_head.weight":  # llama.cpp drops it
            continue
        w = w.float()
        if name.endswith("mlp.experts.gate_up_proj"):  # stacked [E, 2I, H]: Qwen2MoeModel splits gate and up
            base = name.removesuffix("gate_up_proj")
            for part, half in zip(("gate_proj", "up_proj"), w.chunk(2, dim=1), strict=True):
                out[name_map.get_name(base + part + ".weight", try_suffixes=(".weight",))] = half.contiguous()
            continue
        if name.endswith("mlp.experts.down_proj"):  # stacked [E, H, I], named as a weight
            name += ".weight"
        if arch in _PERMUTED and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = _permute(w, n_head, n_head)
        elif arch in _PERMUTED and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = _permute(w, n_head, n_kv)
        if arch in _NORM_PLUS_ONE and name.endswith("norm.weight"):
            w = w + 1
        out[name_map.get_name(name, try_suffixes=(".weight", ".bias"))] = w
    return out


def export(model_dir: Path, path: Path, quantize: Quantizer = q8_0) -> dict[str, torch.Tensor]:
    """Write the checkpoint at `model_dir` as a GGUF file at `path`; return the transformers state dict whose
    weights the file holds: each tensor of the checkpoint as its type rounds it (fp32)."""
    hp = json.loads((model_dir / "config.json").read_text())
    arch = GGUF_ARCH[hp["model_type"]]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"Tiny {hp['model_type']}")
    write_metadata(writer, arch, hp)
    write_tokenizer(writer, hp)
    stored = gguf_tensors(model_dir, arch)
    for name, values in stored.items():
        kept = quantize(name, values.numpy())
        if kept is None:
            writer.add_tensor(name, values.numpy())
        else:
            writer.add_tensor(name, kept[0], raw_dtype=kept[1])
            stored[name] = torch.from_numpy(gguf.quants.dequantize(kept[0], kept[1]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return _undone(stored, model_dir, arch)


def _undone(stored: dict[str, torch.Tensor], model_dir: Path, arch: str) -> dict[str, torch.Tensor]:
    """The file's values back in transformers' names and layout."""
    from safetensors.torch import load_file

    hp = json.loads((model_dir / "config.json").read_text())
    n_head, n_kv = hp["num_attention_heads"], hp["num_key_value_heads"]
    name_map = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                        hp["num_hidden_layers"])
    state = {}
    for name in load_file(str(model_dir / "model.safetensors")):
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name.removesuffix("gate_up_proj")
            state[name] = torch.cat([stored[name_map.get_name(base + part + ".weight", try_suffixes=(".weight",))]
                                     for part in ("gate_proj", "up_proj")], dim=1).contiguous()
            continue
        stacked = ".weight" if name.endswith("mlp.experts.down_proj") else ""
        gguf_name = name_map.get_name(name + stacked, try_suffixes=(".weight", ".bias"))
        if gguf_name not in stored:
            continue
        w = stored[gguf_name]
        for part, heads in (("q_proj", n_head), ("k_proj", n_kv)):
            if arch in _PERMUTED and f".{part}." in name:  # the permutation's inverse: the same reshape, swapped back
                w = w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        if arch in _NORM_PLUS_ONE and name.endswith("norm.weight"):
            w = w - 1
        state[name] = w.contiguous()
    return state
