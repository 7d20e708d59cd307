"""GGUF files of every architecture the converter reads, written in llama.cpp's layout from tiny random transformers
checkpoints (`tests/gguf_export.py`), in Q8_0 with v, o and down in Q6_K: the converted config and tensors against
the checkpoint, against transformers' own GGUF loader where it reads the architecture, and the engine's greedy tokens
from the GGUF (its linear layers on the file's blocks) against transformers' on the file's weights.

The exporter's layout was checked once against llama.cpp's `convert_hf_to_gguf.py` on the same tiny checkpoints
(`--outtype f32`, its vocabulary step left out): the same metadata keys and values, tensor names, shapes and bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pagedserve.kernels.cpu import quant_linear
from pagedserve.workers import gguf as gguf_mod
from pagedserve.workers.models.model_config import FAMILIES, ModelConfig
from tests.gguf_export import export, q8_0_and_q6_k

# model_type -> (transformers config class, settings beyond the common tiny ones)
TINY = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": None}),  # llama.cpp keeps no window for Mistral: v0.2's shape
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 128}),  # not hidden_size / heads; transformers' loader reads none
    "phi3": ("Phi3Config", {"sliding_window": 20}),
    "granite": ("GraniteConfig", {"embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                                  "attention_multiplier": 0.2, "logits_scaling": 8.0}),
    # llama.cpp's layers without rotary embedding: every fourth
    "smollm3": ("SmolLM3Config", {"num_hidden_layers": 4, "no_rope_layer_interval": 4}),
    # the query scale llama.cpp computes (1/sqrt(head_dim)); a window shorter than the prompts
    "gemma2": ("Gemma2Config", {"head_dim": 64, "query_pre_attn_scalar": 64, "sliding_window": 24}),
    "gemma3_text": ("Gemma3TextConfig", {"head_dim": 64, "query_pre_attn_scalar": 64, "sliding_window": 24,
                                         "num_hidden_layers": 7}),
    "olmo2": ("Olmo2Config", {}),
    # Mixtures of experts, their experts stacked ([E, rows, blocks]) and run on their own blocks: Qwen3-MoE's
    # (renormalized, as llama.cpp computes it whatever norm_topk_prob says), Qwen2-MoE's (not; a shared expert and
    # its gate), and Mixtral's, which llama.cpp writes as a llama model with experts.
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
                                     "norm_topk_prob": True, "head_dim": 64}),
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
                                     "shared_expert_intermediate_size": 512}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
}
MOE = {"qwen3_moe", "qwen2_moe", "mixtral"}
# Where transformers' GGUF loader leaves a key at its config class's default, which is not this file's model
LOADER_DEFAULTS = {
    "phi3": {"sliding_window"},  # not read, though the file holds it
    "gemma2": {"query_pre_attn_scalar"},  # Gemma2Config's 256, where llama.cpp scales by head_dim
    "gemma3_text": {"query_pre_attn_scalar"},
}
READ_BY_TRANSFORMERS = {"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text"}
PROMPT_LENS = [1, 15, 33, 70]
NEW_TOKENS = 16

pytestmark = pytest.mark.skipif(not quant_linear.available(torch.device("cpu"), torch.float32),
                                reason="the GGUF linear kernel needs a C compiler and AVX2/FMA/F16C")


def _tiny_checkpoint(model_type: str, path: Path):
    import transformers

    cls_name, extra = TINY[model_type]
    settings = dict(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                    tie_word_embeddings=model_type == "gemma2", bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config = getattr(transformers, cls_name)(**settings | extra)
    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # norms and biases away from their initial ones and zeros, so that each is tested
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):  # no near ties among experts
                p.normal_(0.0, 0.3)
    model.save_pretrained(path, save_original_format=model_type not in MOE)  # experts stacked, as llama.cpp's
    return model


@pytest.fixture(scope="module", params=sorted(TINY))
def family(request, tmp_path_factory):
    """(model_type, the original checkpoint's dir, the GGUF, transformers' model on the GGUF's weights, the converted
    directory)."""
    model_type = request.param
    d = tmp_path_factory.mktemp(model_type)
    model = _tiny_checkpoint(model_type, d / "hf")
    path = d / "tiny.gguf"
    reference = export(d / "hf", path, q8_0_and_q6_k(seed=3))
    model.load_state_dict(reference, strict=not model.config.tie_word_embeddings)
    converted = gguf_mod.cached_gguf_dir(path, cache_root=d / "cache")
    return model_type, d / "hf", path, model, converted, reference


def _state(converted: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(converted / gguf_mod.WEIGHTS_NAME))


@pytest.mark.slow
def test_tensors_are_the_files_weights(family) -> None:
    """Every tensor of the checkpoint, as the file rounds it, under its transformers name (Phi-3's fused ones fused);
    the blocks of each linear layer under the names the CPU's loader reads (Phi-3's as their parts)."""
    from safetensors import safe_open

    model_type, _, _, model, converted, reference = family
    ours = _state(converted)
    assert ours.keys() == reference.keys()
    assert all(torch.equal(ours[n], reference[n]) for n in ours), [n for n in ours if not torch.equal(ours[n],
                                                                                                 reference[n])]
    with safe_open(converted / gguf_mod.GGUF_BLOCKS_NAME, framework="pt") as f:
        types = {k: v for k, v in f.metadata().items() if k != "format"}
        for name in f.keys():
            rows = f.get_tensor(name)
            weight = _part_of(model, name)
            values, block_bytes = quant_linear.BLOCKS[types[name]]
            for expert_rows, expert_weight in zip(*((rows, weight) if rows.dim() == 3 else ([rows], [weight])),
                                                  strict=True):
                part = quant_linear.QuantLinear(expert_rows, types[name],
                                                rows.shape[-1] // block_bytes * values, None)
                assert torch.equal(quant_linear.dequantize(part), expert_weight), name
    linears = [n for n, t in reference.items() if t.dim() >= 2]  # stacked experts' [E, rows, H] too
    parts = {"qkv_proj": 3, "gate_up_proj": 2}
    assert len(types) == sum(parts.get(n.removesuffix(".weight").rsplit(".", 1)[-1], 1) for n in linears)
    v_type = types["model.layers.0.self_attn.v_proj.weight"]
    assert (v_type, types["model.layers.0.self_attn.q_proj.weight"]) == (("Q8_0", "Q8_0") if model_type == "phi3"
                                                                         else ("Q6_K", "Q8_0"))


def _part_of(model, name: str) -> torch.Tensor:
    """The weight the checkpoint's model holds for a CPU loader's name: a part of a fused projection where it has
    one."""
    module, _ = name.rsplit(".", 1)
    if ".experts." in module:  # stacked: [E, I, H] of gate_up_proj's rows, or down_proj [E, H, I]
        experts, leaf = module.rsplit(".", 1)
        stacked = model.get_submodule(experts)
        inter = stacked.down_proj.shape[2]
        return {"gate_proj": stacked.gate_up_proj[:, :inter], "up_proj": stacked.gate_up_proj[:, inter:],
                "down_proj": stacked.down_proj}[leaf]
    try:
        return model.get_submodule(module).weight
    except AttributeError:
        pass
    prefix, leaf = module.rsplit(".", 1)
    q = model.config.num_attention_heads * getattr(model.config, "head_dim", 64)
    kv = model.config.num_key_value_heads * getattr(model.config, "head_dim", 64)
    inter = model.config.intermediate_size
    fused, parts = (("qkv_proj", {"q_proj": (0, q), "k_proj": (q, kv), "v_proj": (q + kv, kv)}) if leaf[0] in "qkv"
                    else ("gate_up_proj", {"gate_proj": (0, inter), "up_proj": (inter, inter)}))
    start, rows = parts[leaf]
    return model.get_submodule(f"{prefix}.{fused}").weight[start:start + rows]


def _config_keys(config) -> dict:
    bookkeeping = {"_name_or_path", "_model_name_or_path", "architectures", "dtype", "transformers_version",
                   "id2label", "label2id", "output_attentions", "output_hidden_states", "return_dict",
                   "is_encoder_decoder", "chunk_size_feed_forward", "problem_type", "initializer_range",
                   "router_aux_loss_coef", "router_jitter_noise", "output_router_logits"}  # training settings
    return {k: v for k, v in config.to_dict().items() if k not in bookkeeping}


@pytest.mark.slow
def test_config_is_the_checkpoints(family) -> None:
    """The converted config computes what the checkpoint's does: the same settings (a float read back from the file's
    fp32, and Mistral as Llama: llama.cpp keeps no window, and without one they are the same model)."""
    from transformers import AutoConfig

    model_type, hf_dir, _, model, converted, _ = family
    ours = _config_keys(AutoConfig.from_pretrained(converted))
    theirs = _config_keys(model.config)
    for d in (ours, theirs):
        if d.get("head_dim") is None:  # the classes without one compute hidden_size / heads
            d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
    if model_type == "mistral":
        assert ours["model_type"] == "llama" and theirs.pop("sliding_window") is None
        theirs["model_type"] = "llama"
    for key in set(ours) | set(theirs):
        a, b = ours.get(key), theirs.get(key)
        if isinstance(b, float):
            assert a == float(np.float32(b)), key
        elif key not in ("attention_bias", "mlp_bias", "pretraining_tp", "max_window_layers", "layer_types") or (
                a is not None and b is not None):
            assert a == b, key
    if model_type in FAMILIES or model_type == "mistral":
        ModelConfig.from_file(converted / "config.json")  # every key honoured


@pytest.mark.slow
def test_transformers_computes_the_same_on_the_converted_dir(family) -> None:
    from transformers import AutoModelForCausalLM

    _, _, _, model, converted, _ = family
    ids = torch.randint(0, 300, (1, 70), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = AutoModelForCausalLM.from_pretrained(converted).eval()(ids).logits
        theirs = model(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_transformers_gguf_loader_agrees(family) -> None:
    """Where transformers reads the architecture: the same tensors, and the same config but for the keys its loader
    leaves at the config class's defaults (`LOADER_DEFAULTS`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, _, path, _, converted, _ = family
    if model_type in MOE:
        pytest.skip("transformers' GGUF loader reads these architectures' configs but not their experts")
    if model_type not in READ_BY_TRANSFORMERS:
        with pytest.raises(ValueError, match="not supported"):
            AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        return
    loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)
    theirs = loaded.state_dict()
    ours = _state(converted)
    if loaded.config.tie_word_embeddings:
        theirs.pop("lm_head.weight")
    assert ours.keys() == theirs.keys()
    assert [n for n in ours if not torch.equal(ours[n], theirs[n])] == []
    mine = _config_keys(AutoConfig.from_pretrained(converted))
    their_config = _config_keys(loaded.config)
    differ = {k for k in set(mine) | set(their_config) if mine.get(k) != their_config.get(k)}
    # keys one class has and the other not (Mistral's and Llama's) aside
    differ = {k for k in differ if k in mine and k in their_config}
    assert differ == LOADER_DEFAULTS.get(model_type, set())


def _hf_greedy(model, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy tokens and their logprobs."""
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
            tokens = out.sequences[0, len(p):].tolist()
            outs.append((tokens, [torch.log_softmax(s[0], -1)[t].item() for s, t in zip(out.scores, tokens,
                                                                                         strict=True)]))
    return outs


@pytest.mark.slow
def test_engine_on_the_gguf_matches_transformers(family, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine loads the GGUF itself, its linear layers on the file's Q8_0 and Q6_K blocks, and draws transformers'
    greedy tokens on the file's weights, with prompts past Phi-3's window; their logprobs too, which move where a
    setting is lost that would not flip a tiny random model's tokens."""
    from pagedserve import LLM, SamplingParams

    model_type, _, path, model, converted, _ = family
    if model_type not in FAMILIES and model_type != "mistral":
        pytest.skip(f"the engine does not run {model_type} models yet")
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(converted.parent.parent))
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    expected = _hf_greedy(model, prompts)
    with LLM(str(path), block_size=16) as llm:
        engine_model = llm.llm_engine.executor.worker.model
        types = {m.qtype for m in engine_model.modules() if isinstance(m, quant_linear.QuantLinear)}
        assert types == {"Q8_0", "Q6_K"} | ({"F32"} if model_type in MOE else set()), types  # routers: F32
        assert not any(isinstance(m, torch.nn.Linear) for m in engine_model.modules())
        # experts on their own blocks: no stacked fp32 copies of them were ever made
        experts = [m for m in engine_model.modules() if hasattr(m, "gate_up_linears")]
        assert len(experts) == (2 if model_type in MOE else 0)
        assert all(e.gate_up_proj is None and e.down_proj is None and len(e.gate_up_linears) == 4 for e in experts)
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
        got = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert [o.token_ids for o in got] == [tokens for tokens, _ in expected]
    for out, (_, logprobs) in zip(got, expected, strict=True):
        assert max(abs(e.logprob - lp) for e, lp in zip(out.logprobs, logprobs, strict=True)) < 1e-4


# ---------------------------------------------------------------------------------------------------------
# What the converter refuses, by name.
# ---------------------------------------------------------------------------------------------------------


def _file(tmp_path: Path, arch: str, keys: dict, tensors: dict[str, np.ndarray]) -> Path:
    path = tmp_path / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_head_count(2)
    writer.add_block_count(1)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(8)
    for key, value in keys.items():
        writer.add_key_value(key.format(arch=arch), value[0], value[1])
    for name, values in tensors.items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(("arch", "keys", "tensor", "error", "match"), [
    ("llama", {}, "rope_freqs.weight", NotImplementedError, "rope_freqs.weight.*not Llama 3's rope scaling"),
    ("phi3", {}, "rope_factors_long.weight", ValueError, "rope_factors_long.weight"),
    ("olmo2", {"{arch}.attention.sliding_window": (4096, gguf.GGUFValueType.UINT32)}, None, NotImplementedError,
     r"olmo2\.attention\.sliding_window"),
    ("llama", {"{arch}.rope.scaling.type": ("yarn", gguf.GGUFValueType.STRING)}, None, NotImplementedError,
     r"llama\.rope\.scaling\.type='yarn'"),
    ("granite", {}, None, ValueError, r"granite\.logit_scale"),
    ("gptneox", {}, None, NotImplementedError, "'gptneox'"),
])
def test_refused_by_name(tmp_path: Path, arch, keys, tensor, error, match) -> None:
    """What the file holds and the converter would compute wrongly without (Llama 3's and Phi-3's rope factors,
    OLMo 3's windows, a rope scaling it does not read, Granite's missing logit scale, an unknown architecture) is
    refused, naming it."""
    tensors = {"token_embd.weight": np.zeros((8, 32), np.float32)}
    if tensor is not None:
        tensors[tensor] = np.arange(1, 9, dtype=np.float32)  # as factors: not Llama 3's scaling
    path = _file(tmp_path, arch, keys, tensors)
    with pytest.raises(error, match=match):
        gguf_mod.convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("factor", [8.0, 32.0])
def test_llama3_rope_scaling_read_back_from_its_factors(tmp_path: Path, factor: float) -> None:
    """Llama 3.x files keep their rope scaling only as `rope_freqs.weight`: the converter finds the settings whose
    factors those are, so the model rotates as transformers does on the checkpoint, and writes no such tensor."""
    from gguf import GGUFReader

    from pagedserve.workers.gguf_archs import llama3_rope_freqs
    from pagedserve.workers.models.rotary_embedding import RotaryEmbedding

    theta = 500000.0
    factors = np.array(llama3_rope_freqs(theta, 16, factor, 1.0, 4.0, 8192), np.float32)  # head_dim 32 / 2 heads
    assert 1.0 < factors.max() and factors.min() == 1.0  # some pairs scaled, some not, some between (below)
    assert ((factors > 1.0) & (factors < factor)).any()
    path = _file(tmp_path, "llama", {"{arch}.rope.freq_base": (theta, gguf.GGUFValueType.FLOAT32),
                                     "{arch}.context_length": (131072, gguf.GGUFValueType.UINT32)},
                 {"token_embd.weight": np.zeros((8, 32), np.float32), "rope_freqs.weight": factors})
    d = gguf_mod.hf_config(gguf_mod._metadata(GGUFReader(path)))
    assert d["rope_parameters"] == {"rope_type": "llama3", "rope_theta": theta, "factor": factor,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192}
    config = ModelConfig.from_dict(json.loads(json.dumps(d | {"hidden_act": "silu"})))
    inv_freq = RotaryEmbedding(config, 8).inv_freq
    base = 1.0 / (theta ** (torch.arange(0, 16, 2).float() / 16))
    torch.testing.assert_close(inv_freq, base / torch.from_numpy(factors), rtol=1e-6, atol=0)
    tensors = gguf_mod._converted_tensors(GGUFReader(path), path.name)
    assert [name for name, *_ in tensors] == ["model.embed_tokens.weight"]


def test_config_reads_the_files_keys(tmp_path: Path) -> None:
    """Granite's scales, a linear rope scaling, Phi-3's window (0: none) and partial rotation, read from the keys
    llama.cpp writes."""
    from gguf import GGUFReader

    path = _file(tmp_path, "granite", {"{arch}.logit_scale": (8.0, gguf.GGUFValueType.FLOAT32),
                                       "{arch}.rope.scaling.type": ("linear", gguf.GGUFValueType.STRING),
                                       "{arch}.rope.scaling.factor": (4.0, gguf.GGUFValueType.FLOAT32)}, {})
    d = gguf_mod.hf_config(gguf_mod._metadata(GGUFReader(path)))
    assert (d["attention_multiplier"], d["embedding_multiplier"], d["residual_multiplier"]) == (16 ** -0.5, 1, 1)
    assert d["logits_scaling"] == 8.0
    assert d["rope_parameters"] == {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
    phi = _file(tmp_path, "phi3", {"{arch}.attention.sliding_window": (0, gguf.GGUFValueType.UINT32),
                                   "{arch}.rope.dimension_count": (12, gguf.GGUFValueType.UINT32)}, {})
    d = gguf_mod.hf_config(gguf_mod._metadata(GGUFReader(phi)))
    assert d["sliding_window"] is None and d["rope_parameters"]["partial_rotary_factor"] == 0.75
    config = ModelConfig.from_dict(json.loads(json.dumps(d | {"hidden_act": "silu"})))
    assert (config.rotary_dim, config.head_dim) == (12, 16)  # the engine rotates each head's first 12 dims
