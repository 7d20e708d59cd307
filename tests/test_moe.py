"""The sparse MoE block's parts against plain definitions: the grouped expert compute against a loop over each
token's experts, the router against transformers' routers, and a block split across tensor-parallel shards
against the whole one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.workers.models.moe import grouped_experts, route


def per_token(x, weights, experts, gate_up, down):
    """Each token through each of its experts, one at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), experts[t].tolist(), strict=True):
            gate, up = F.linear(x[t], gate_up[e]).chunk(2)
            out[t] += w * F.linear(F.silu(gate) * up, down[e])
    return out


@pytest.mark.parametrize("num_tokens, num_experts, top_k", [(1, 4, 2), (7, 8, 2), (33, 8, 3), (5, 4, 4)])
def test_grouped_experts_equal_a_loop_over_each_tokens_experts(num_tokens, num_experts, top_k):
    gen = torch.Generator().manual_seed(num_tokens * 100 + top_k)
    hidden, inter = 32, 24
    x = torch.randn(num_tokens, hidden, generator=gen)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.2
    down = torch.randn(num_experts, hidden, inter, generator=gen) * 0.2
    weights, experts = route(torch.randn(num_tokens, num_experts, generator=gen), top_k, renormalize=True)
    got = grouped_experts(x, weights, experts, gate_up, down)
    torch.testing.assert_close(got, per_token(x, weights, experts, gate_up, down), rtol=1e-5, atol=1e-5)


def test_only_the_routed_experts_are_read():
    """An expert no token is routed to is never computed: NaN weights there change nothing."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 16, generator=gen)
    gate_up, down = torch.randn(4, 20, 16, generator=gen), torch.randn(4, 16, 10, generator=gen)
    experts = torch.tensor([[0, 2]] * 6)
    weights = torch.full((6, 2), 0.5)
    gate_up[1], down[3] = float("nan"), float("nan")
    got = grouped_experts(x, weights, experts, gate_up, down)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, per_token(x, weights, experts, gate_up, down), rtol=1e-5, atol=1e-5)


def test_split_experts_sum_to_the_whole():
    """Tensor parallelism's split: each rank's columns of every expert give partial sums that add up to the block's
    output (what the all-reduce computes)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, 16, generator=gen)
    inter = 12
    gate_up, down = torch.randn(4, 2 * inter, 16, generator=gen), torch.randn(4, 16, inter, generator=gen)
    weights, experts = route(torch.randn(9, 4, generator=gen), 2, renormalize=False)
    whole = grouped_experts(x, weights, experts, gate_up, down)
    half = inter // 2
    parts = []
    for r in range(2):
        cols = slice(r * half, (r + 1) * half)
        shard = torch.cat([gate_up[:, :inter][:, cols], gate_up[:, inter:][:, cols]], dim=1)
        parts.append(grouped_experts(x, weights, experts, shard, down[:, :, cols]))
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_routing_is_transformers_routers(family, norm_topk_prob):
    """The same weights and expert ids, bit for bit, as each family's transformers router."""
    import importlib

    import transformers

    config_cls, router_cls = {"mixtral": ("MixtralConfig", "MixtralTopKRouter"),
                              "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeTopKRouter"),
                              "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeTopKRouter")}[family]
    kwargs = dict(hidden_size=32, num_experts_per_tok=3)
    kwargs |= {"num_local_experts": 8} if family == "mixtral" else {"num_experts": 8, "norm_topk_prob": norm_topk_prob}
    config = getattr(transformers, config_cls)(**kwargs)
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    router = getattr(module, router_cls)(config)
    torch.nn.init.normal_(router.weight, std=0.5)
    x = torch.randn(11, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, ref_weights, ref_experts = router(x)
        weights, experts = route(F.linear(x, router.weight), 3, family == "mixtral" or norm_topk_prob)
    assert torch.equal(experts, ref_experts)
    assert torch.equal(weights, ref_weights)


@pytest.mark.parametrize("layout", ["original", "stacked"])
def test_each_rank_loads_its_columns_of_every_expert(tmp_path, layout):
    """Under tensor parallelism 2 each rank holds its half of every expert's intermediate dimension (gate and up
    columns, down rows) and of the shared expert's, and the whole router, from either checkpoint layout."""
    import transformers

    from pagedserve.workers.loader import build_model, resolve_model
    from pagedserve.workers.models.model_config import ModelConfig
    from pagedserve.workers.models.parallel import TPLayout

    config = transformers.Qwen2MoeConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=16,
                                         shared_expert_intermediate_size=24, mlp_only_layers=[1])
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path, save_original_format=layout == "original")
    ours = ModelConfig.from_file(tmp_path / "config.json")
    assert ours.moe_layers == (True, False)
    moe = hf.model.layers[0].mlp
    gate_up, down = moe.experts.gate_up_proj.detach(), moe.experts.down_proj.detach()  # [E, 2I, H], [E, H, I]
    shared = moe.shared_expert
    for rank in range(2):
        tp = TPLayout.make(ours, rank, 2)
        model = build_model(resolve_model(str(tmp_path)), ours, torch.float32, torch.device("cpu"), 64, tp=tp)
        block = model.model.layers[0].mlp
        cols = slice(rank * 8, rank * 8 + 8)
        torch.testing.assert_close(block.experts.gate_up_proj,
                                   torch.cat([gate_up[:, :16][:, cols], gate_up[:, 16:][:, cols]], dim=1),
                                   rtol=0, atol=0)
        torch.testing.assert_close(block.experts.down_proj, down[:, :, cols], rtol=0, atol=0)
        torch.testing.assert_close(block.gate.weight, moe.gate.weight.detach(), rtol=0, atol=0)
        shared_cols = slice(rank * 12, rank * 12 + 12)
        shared_gate_up = torch.cat([shared.gate_proj.weight[shared_cols], shared.up_proj.weight[shared_cols]])
        torch.testing.assert_close(block.shared_expert.gate_up_proj.weight, shared_gate_up, rtol=0, atol=0)
        torch.testing.assert_close(block.shared_expert.down_proj.weight, shared.down_proj.weight[:, shared_cols],
                                   rtol=0, atol=0)
        torch.testing.assert_close(block.shared_expert_gate.weight, moe.shared_expert_gate.weight.detach(),
                                   rtol=0, atol=0)
        dense = model.model.layers[1].mlp  # mlp_only_layers: a dense MLP of intermediate_size
        assert dense.gate_up_proj.weight.shape == (64, 32)


# --- the fused kernel (Triton: on a GPU where there is one, else in Triton's interpreter) -----------------------

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def expert_weights(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    down = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    return gate_up.to(DEVICE, dtype), down.to(DEVICE, dtype)


@pytest.mark.parametrize("num_tokens, num_experts, top_k, hidden, inter", [
    (1, 8, 2, 64, 32),     # a decode step of one sequence: two experts of eight hold a row each
    (5, 4, 4, 48, 24),     # every expert for every token; sizes no multiple of the tiles
    (40, 8, 2, 96, 80),    # runs longer than one block of rows
    (3, 60, 4, 64, 32),    # most experts idle (Qwen2-MoE has 60)
])
def test_fused_experts_equal_the_loop_over_experts(num_tokens, num_experts, top_k, hidden, inter):
    pytest.importorskip("triton")
    from pagedserve.kernels.gpu.fused_moe import fused_experts

    gen = torch.Generator().manual_seed(num_tokens + num_experts)
    gate_up, down = expert_weights(num_experts, hidden, inter, torch.float32, num_tokens)
    x = torch.randn(num_tokens, hidden, generator=gen).to(DEVICE)
    weights, experts = route(torch.randn(num_tokens, num_experts, generator=gen).to(DEVICE), top_k, True)
    got = fused_experts(x, weights, experts, gate_up, down)
    torch.testing.assert_close(got, grouped_experts(x, weights, experts, gate_up, down), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_experts_in_16_bits_stay_near_fp32(dtype):
    pytest.importorskip("triton")
    from pagedserve.kernels.gpu.fused_moe import fused_experts

    gen = torch.Generator().manual_seed(3)
    gate_up, down = expert_weights(8, 64, 48, torch.float32, 3)
    x = torch.randn(20, 64, generator=gen).to(DEVICE)
    weights, experts = route(torch.randn(20, 8, generator=gen).to(DEVICE), 2, True)
    exact = grouped_experts(x, weights, experts, gate_up, down)
    got = fused_experts(x.to(dtype), weights.to(dtype), experts, gate_up.to(dtype), down.to(dtype))
    assert got.dtype == dtype
    # 16-bit operands and roundings land between 1e-3 and 1e-2 (the interpreter's bf16 stores truncate: 2e-2)
    bound = 2e-2 if dtype == torch.bfloat16 and DEVICE.type == "cpu" else 1e-2
    assert ((got.float() - exact).norm() / exact.norm()).item() < bound


def test_pairs_align_by_expert_in_blocks_of_one_expert():
    """The sorted layout the grouped GEMMs read: every pair once, each expert's run padded to whole blocks, every
    block of rows one expert's (or -1 past the last run), sizes from the token count alone."""
    from pagedserve.kernels.gpu.fused_moe import align_pairs

    experts = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2], [1, 3]])  # expert 3 holds 5 pairs, 0 and 1 two, 2 one
    sorted_pairs, block_experts = align_pairs(experts, num_experts=5, block_m=4)
    num_pairs = experts.numel()
    assert sorted_pairs.numel() == 4 * -(-(num_pairs + 5 * 3) // 4) == 28
    assert sorted(p for p in sorted_pairs.tolist() if p < num_pairs) == list(range(num_pairs))
    for block, expert in enumerate(block_experts.tolist()):
        pairs = [p for p in sorted_pairs[block * 4:(block + 1) * 4].tolist() if p < num_pairs]
        if expert < 0:
            assert not pairs
        else:
            assert pairs and all(experts.reshape(-1)[p] == expert for p in pairs)
    assert block_experts.tolist() == [0, 1, 2, 3, 3, -1, -1]  # expert 4 has no pairs: no block


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU")
def test_fused_experts_replay_from_a_cuda_graph_with_new_routes():
    """Nothing in the fused path waits for the host: captured once, a graph computes other routes correctly."""
    from pagedserve.kernels.gpu.fused_moe import fused_experts

    gate_up, down = expert_weights(8, 64, 32, torch.float32, 4)
    x = torch.randn(6, 64, device=DEVICE)
    weights, experts = route(torch.randn(6, 8, device=DEVICE), 2, True)
    fused_experts(x, weights, experts, gate_up, down)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, weights, experts, gate_up, down)
    for seed in range(3):
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        x.copy_(torch.randn(6, 64, device=DEVICE, generator=gen))
        w, e = route(torch.randn(6, 8, device=DEVICE, generator=gen), 2, True)
        weights.copy_(w)
        experts.copy_(e)
        graph.replay()
        torch.testing.assert_close(out, grouped_experts(x, weights, experts, gate_up, down), rtol=1e-5, atol=1e-5)


# --- gpt-oss: its router, its experts' clamped SwiGLU and biases, its checkpoints' layouts -----------------------


def gpt_oss_config(**kwargs):
    import transformers

    return transformers.GptOssConfig(**dict(vocab_size=100, hidden_size=32, intermediate_size=64, head_dim=8,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            num_local_experts=4, num_experts_per_tok=2, sliding_window=8) | kwargs)


def test_top_k_first_routing_is_gpt_oss_router():
    """The biased logits' top k, then their softmax: the same weights and ids, bit for bit."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    router = GptOssTopKRouter(gpt_oss_config(num_local_experts=8, num_experts_per_tok=3))
    torch.nn.init.normal_(router.weight, std=0.5)
    torch.nn.init.normal_(router.bias, std=0.5)
    x = torch.randn(11, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        _, ref_weights, ref_experts = router(x)
        weights, experts = route(F.linear(x, router.weight, router.bias), 3, False, top_k_first=True)
    assert torch.equal(experts, ref_experts)
    assert torch.equal(weights, ref_weights)


def test_grouped_experts_with_biases_and_the_clamped_swiglu_are_gpt_oss_experts():
    """transformers' GptOssExperts (transposed weights, gate and up interleaved) against the loop over experts on
    the layout the loader makes of them; inputs large enough that the clamps bite."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from pagedserve.workers.models.moe import ClampedSwiGLU

    config = gpt_oss_config(swiglu_limit=1.5)
    module = GptOssExperts(config)
    gen = torch.Generator().manual_seed(5)
    for param in module.parameters():
        param.data = torch.randn(param.shape, generator=gen) * 0.5
    x = torch.randn(9, 32, generator=gen) * 2
    weights, experts = route(torch.randn(9, 4, generator=gen), 2, False, top_k_first=True)
    with torch.no_grad():
        expected = module(x, experts, weights)
        gate_up = module.gate_up_proj.transpose(1, 2)  # [E, 2I, H], rows interleaved
        gate_up = torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1)
        bias = torch.cat([module.gate_up_proj_bias[:, 0::2], module.gate_up_proj_bias[:, 1::2]], dim=1)
        got = grouped_experts(x, weights, experts, gate_up, module.down_proj.transpose(1, 2), bias,
                              module.down_proj_bias, ClampedSwiGLU(1.5, config.swiglu_alpha))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    plain = grouped_experts(x, weights, experts, gate_up, module.down_proj.transpose(1, 2).detach())
    assert not torch.allclose(plain, expected, atol=1e-2)


def test_mxfp4_dequantization_is_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from pagedserve.workers.gpt_oss_weights import dequantize_mxfp4

    gen = torch.Generator().manual_seed(6)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(110, 140, (3, 10, 4), dtype=torch.uint8, generator=gen)
    expected = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, cols, rows]: transposed
    assert torch.equal(dequantize_mxfp4(blocks, scales).transpose(1, 2), expected)
    with pytest.raises(ValueError, match=r"blocks must be \[..., G, 16\] beside scales \[..., G\]"):
        dequantize_mxfp4(blocks, scales[:, :, :3])


def load_dequantized(path):
    """transformers' model of an MXFP4 checkpoint, its experts dequantized to fp32 (as it does on a CPU; asked for
    here, so that a machine with a GPU does the same)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()


def save_mxfp4(model, path) -> None:
    """`model`'s checkpoint with its experts' projections in MXFP4 (random codes and scales), as OpenAI's gpt-oss
    checkpoints store them: blocks and scales untransposed ([E, rows, cols / 32, ...])."""
    import json

    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(8)
    tensors = {}
    for name, param in model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            num, cols, rows = param.shape
            tensors[name + "_blocks"] = torch.randint(0, 256, (num, rows, cols // 32, 16), dtype=torch.uint8,
                                                      generator=gen)
            tensors[name + "_scales"] = torch.randint(119, 124, (num, rows, cols // 32), dtype=torch.uint8,
                                                      generator=gen)
        else:
            tensors[name] = param.contiguous()
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict() | {"quantization_config": {
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                            "model.embed_tokens", "lm_head"]}}
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("layout", ["bf16", "mxfp4"])
def test_each_rank_loads_its_columns_of_every_gpt_oss_expert(tmp_path, layout):
    """Under tensor parallelism 2 each rank holds its half of every expert's gate and up columns (de-interleaved)
    and of their biases, its down rows, its heads' sinks, the whole router and down biases, from the checkpoint
    transformers writes and from an MXFP4 one (dequantized, exactly transformers' weights)."""
    import transformers

    from pagedserve.workers.loader import build_model, resolve_model
    from pagedserve.workers.models.model_config import ModelConfig
    from pagedserve.workers.models.parallel import TPLayout

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(gpt_oss_config(), dtype=torch.float32).eval()
    for name, param in hf.named_parameters():
        if name.endswith(("_bias", "sinks")):
            torch.nn.init.normal_(param, std=0.5)
    if layout == "bf16":
        hf.save_pretrained(tmp_path)
    else:
        save_mxfp4(hf, tmp_path)
        hf = load_dequantized(tmp_path)
    ours = ModelConfig.from_file(tmp_path / "config.json")
    layer = hf.model.layers[0]
    gate_up, down = layer.mlp.experts.gate_up_proj.detach(), layer.mlp.experts.down_proj.detach()  # [E, H, 2I]
    bias = layer.mlp.experts.gate_up_proj_bias.detach()  # [E, 2I]
    for rank in range(2):
        model = build_model(resolve_model(str(tmp_path)), ours, torch.float32, torch.device("cpu"), 64,
                            tp=TPLayout.make(ours, rank, 2))
        block, attn = model.model.layers[0].mlp, model.model.layers[0].self_attn
        cols = slice(rank * 32, rank * 32 + 32)
        gate, up = gate_up[..., 0::2][..., cols], gate_up[..., 1::2][..., cols]  # [E, H, I / 2]
        torch.testing.assert_close(block.experts.gate_up_proj, torch.cat([gate, up], dim=2).transpose(1, 2),
                                   rtol=0, atol=0)
        torch.testing.assert_close(block.experts.gate_up_proj_bias,
                                   torch.cat([bias[:, 0::2][:, cols], bias[:, 1::2][:, cols]], dim=1), rtol=0, atol=0)
        torch.testing.assert_close(block.experts.down_proj, down[:, cols].transpose(1, 2), rtol=0, atol=0)
        torch.testing.assert_close(block.experts.down_proj_bias, layer.mlp.experts.down_proj_bias.detach(),
                                   rtol=0, atol=0)
        torch.testing.assert_close(block.gate.bias, layer.mlp.router.bias.detach(), rtol=0, atol=0)
        torch.testing.assert_close(attn.sinks, layer.self_attn.sinks.detach()[rank * 2:rank * 2 + 2], rtol=0, atol=0)


def test_fused_experts_with_biases_and_the_clamped_swiglu_equal_the_loop():
    pytest.importorskip("triton")
    from pagedserve.kernels.gpu.fused_moe import fused_experts
    from pagedserve.workers.models.moe import ClampedSwiGLU

    gen = torch.Generator().manual_seed(9)
    gate_up, down = expert_weights(8, 64, 40, torch.float32, 9)
    gate_up_bias = torch.randn(8, 80, generator=gen).to(DEVICE)
    down_bias = torch.randn(8, 64, generator=gen).to(DEVICE)
    x = torch.randn(13, 64, generator=gen).to(DEVICE) * 3
    weights, experts = route(torch.randn(13, 8, generator=gen).to(DEVICE), 2, False, top_k_first=True)
    act = ClampedSwiGLU(1.0, 1.702)
    got = fused_experts(x, weights, experts, gate_up, down, gate_up_bias, down_bias, act)
    expected = grouped_experts(x, weights, experts, gate_up, down, gate_up_bias, down_bias, act)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# --- experts on the CPU's linear kernel ---------------------------------------------------------------------------


def test_on_the_cpu_kernel_an_experts_rows_get_the_same_bits_in_any_batch(tmp_path):
    """A Qwen3-MoE's fp32 experts on the kernel's panels (as every CPU fp32 model's are): a request's logprobs are
    the same bits alone and among others that route other tokens to its experts, and its tokens are
    transformers'."""
    import transformers

    from pagedserve import LLM, SamplingParams

    from .test_parity import decisive_routers, hf_logprobs

    config = transformers.Qwen3MoeConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                                         num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True)
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    decisive_routers(model)
    model.save_pretrained(tmp_path)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (30, 7, 50, 12, 41)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)

    def exact(out):
        return [(e.token_id, e.logprob, [(t.token_id, t.logprob) for t in e.top_logprobs])
                for e in out.outputs[0].logprobs]

    with LLM(str(tmp_path), block_size=16, device="cpu") as llm:  # the CPU kernels, also where there is a GPU
        experts = [m for m in llm.llm_engine.executor.worker.model.modules() if hasattr(m, "gate_up_linears")]
        assert experts and all(e.gate_up_linears is not None and e.gate_up_proj is None and e.native is not None
                               for e in experts)
        alone = exact(llm.generate(prompts[:1], params)[0])
        among = exact(llm.generate(prompts[1:] + prompts[:1], params)[-1])
    assert among == alone
    assert [e[0] for e in alone] == hf_logprobs(model, prompts[0], new_tokens=12)[0]


@pytest.mark.parametrize("num_tokens, top_k", [(1, 2), (1, 8), (13, 2), (40, 4)])
def test_the_native_experts_call_gives_the_loops_bits(num_tokens, top_k):
    """One native call (csrc/decoder.c `moe_experts`) against the loop over experts on the same kernel layers and
    the CPU backend's SiLU gate: the same bits, experts with no token included; parts of two types (Q8_0 gate
    beside fp32 up) too."""
    from pagedserve.kernels.cpu import ops
    from pagedserve.kernels.cpu.native_forward import NativeExperts
    from pagedserve.kernels.cpu.quant_linear import ConcatQuantLinear, QuantLinear

    pytest.importorskip("gguf")  # the Q8_0 part's blocks (the GPU machine has no gguf)
    if not ops.available():
        pytest.skip("the CPU kernels need a C compiler")
    gen = torch.Generator().manual_seed(num_tokens * 10 + top_k)
    hidden, inter, num = 64, 96, 8
    gate_up_w = torch.randn(num, 2 * inter, hidden, generator=gen) * 0.1
    down_w = torch.randn(num, hidden, inter, generator=gen) * 0.1
    gate_up = [QuantLinear.from_fp32(w, None) for w in gate_up_w[:4]]
    gate_up += [ConcatQuantLinear([QuantLinear(quantized_rows(w[:inter]), "Q8_0", hidden, None),
                                   QuantLinear.from_fp32(w[inter:], None)], None) for w in gate_up_w[4:]]
    down = [QuantLinear.from_fp32(w, None) for w in down_w]
    assert NativeExperts.covers(gate_up, down)
    native = NativeExperts(gate_up, down, hidden)
    x = torch.randn(num_tokens, hidden, generator=gen)
    weights, experts = route(torch.randn(num_tokens, num, generator=gen), top_k, renormalize=True)
    got = native(x, weights, experts)
    expected = grouped_experts(x, weights, experts, gate_up, down, activation=ops.silu_mul)
    assert torch.equal(got, expected)
    # and within rounding of torch's own SiLU (the kernel's exp is its own)
    torch.testing.assert_close(got, grouped_experts(x, weights, experts, gate_up, down), rtol=1e-5, atol=1e-5)


def quantized_rows(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] as GGUF Q8_0 rows of blocks."""
    import gguf

    return torch.from_numpy(gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.Q8_0))


@pytest.mark.parametrize("renormalize", [False, True])
def test_the_cpu_routing_kernel_picks_torchs_experts(renormalize):
    """The CPU backend's routing (one native call, its own exp) against the torch route: the same experts in the
    same order, weights within an ulp or two; a row alone gets the bits it gets in a batch."""
    from pagedserve.kernels.cpu import ops

    logits = torch.randn(33, 16, generator=torch.Generator().manual_seed(11)) * 2
    routed = ops.route_topk(logits, 4, renormalize)
    if routed is None:
        pytest.skip("the CPU kernels need a C compiler")
    weights, experts = routed
    ref_weights, ref_experts = route(logits, 4, renormalize)
    assert torch.equal(experts, ref_experts)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-7)
    alone_weights, alone_experts = ops.route_topk(logits[5:6], 4, renormalize)
    assert torch.equal(alone_weights, weights[5:6]) and torch.equal(alone_experts, experts[5:6])
