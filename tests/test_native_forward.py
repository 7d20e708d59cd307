"""The decoder's layers in one native call (kernels/cpu/csrc/decoder.c) against the modules they stand in for: the
same hidden states and the same KV pool, bit for bit, step after step (prefill, chunked prefill after a
cached prefix, decode), for Llama, Qwen2 (biases) and Qwen3 (q/k norms) layers on GGUF blocks of each type;
and the engine's outputs with and without it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

from pagedserve import LLM, SamplingParams
from pagedserve.kernels.backend import AttentionContext, get_attention_backend
from pagedserve.kernels.cpu import quant_linear
from pagedserve.kernels.cpu.native_forward import NativeForward, native_forward
from pagedserve.kernels.cpu.quant_linear import QuantLinear
from pagedserve.workers import model_runner
from pagedserve.workers.models.llama import CausalLM
from pagedserve.workers.models.model_config import ModelConfig

from .test_async_scheduling import PROMPTS

pytestmark = pytest.mark.skipif(not quant_linear.available(torch.device("cpu"), torch.float32),
                                reason="the GGUF linear kernel needs a C compiler and AVX2/FMA/F16C")

BLOCK = 16
CPU = get_attention_backend("cpu", torch.device("cpu"))


def _blocks(weight: torch.Tensor, qtype: str, bias: torch.Tensor | None) -> QuantLinear:
    rows = gguf_quantize(weight.detach().numpy(), GGMLQuantizationType[qtype])
    return QuantLinear(torch.from_numpy(rows), qtype, weight.shape[1], bias)


def tiny_gguf_model(model_type: str, **extra) -> CausalLM:
    """Two random layers whose projections are GGUF blocks of each kernel type; in the second layer q/k/v and
    gate/up are parts of different types (as llama-quantize's _M mixes make them). `extra`: config keys."""
    config = ModelConfig.from_dict(dict(model_type=model_type, vocab_size=300, hidden_size=64, intermediate_size=96,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=512, **extra))
    torch.manual_seed(0)
    model = CausalLM(config, 512).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + torch.randn_like(p) / 8 if "norm" in name else torch.randn_like(p) / 4)
    for i, layer in enumerate(model.model.layers):
        for owner, attr, qtypes in [(layer.self_attn, "qkv_proj", {64: "Q4_0", 96: "Q4_0", 128: "Q8_0"}),
                                    (layer.self_attn, "o_proj", {64: "Q4_1"}),
                                    (layer.mlp, "gate_up_proj", {96: "Q8_0", 192: "Q4_1"}),
                                    (layer.mlp, "down_proj", {64: "Q4_1"})]:
            old = getattr(owner, attr)
            if i == 0 or len(qtypes) == 1:
                setattr(owner, attr, _blocks(old.weight, next(iter(qtypes.values())), old.bias))
                continue
            parts, start = [], 0  # rows up to each end in its type: q and k Q4_0, v Q8_0; gate Q8_0, up Q4_1
            for end, qtype in qtypes.items():
                parts.append(_blocks(old.weight[start:end], qtype, None))
                start = end
            setattr(owner, attr, quant_linear.ConcatQuantLinear(parts, old.bias))
    return model


def steps(num_blocks: int):
    """(input ids, positions, context) of three steps over two sequences with their blocks in scattered order:
    both prefill (20 and 37 tokens); then one decodes while the other prefills 30 more after its cached 37;
    then both decode."""
    gen = torch.Generator().manual_seed(1)
    tables = torch.randperm(num_blocks, generator=gen)[:12].view(2, 6)  # [R, blocks]
    lens = [0, 0]
    for new in ([20, 37], [1, 30], [1, 1]):
        positions = torch.cat([torch.arange(lens[r], lens[r] + n) for r, n in enumerate(new)])  # [T]
        rows = torch.cat([torch.full((n,), r) for r, n in enumerate(new)])
        lens = [length + n for length, n in zip(lens, new, strict=True)]
        ctx = AttentionContext(CPU, tables[rows, positions // BLOCK] * BLOCK + positions % BLOCK,
                               torch.tensor([0, new[0], sum(new)]), torch.tensor(lens), tables, max(new), max(lens))
        yield torch.randint(0, 300, (sum(new),), generator=gen), positions, ctx


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_one_call_gives_the_modules_bits(model_type):
    model = tiny_gguf_model(model_type)
    assert model.config.qkv_bias == (model_type == "qwen2") and model.config.family.qk_norm == (model_type == "qwen3")
    config = model.config
    pools = [torch.zeros(config.num_layers, 2, 16, BLOCK, config.num_kv_heads, config.head_dim) for _ in range(2)]
    native = native_forward(model, pools[1], CPU)
    assert native is not None
    with torch.inference_mode():
        for input_ids, positions, ctx in steps(16):
            want = model(input_ids, positions, pools[0], ctx)
            got = native(input_ids, positions, ctx)
            assert torch.equal(got, want)
            assert torch.equal(pools[1], pools[0])


def test_models_it_does_not_cover_run_through_the_modules():
    model = tiny_gguf_model("llama")
    pool = torch.zeros(2, 2, 16, BLOCK, 2, 16)
    assert native_forward(model, pool, get_attention_backend("reference", torch.device("cpu"))) is None
    assert native_forward(model, pool.to(torch.bfloat16), CPU) is None
    model.model.layers[1].mlp.down_proj = torch.nn.Linear(96, 64)
    assert native_forward(model, pool, CPU) is None
    # OLMo 2's norms (after each sublayer, q/k over all heads) and Phi-3's partial rotary embedding: not decoder.c's
    assert native_forward(tiny_gguf_model("phi3"), pool, CPU) is not None
    assert native_forward(tiny_gguf_model("phi3", partial_rotary_factor=0.75), pool, CPU) is None
    assert native_forward(tiny_gguf_model("olmo2"), pool, CPU) is None


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_gemma_runs_through_the_modules(model_type):
    """Gemma's layers (sandwich norms, GELU, soft caps, windows, scaled embeddings) are not the driver's."""
    model = tiny_gguf_model(model_type)
    assert native_forward(model, torch.zeros(2, 2, 16, BLOCK, 2, 16), CPU) is None


@pytest.mark.parametrize("change", [dict(norms="sandwich"), dict(hidden_act="gelu_pytorch_tanh"),
                                    dict(attn_logit_softcapping=50.0)], ids=lambda c: next(iter(c)))
def test_each_gemma_difference_alone_steps_aside(change, monkeypatch):
    """Each on an otherwise covered Llama: none is left to the driver's Llama layers by another's check."""
    from pagedserve.workers.models import model_config

    model = tiny_gguf_model("llama")
    pool = torch.zeros(2, 2, 16, BLOCK, 2, 16)
    assert native_forward(model, pool, CPU) is not None
    if "norms" in change:  # the family's (`ModelConfig.family`), not the checkpoint's
        monkeypatch.setitem(model_config.FAMILIES, "llama", dataclasses.replace(model_config.FAMILIES["llama"],
                                                                                **change))
    else:
        model.config = dataclasses.replace(model.config, **change)
    assert native_forward(model, pool, CPU) is None


def test_a_slot_or_block_outside_the_pool_is_an_error():
    model = tiny_gguf_model("llama")
    native = NativeForward(model, torch.zeros(2, 2, 16, BLOCK, 2, 16))
    input_ids, positions, ctx = next(steps(16))
    bad = AttentionContext(CPU, ctx.slot_mapping.clone(), ctx.cu_seqlens_q, ctx.context_lens, ctx.block_tables,
                           ctx.max_query_len, ctx.max_context_len)
    bad.slot_mapping[3] = 16 * BLOCK
    with torch.inference_mode(), pytest.raises(IndexError, match="past the KV pool"):
        native(input_ids, positions, bad)
    bad = AttentionContext(CPU, ctx.slot_mapping, ctx.cu_seqlens_q, ctx.context_lens, ctx.block_tables.clone(),
                           ctx.max_query_len, ctx.max_context_len)
    bad.block_tables[1, 0] = 99
    with torch.inference_mode(), pytest.raises(ValueError, match="outside the KV pool"):
        native(input_ids, positions, bad)


def assert_same_outputs_with_it_as_without(model: str, prompts: list, params: list, monkeypatch, **llm_kwargs):
    """The engine's outputs (prompt logprobs, tokens, logprobs) with the one native call and, the driver made
    unavailable, with the modules: the same bits."""

    def outputs() -> tuple[bool, list]:
        with LLM(model, **llm_kwargs) as llm:
            used = llm.llm_engine.executor.worker.runner.native_forward is not None
            return used, [(o.prompt_logprobs, [(c.token_ids, c.logprobs) for c in o.outputs])
                          for o in llm.generate(prompts, params)]

    used, native = outputs()
    assert used, "the model's layers must run in the one native call"
    with monkeypatch.context() as patch:
        patch.setattr(model_runner, "native_forward", lambda *args: None)
        used, modules = outputs()
    assert not used
    assert native == modules


def test_the_engine_gives_the_same_outputs_with_it_as_without(embedded_dir, monkeypatch):
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=24, logprobs=2, prompt_logprobs=1)
              for i in range(len(PROMPTS))]
    assert_same_outputs_with_it_as_without(str(embedded_dir), PROMPTS, params, monkeypatch,
                                           max_num_batched_tokens=64)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_layers_in_the_one_call_give_the_modules_outputs(tmp_path, monkeypatch, family):
    """Mixtral's and Qwen3-MoE's layers (one of them dense) in the one native call: its router on the kernel, the
    routing kernel, the experts' native call; the same tokens and logprobs, to the bit, as the modules."""
    import transformers

    cls, extra = {"qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, moe_intermediate_size=64, norm_topk_prob=True,
                                                        mlp_only_layers=[1], head_dim=16)),
                  "mixtral": ("MixtralConfig", dict(num_local_experts=4))}[family]
    config = getattr(transformers, cls)(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2, **extra)
    torch.manual_seed(8)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (5, 33, 12)]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=16, logprobs=2) for i in range(3)]
    assert_same_outputs_with_it_as_without(str(tmp_path), prompts, params, monkeypatch, block_size=BLOCK,
                                           max_num_batched_tokens=24)
