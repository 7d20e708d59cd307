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
