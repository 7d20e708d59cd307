"""Linear layers on GGUF blocks: the kernel multiplies by exactly the weights gguf's dequantize forms (read back
through an identity matrix), as closely as an fp32 GEMM, and a GGUF checkpoint's model computes the same
tokens with them as with fp32 weights."""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from pagedserve import LLM, SamplingParams
from pagedserve.kernels.cpu import native, quant_linear
from pagedserve.kernels.cpu.quant_linear import (
    QuantLinear,
    dequantize,
    hold_embedding,
    load_fp32_linears,
    load_gguf_linears,
)
from pagedserve.workers.gguf import GGUF_BLOCKS_NAME
from pagedserve.workers.loader import build_model, hf_tensor_shapes, resolve_model
from pagedserve.workers.models.llama import CausalLM, linear_product
from pagedserve.workers.models.model_config import ModelConfig
from pagedserve.workers.models.parallel import TPLayout

pytestmark = pytest.mark.skipif(not quant_linear.available(torch.device("cpu"), torch.float32),
                                reason="the GGUF linear kernel needs a C compiler and AVX2/FMA/F16C")

# F32: any fp32 checkpoint's weights, through the same kernel; BF16, F16: a 16-bit checkpoint's
QTYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "F32",
          "BF16", "F16"]
K_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")
# Types gguf cannot quantize to: random blocks, each one llama.cpp could write
RANDOM_BLOCKS = (*K_TYPES, "IQ4_NL")


def _width(qtype: str, k: int) -> int:
    """`k` in_features, or for the K-types the multiple of their 256-value blocks nearest above it."""
    return -(-k // 256) * 256 if qtype in K_TYPES else k


# Where a block's fp16 fields lie: its d, or its d and dmin (the types with mins)
_D_AT = {"Q2_K": slice(80, 84), "Q3_K": slice(108, 110), "Q4_K": slice(0, 4), "Q5_K": slice(0, 4),
         "Q6_K": slice(208, 210), "IQ4_XS": slice(0, 2), "IQ4_NL": slice(0, 2)}


def _random_blocks(qtype: str, n: int, k: int, rng: np.random.Generator, scale: float = 0.001) -> np.ndarray:
    """Rows [n, k / values * bytes] of `qtype` (`_D_AT`): random quants, scales and mins under a random fp16 d (and
    dmin, not negative) of about `scale` (gguf cannot quantize to these types; every such block is one llama.cpp
    could write)."""
    values, size = quant_linear.BLOCKS[qtype]
    at = _D_AT[qtype]
    blocks = rng.integers(0, 256, size=(n, k // values, size), dtype=np.uint8)
    fields = rng.standard_normal((n, k // values, (at.stop - at.start) // 2)) * scale  # [n, blocks, d (and dmin)]
    fields[..., 1:] = np.abs(fields[..., 1:])
    blocks[..., at] = fields.astype(np.float16).view(np.uint8)
    return blocks.reshape(n, -1)


def _quantized(n: int, k: int, qtype: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF rows [n, k / 32 blocks] of a random matrix, and gguf's own fp32 dequantization of them (plain
    types: the matrix rounded to the type, and its values widened to fp32)."""
    rng = np.random.default_rng(seed)
    if qtype in RANDOM_BLOCKS:
        rows = _random_blocks(qtype, n, k, rng)
        return torch.from_numpy(rows), torch.from_numpy(gguf_dequantize(rows, GGMLQuantizationType[qtype]))
    w = rng.standard_normal((n, k)).astype(np.float32)
    if qtype in quant_linear.PLAIN_TYPES:
        narrow = torch.from_numpy(w).to(quant_linear.PLAIN_TYPES[qtype])
        return narrow.view(torch.uint8), narrow.float()
    rows = gguf_quantize(w, GGMLQuantizationType[qtype])
    return torch.from_numpy(rows), torch.from_numpy(gguf_dequantize(rows, GGMLQuantizationType[qtype]))


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("n", [16, 40, 100])  # whole panels of 16 rows, and a padded last panel
def test_weights_are_exactly_ggufs_dequantization(qtype, n):
    k = _width(qtype, 96)
    rows, w = _quantized(n, k, qtype, seed=n)
    layer = QuantLinear(rows, qtype, k, None)
    assert torch.equal(dequantize(layer), w)
    # Looked up by row (an embedding table held in panels): the same floats, in any order and shape of ids
    ids = torch.randint(0, n, (3, 7), generator=torch.Generator().manual_seed(n))
    assert torch.equal(layer.rows(ids), w[ids])
    assert layer.rows(ids[:0]).shape == (0, 7, k)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", "F32"])
def test_panels_repacked_in_chunks_are_those_repacked_at_once(qtype, monkeypatch):
    rows, _ = _quantized(100, _width(qtype, 64), qtype, seed=2)  # a last chunk of 4 rows: a padded panel
    monkeypatch.setattr(quant_linear, "_REPACK_ROWS", 32)
    assert torch.equal(QuantLinear(rows, qtype, _width(qtype, 64), None).panels, quant_linear.repack(rows, qtype))


# Bits a weight as held: the K-types' scales as bytes beside a fp16 header, the quants packed (Q6_K's, Q2_K's and Q5_1's
# the file's own size)
@pytest.mark.parametrize(("qtype", "bits"), [("Q4_K", 4.625), ("Q6_K", 6.5625), ("Q5_K", 5.625), ("Q3_K", 3.5625),
                                             ("Q2_K", 2.625), ("IQ4_XS", 4.3125), ("Q5_1", 6.0)])
def test_panels_hold_their_bits(qtype, bits):
    n, k = 32, 512
    layer = QuantLinear(_quantized(n, k, qtype, seed=4)[0], qtype, k, None)
    assert layer.panels.numel() * 8 / (n * k) == bits


# Rows that all dequantize as they go (no scratch), partial register tiles on the scratch, past one 48-row item
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("m", [1, 4, 5, 6, 7, 16, 50, 97])
def test_product_matches_fp32_matmul(qtype, m):
    n, k = 40, _width(qtype, 128)
    rows, w = _quantized(n, k, qtype, seed=m)
    gen = torch.Generator().manual_seed(m)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(m, k + 8, generator=gen)[:, :k]  # rows strided past their length
    layer = QuantLinear(rows, qtype, k, bias)
    exact = x.double() @ w.double().T
    torch.testing.assert_close(layer.product(x).double(), exact, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(linear_product(layer, x).double(), exact, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(layer(x).double(), exact + bias.double(), atol=1e-4, rtol=1e-5)
    assert layer(x.reshape(m, 1, k)).shape == (m, 1, n)  # leading dims kept
    assert layer(x[:0]).shape == (0, n)


@pytest.mark.parametrize("qtype", QTYPES)
def test_a_row_gets_the_same_bits_in_any_batch(qtype):
    """A row's output does not depend on the rows beside it: alone, among the first rows (which dequantize as
    they go) or in the register tiles that follow, past one 48-row work item. So a sequence decodes to the same
    tokens whatever else shares its steps."""
    k = _width(qtype, 128)
    rows, _ = _quantized(40, k, qtype, seed=1)
    layer = QuantLinear(rows, qtype, k, torch.randn(40))
    x = torch.randn(60, k, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([layer(x[i:i + 1]) for i in range(60)])
    for m in (2, 4, 5, 7, 60):
        assert torch.equal(torch.cat([layer(x[i:i + m]) for i in range(0, 60, m)]), alone), m


# Other builds of the kernel than this CPU's, each with the CPU features it must do without
OTHER_BUILDS = {"AVX2": (["-march=x86-64-v3"], "avx512f"),  # 8-wide tiles
                "AVX-512 without VBMI": (["-march=native", "-mno-avx512vbmi"], "avx512vbmi")}  # no multishift


@pytest.mark.parametrize("build", OTHER_BUILDS)
def test_every_build_gives_this_cpus_bits(build, tmp_path, monkeypatch):
    """Built for this CPU the kernel runs 16-wide tiles and, with VBMI, reads 4-bit quants by multishift; built for
    AVX2 alone, 8-wide tiles, and without VBMI, unpacks them by shifts and masks. Machines differ (CI's among
    them), and a sequence's tokens must not: every build gives the same bits, row for row."""
    march, lacks = OTHER_BUILDS[build]
    if lacks not in native._cpu_flags().split():
        pytest.skip(f"this CPU lacks {lacks}: its own build is the {build} one")
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    flags = [f for f in native.QUANT_LINEAR_FLAGS if not f.startswith("-march")] + march
    other = ctypes.CDLL(str(native._build(native.compiler(), native.CSRC / "quant_linear.c", flags)))
    other.quant_linear.argtypes = native.quant_linear_library().quant_linear.argtypes
    other.quant_linear.restype = ctypes.c_int
    other.quant_linear_rows.argtypes = native.quant_linear_library().quant_linear_rows.argtypes
    other.quant_linear_rows.restype = ctypes.c_int
    for qtype in QTYPES:
        k = _width(qtype, 128)
        rows, _ = _quantized(40, k, qtype, seed=3)
        layer = QuantLinear(rows, qtype, k, None)
        for m in (1, 3, 4, 5, 17, 60):  # dequantizing rows alone, then with register tiles after them
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            y = torch.empty(m, 40)
            code = quant_linear.KERNEL_TYPE[qtype]
            assert other.quant_linear(x.data_ptr(), m, k, k, layer.panels.data_ptr(), code, 40, None, y.data_ptr(),
                                     40, 2) == 0
            assert torch.equal(layer.product(x), y), (qtype, m)
        ids = torch.tensor([39, 0, 17, 17])
        rows = torch.empty(4, k)
        assert other.quant_linear_rows(layer.panels.data_ptr(), code, 40, k, ids.data_ptr(), 4, rows.data_ptr()) == 0
        assert torch.equal(layer.rows(ids), rows), qtype


def test_parts_of_different_types_give_each_parts_bits():
    """A fused layer whose parts are held in different types computes each part's columns as that part alone
    does, bit for bit, in every tile; with the bias of the whole layer."""
    parts = [QuantLinear(_quantized(n, 256, qtype, seed=n)[0], qtype, 256, None)
             for n, qtype in ((48, "Q4_K"), (20, "Q4_K"), (24, "Q6_K"))]
    bias = torch.randn(92)
    layer = quant_linear.ConcatQuantLinear(parts, bias)
    assert (layer.in_features, layer.out_features) == (256, 92)
    assert torch.equal(dequantize(layer), torch.cat([dequantize(p) for p in parts]))
    for m in (1, 4, 5, 60):
        x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m))
        alone = torch.cat([p(x) for p in parts], dim=1)
        assert torch.equal(layer.product(x), alone), m
        assert torch.equal(layer(x), alone + bias), m
        assert torch.equal(linear_product(layer, x), alone), m
    assert layer(torch.randn(2, 3, 256)).shape == (2, 3, 92)
    with pytest.raises(ValueError, match="same inputs and have no bias of their own"):
        quant_linear.ConcatQuantLinear([parts[0], QuantLinear(_quantized(16, 512, "Q4_K", 0)[0], "Q4_K", 512, None)],
                                       None)


def test_bad_inputs_are_named():
    rows, _ = _quantized(16, 64, "Q4_1", seed=0)
    with pytest.raises(ValueError, match="Q5_K"):
        QuantLinear(rows, "Q5_K", 64, None)
    with pytest.raises(ValueError, match="do not hold 96 values"):
        QuantLinear(rows, "Q4_1", 96, None)
    q4_k = torch.from_numpy(_random_blocks("Q4_K", 16, 256, np.random.default_rng(0)))
    with pytest.raises(ValueError, match="do not hold 288 values"):  # Q4_K blocks are 256 values
        QuantLinear(torch.cat([q4_k, q4_k[:, :18]], dim=1), "Q4_K", 288, None)
    with pytest.raises(ValueError, match="fp32 CPU inputs"):
        QuantLinear(rows, "Q4_1", 64, None)(torch.randn(2, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="inputs of 64 features, got \\(2, 3, 32\\)"):
        QuantLinear(rows, "Q4_1", 64, None)(torch.randn(2, 3, 32))  # as many values as 3 rows of 64: not those
    with pytest.raises(IndexError, match=r"ids \[-1, 16\] are outside the table's 16 rows"):
        QuantLinear(rows, "Q4_1", 64, None).rows(torch.tensor([0, 16, 3, -1, 16]))


@pytest.mark.parametrize("tp_rank", [None, 1])  # the whole model, and rank 1 of 3 (sliced along rows and K)
def test_embedded_model_layers_hold_the_fp32_weights(embedded_dir, tp_rank):
    """Every swapped layer computes with exactly the fp32 weights the loader reads for it: the converter's
    Q/K row order, the fused q/k/v and gate/up concatenation, TP shards and the tied LM head all agree."""
    source = resolve_model(str(embedded_dir))
    config = ModelConfig.from_file(source.config_path)
    tp = TPLayout.make(config, tp_rank, 3) if tp_rank is not None else None
    model = build_model(source, config, torch.float32, torch.device("cpu"), 64, tp=tp)
    fp32 = {name: p.detach().clone() for name, p in model.named_parameters()}
    held = load_gguf_linears(model, embedded_dir / GGUF_BLOCKS_NAME)
    assert len(held) == 7 * config.num_layers + 1  # q, k, v, o, gate, up, down; the table, the tied head's too
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            table = name in ("lm_head", "model.embed_tokens.table")  # one module, the tied head
            weight = fp32["model.embed_tokens.weight" if table else f"{name}.weight"]
            assert torch.equal(dequantize(module), weight), name
    # The table is looked up in the tied head's blocks: the rows of this rank's shard, and no fp32 copy
    embed = model.model.embed_tokens
    assert hold_embedding(model) == "Q8_0, the LM head's panels"
    assert embed.weight is None and embed.table is model.lm_head
    ids = torch.tensor([0, 5, embed.tp.vocab_shard - 1, 5])
    assert torch.equal(embed.table.rows(ids), fp32["model.embed_tokens.weight"][ids])
    if tp_rank is None:
        assert torch.equal(embed(ids), fp32["model.embed_tokens.weight"][ids])


@pytest.mark.parametrize("tp_rank", [None, 1])  # the whole model, and rank 1 of 2
def test_layers_held_as_blocks_are_never_loaded_as_fp32(tmp_path, tp_rank):
    """Made from the blocks before the checkpoint is read (`build_model`'s `held_by`), the layers a GGUF holds as
    blocks never have fp32 weights: a checkpoint without those tensors loads, with the same weights, biases and
    table as the full one; a q/k/v projection with a v of another type too, in parts, whole or sharded."""
    import transformers
    from safetensors.torch import save_file

    transformers.Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                             ).save_pretrained(tmp_path / "full")
    config = ModelConfig.from_file(tmp_path / "full" / "config.json")
    assert config.qkv_bias  # biases of layers held as blocks still come from the checkpoint
    rng = np.random.default_rng(0)
    state, blocks, types = {}, {}, {}
    for name, shape in hf_tensor_shapes(config).items():
        values = rng.standard_normal(shape).astype(np.float32)
        if len(shape) == 2:
            types[name] = "Q4_0" if name.endswith("v_proj.weight") else "Q8_0"
            blocks[name] = gguf_quantize(values, GGMLQuantizationType[types[name]])
            values = gguf_dequantize(blocks[name], GGMLQuantizationType[types[name]])
        state[name] = torch.from_numpy(values)
    (tmp_path / "lean").mkdir()
    (tmp_path / "lean" / "config.json").write_bytes((tmp_path / "full" / "config.json").read_bytes())
    for d, tensors in (("full", state), ("lean", {n: t for n, t in state.items() if n not in blocks})):
        save_file(tensors, str(tmp_path / d / "model.safetensors"))
        save_file({n: torch.from_numpy(b) for n, b in blocks.items()}, str(tmp_path / d / GGUF_BLOCKS_NAME),
                  metadata=types)

    def build(d, held_by=None):
        tp = None if tp_rank is None else TPLayout.make(config, tp_rank, 2)
        return build_model(resolve_model(str(tmp_path / d)), config, torch.float32, torch.device("cpu"), 64,
                           held_by=held_by, tp=tp)

    full = build("full")
    with pytest.raises(ValueError, match="lacks weights for: model.embed_tokens.weight"):
        build("lean")
    ids = torch.tensor([0, full.tp.vocab_shard - 1, 7])
    for d in ("lean", "full"):  # the full checkpoint's fp32 copies of those layers are passed over
        held = build(d, functools.partial(load_gguf_linears, blocks_path=tmp_path / d / GGUF_BLOCKS_NAME))
        embed = held.model.embed_tokens
        assert embed.weight is None and torch.equal(embed.table.rows(ids), full.model.embed_tokens.weight[ids])
        layers = {n: m for n, m in held.named_modules() if isinstance(m, QuantLinear | quant_linear.ConcatQuantLinear)
                  and not n.startswith(("model.embed_tokens.table", "lm_head")) and ".parts." not in n}
        assert len(layers) == 4 * 2  # four in each layer
        for name, module in layers.items():
            plain = full.get_submodule(name)
            assert torch.equal(dequantize(module), plain.weight), name
            assert (module.bias is None) == (plain.bias is None), name
            assert plain.bias is None or torch.equal(module.bias, plain.bias), name
        attn = held.model.layers[1].self_attn.qkv_proj
        assert [p.qtype for p in attn.parts] == ["Q8_0", "Q4_0"]  # q and k in one part, v in its own
        assert attn.bias is not None and attn.bias.abs().sum() > 0
        x = torch.randn(3, 64)
        torch.testing.assert_close(attn(x), x @ full.get_submodule("model.layers.1.self_attn.qkv_proj").weight.T
                                   + attn.bias, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("qtype", K_TYPES)
def test_k_type_layers_split_over_ranks_hold_their_shards(qtype, tmp_path):
    """Tensor parallel over K-type layers: the column-parallel ones (q/k/v, gate/up, the LM head and the table) take
    their rows, the row-parallel ones (o, down) their columns, cut at the 256-value super-blocks; each rank's layer
    multiplies by exactly its part of the fp32 weights the loader reads for it."""
    import transformers
    from safetensors.torch import save_file

    transformers.LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=1024, num_hidden_layers=1,
                             num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False,
                             ).save_pretrained(tmp_path)
    config = ModelConfig.from_file(tmp_path / "config.json")
    rng = np.random.default_rng(0)
    state, blocks = {}, {}
    for name, shape in hf_tensor_shapes(config).items():
        if len(shape) == 2:
            blocks[name] = _random_blocks(qtype, *shape, rng)
            state[name] = torch.from_numpy(gguf_dequantize(blocks[name], GGMLQuantizationType[qtype]))
        else:
            state[name] = torch.ones(shape)
    save_file(state, str(tmp_path / "model.safetensors"))
    save_file({n: torch.from_numpy(b) for n, b in blocks.items()}, str(tmp_path / GGUF_BLOCKS_NAME),
              metadata=dict.fromkeys(blocks, qtype))
    source = resolve_model(str(tmp_path))
    for rank in range(2):  # o's 512 inputs and down's 1,024 split into 256 and 512 a rank
        tp = TPLayout.make(config, rank, 2)
        plain = build_model(source, config, torch.float32, torch.device("cpu"), 64, tp=tp)
        held = build_model(source, config, torch.float32, torch.device("cpu"), 64, tp=tp,
                           held_by=functools.partial(load_gguf_linears, blocks_path=tmp_path / GGUF_BLOCKS_NAME))
        layers = {n: m for n, m in held.named_modules() if isinstance(m, QuantLinear)}
        assert len(layers) == 6 and {m.qtype for m in layers.values()} == {qtype}, layers
        for name, module in layers.items():
            weight = plain.model.embed_tokens.weight if name == "model.embed_tokens.table" else (
                plain.get_submodule(name).weight)
            assert torch.equal(dequantize(module), weight), (rank, name)


def _same_tokens_on_blocks_and_fp32(model: str, block_types: set[str], prompts: list[str], max_tokens: int,
                                    mixed_parts: bool = False) -> None:
    """The engine on `model` computes with the GGUF's blocks, of `block_types`, and with their fp32 dequantization
    (plain panels: the kernel unquantized, 16-bit where every value of a layer is one), and draws the same greedy
    tokens."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    answers = []
    for gguf_linears in (True, False):
        with LLM(model, gguf_linears=gguf_linears) as llm:
            engine_model = llm.llm_engine.executor.worker.model
            types = {m.qtype for m in engine_model.modules() if isinstance(m, QuantLinear)}
            assert types == block_types if gguf_linears else types <= set(quant_linear.PLAIN_TYPES), types
            assert engine_model.model.embed_tokens.weight is None  # looked up in panels, no fp32 copy
            runner = llm.llm_engine.executor.worker.runner
            assert runner.native_forward is not None  # the layers in one native call a step
            mixed = any(isinstance(m, quant_linear.ConcatQuantLinear) for m in engine_model.modules())
            assert mixed == (gguf_linears and mixed_parts)
            answers.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert answers[0] == answers[1]


def test_engine_tokens_match_fp32_weights(embedded_dir):
    _same_tokens_on_blocks_and_fp32(str(embedded_dir), {"Q4_1", "Q8_0"},
                                    ["The capital of France is", "def fibonacci(n):", "Write a haiku about the sea."],
                                    24)


@pytest.mark.parametrize("qtype", ["BF16", "F16"])
def test_16_bit_panels_give_the_fp32_panels_bits_from_half_the_bytes(qtype):
    """A 16-bit checkpoint's weights, held as they are, compute what the same values held as fp32 compute, bit
    for bit, in every tile: keeping them narrow changes nothing but the bytes read."""
    rows, w = _quantized(40, 128, qtype, seed=4)
    narrow = QuantLinear(rows, qtype, 128, torch.randn(40))
    wide = QuantLinear(w.view(torch.uint8), "F32", 128, narrow.bias)
    assert narrow.panels.numel() * 2 == wide.panels.numel()
    for m in (1, 3, 4, 5, 13, 60, 130):  # the first rows alone, with register tiles after them, past 48 rows
        x = torch.randn(m, 128, generator=torch.Generator().manual_seed(m))
        assert torch.equal(narrow(x), wide(x)), m


def _iq4_nl(values: np.ndarray) -> np.ndarray:
    """fp32 [n, k] -> IQ4_NL rows [n, k / 32 * 18] (which gguf cannot quantize to): each 32 values' d their largest
    magnitude over 127, each value the nearest of d times the type's table."""
    from gguf.quants import IQ4_NL

    table = np.array(IQ4_NL.kvalues, dtype=np.float32)
    blocks = values.reshape(-1, 32)
    d = (np.abs(blocks).max(axis=-1, keepdims=True) / 127).astype(np.float16)  # [B, 1]
    q = np.abs(blocks[..., None] - d.astype(np.float32)[..., None] * table).argmin(axis=-1).astype(np.uint8)
    packed = q[:, :16] | (q[:, 16:] << 4)  # value j in byte j's low nibble, j + 16 in its high one
    return np.concatenate([d.view(np.uint8), packed], axis=-1).reshape(values.shape[0], -1)


def test_a_gguf_with_k_type_layers_computes_what_their_fp32_weights_do(tmp_path, monkeypatch):
    """The embedded GGUF with its MLP down projections (1,536 inputs: six 256-value blocks) as Q2_K, Q3_K, Q4_K,
    Q5_K, Q6_K and IQ4_XS (random blocks, in turn), a third of its output projections as IQ4_NL and of its up
    projections as Q5_1, and half its gate and v projections as Q5_0 (all requantized: 576 inputs, no K-type fits)
    beside Q4_1 up, q and k projections: the
    engine runs them on their blocks, fused parts of two types too, in one native call a step, and its tokens are
    those of their fp32 dequantization."""
    from benchmarks.throughput import rewritten_gguf
    from pagedserve.workers.gguf import embedded_model_gguf

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))  # converted here, removed with it
    rng = np.random.default_rng(0)

    def k_types(tensor):
        layer = int(tensor.name.split(".")[1]) if tensor.name.startswith("blk.") else -1
        if tensor.name.endswith("ffn_down.weight"):
            qtype = K_TYPES[layer % len(K_TYPES)]
            n, k = tensor.data.shape[0], int(tensor.n_elements) // tensor.data.shape[0]
            return _random_blocks(qtype, n, k, rng, scale=1e-4), GGMLQuantizationType[qtype]
        if tensor.name.endswith("attn_output.weight") and layer % 3 == 0:
            return _iq4_nl(gguf_dequantize(tensor.data, tensor.tensor_type)), GGMLQuantizationType.IQ4_NL
        if tensor.name.endswith("ffn_up.weight") and layer % 3 == 1:
            values = gguf_dequantize(tensor.data, tensor.tensor_type)
            return gguf_quantize(values, GGMLQuantizationType.Q5_1), GGMLQuantizationType.Q5_1
        # Mixed parts, as llama-quantize's _M mixes make them: v beside Q4_1 q and k, gate beside a Q4_1 up
        if (tensor.name.endswith("ffn_gate.weight") and layer % 2 == 0) or (
                tensor.name.endswith("attn_v.weight") and layer % 2):
            values = gguf_dequantize(tensor.data, tensor.tensor_type)
            return gguf_quantize(values, GGMLQuantizationType.Q5_0), GGMLQuantizationType.Q5_0
        return None

    path = rewritten_gguf(embedded_model_gguf(), tmp_path / "k-types.gguf", k_types)
    _same_tokens_on_blocks_and_fp32(str(path), {"Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                                                 "IQ4_NL", "IQ4_XS", "Q8_0"},
                                    ["The capital of France is", "def fibonacci(n):"], 16, mixed_parts=True)


def test_an_untied_gguf_looks_its_table_up_in_its_own_blocks(tmp_path, monkeypatch):
    """The embedded GGUF given an LM head of its own (its table's Q8_0 blocks), and its table requantized to Q4_0:
    the engine looks tokens up in the table's own blocks, holding no fp32 copy, and draws the tokens of the fp32
    path."""
    import gguf

    from benchmarks.throughput import rewritten_gguf
    from pagedserve.workers.gguf import embedded_model_gguf

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))  # converted here, removed with it
    src = embedded_model_gguf()
    table = next(t for t in gguf.GGUFReader(src).tensors if t.name == "token_embd.weight")

    def q4_0_table(tensor):
        if tensor.name != "token_embd.weight":
            return None
        q4_0 = GGMLQuantizationType.Q4_0
        return gguf_quantize(gguf_dequantize(tensor.data, tensor.tensor_type), q4_0), q4_0

    path = rewritten_gguf(src, tmp_path / "untied.gguf", q4_0_table,
                          added={"output.weight": (table.data, table.tensor_type)})
    with LLM(str(path), max_model_len=64) as llm:
        model = llm.llm_engine.executor.worker.model
        assert not model.config.tie_word_embeddings
        assert model.model.embed_tokens.table.qtype == "Q4_0" and model.lm_head.qtype == "Q8_0"
    _same_tokens_on_blocks_and_fp32(str(path), {"Q4_0", "Q4_1", "Q8_0"}, ["The capital of France is"], 16)


def test_fp32_layers_take_the_weights_as_they_are():
    w, bias = torch.randn(24, 64), torch.randn(24)
    layer = QuantLinear.from_fp32(w, bias)
    assert layer.qtype == "F32" and torch.equal(dequantize(layer), w)
    # Held narrow only where every value is exactly a 16-bit one: bf16 first, then fp16 (its finer mantissa
    # holds values bf16 does not); a value that is neither, or a NaN, keeps the layer fp32.
    as_bf16, as_f16 = w.bfloat16().float(), (w / 8).half().float()
    assert QuantLinear.from_fp32(as_bf16, bias).qtype == "BF16"
    assert QuantLinear.from_fp32(as_f16, bias).qtype == "F16"
    assert QuantLinear.from_fp32(torch.cat([as_bf16[:1], w[1:2], as_bf16[2:]]), bias).qtype == "F32"
    assert QuantLinear.from_fp32(torch.cat([as_f16[:1] * 2**20, as_f16[1:]]), bias).qtype == "F32"  # fp16's range
    with_nan = as_bf16.clone()
    with_nan[3, 5] = float("nan")
    assert QuantLinear.from_fp32(with_nan, bias).qtype == "F32"
    for weights in (as_bf16, as_f16):
        assert torch.equal(dequantize(QuantLinear.from_fp32(weights, bias)), weights)
    config = ModelConfig.from_dict(dict(model_type="llama", vocab_size=100, hidden_size=64, intermediate_size=96,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=64, tie_word_embeddings=True))
    model = CausalLM(config, 64)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_()
    down = model.model.layers[1].mlp.down_proj.weight.detach().clone()
    assert load_fp32_linears(model) == 4 * 2 + 1  # the four projections of both layers, and the tied head
    assert torch.equal(dequantize(model.model.layers[1].mlp.down_proj), down)
    assert torch.equal(dequantize(model.lm_head), model.model.embed_tokens.weight)


def test_the_embedding_table_is_held_once_in_panels():
    """The table is looked up where the kernel holds it, with no fp32 copy: in the tied LM head's panels (a 16-bit
    checkpoint's as its 16-bit values), else in panels of its own. A tied head that reads the table itself, or a
    width the kernel does not take, keeps the table."""
    def model(tied: bool, hidden: int = 64) -> CausalLM:
        config = ModelConfig.from_dict(dict(
            model_type="llama", vocab_size=100, hidden_size=hidden, intermediate_size=96, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied))
        m = CausalLM(config, 64)
        with torch.no_grad():
            m.model.embed_tokens.weight.copy_(torch.randn(100, hidden).bfloat16().float())
        return m

    ids = torch.tensor([[3, 7], [99, 3]])
    tied = model(tied=True)
    table = tied.model.embed_tokens.weight.detach().clone()
    assert hold_embedding(tied) == "F32"  # the tied head, without a module of its own, reads the whole table
    assert tied.model.embed_tokens.weight is not None
    load_fp32_linears(tied)
    assert hold_embedding(tied) == "BF16, the LM head's panels"
    assert tied.model.embed_tokens.weight is None and tied.model.embed_tokens.table is tied.lm_head
    assert torch.equal(tied.model.embed_tokens(ids), table[ids])
    assert hold_embedding(tied) == "BF16, the LM head's panels"  # already held: left as it is

    untied = model(tied=False)
    with torch.no_grad():
        untied.model.embed_tokens.weight[5, 1] = 0.1  # a value no 16-bit type holds
    table = untied.model.embed_tokens.weight.detach().clone()
    load_fp32_linears(untied)
    assert hold_embedding(untied) == "F32"
    assert untied.model.embed_tokens.weight is None and untied.model.embed_tokens.table is not untied.lm_head
    assert torch.equal(untied.model.embed_tokens(ids), table[ids])
    assert hold_embedding(model(tied=False)) == "BF16"

    narrow = model(tied=False, hidden=48)  # not a multiple of 32: the kernel does not take it
    assert hold_embedding(narrow) == "F32" and narrow.model.embed_tokens.weight is not None


def test_gguf_linears_setting_must_be_a_bool():
    from pagedserve.config import EngineConfig

    with pytest.raises(ValueError, match="gguf_linears='no' must be true or false"):
        EngineConfig(gguf_linears="no")


@pytest.mark.parametrize(("dtype", "tied"), [(torch.bfloat16, False), (torch.float16, True)])
def test_a_16_bit_checkpoint_keeps_its_weights_16_bit_and_matches_transformers(dtype, tied, tmp_path):
    """A checkpoint saved in bf16 or fp16 (most published ones are bf16) runs on fp32 activations, as transformers
    runs it loaded in fp32, with its linear layers and embedding table held in the checkpoint's own type: the
    same greedy tokens as transformers', from half the bytes of weights."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=tied)
    torch.manual_seed(5)
    transformers.AutoModelForCausalLM.from_config(config).to(dtype).save_pretrained(tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (3, 17, 40)]
    with torch.no_grad():
        expected = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):]
                    .tolist() for p in prompts]
    with LLM(str(tmp_path)) as llm:
        model = llm.llm_engine.executor.worker.model
        assert {m.qtype for m in model.modules() if isinstance(m, QuantLinear)} == {
            "BF16" if dtype == torch.bfloat16 else "F16"}
        table = model.model.embed_tokens.table  # one of the modules above: held 16-bit too, once
        assert model.model.embed_tokens.weight is None and (table is model.lm_head) == tied
        outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
