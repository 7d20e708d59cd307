"""The engine on the Triton kernels (interpreted off-GPU) gives the same greedy tokens as HF transformers,
through prefill, decode, chunked prefill, prefix-cache hits and copy-on-write forks, with and without a sliding
window, and for a Gemma 2 whose windowed layers' scores are soft-capped; and OLMo 2's and LongRoPE Phi-3's
logprobs."""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401

from pagedserve import LLM, SamplingParams

from .test_parity import hf_greedy

# Qwen2 in full, and with a sliding window of 10 positions on its second layer (prompts run past it); Gemma 2
# with a window of 10 on its first layer and attention soft caps that bite (large enough weights) on both.
MODELS = {
    "qwen2-full": ("Qwen2Config", {}),
    "qwen2-window": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=10, max_window_layers=1)),
    "gemma2-softcap": ("Gemma2Config", dict(sliding_window=10, attn_logit_softcapping=3.0, final_logit_softcapping=2.0,
                                            query_pre_attn_scalar=24, initializer_range=0.2)),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def tiny_model(request, tmp_path_factory):
    import transformers

    cls_name, extra = MODELS[request.param]
    config = getattr(transformers, cls_name)(vocab_size=300, hidden_size=64, intermediate_size=96,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=256, **extra)
    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp(f"triton_{request.param}")
    model.save_pretrained(path)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (1, 15, 16, 17, 40)]
    return path, prompts, hf_greedy(model, prompts, new_tokens=12)


def test_triton_backend_matches_transformers(tiny_model):
    path, prompts, expected = tiny_model
    llm = LLM(str(path), attention_backend="triton", block_size=16, max_num_batched_tokens=24, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    # Again, the prompts of more than a block: now they hit the prefix cache. Then n=2 forks share a partial block.
    assert [o.outputs[0].token_ids for o in llm.generate(prompts[3:], params)] == expected[3:]
    assert llm.stats()["prefix_cache_hits"] > 0
    two = llm.generate(prompts[3:4], SamplingParams(n=2, temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert [c.token_ids for c in two.outputs] == [expected[3]] * 2
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_total_blocks"]


# Families whose layers take other paths through the Triton kernels: OLMo 2's norms after each sublayer (the norm
# kernel without a residual add) and its q/k norms over all heads; Phi-4-mini's rotation of 0.75 of each head under
# LongRoPE (the 40-token prompt past original_max_position_embeddings, the 17-token one growing past it); Qwen3's
# q/k norms per head (the per-head norm kernel).
FAMILIES = {
    "olmo2": ("Olmo2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "phi3-longrope": ("Phi3Config", {"original_max_position_embeddings": 24, "partial_rotary_factor": 0.75,
                                     "rope_scaling": {"rope_type": "longrope",
                                                      "short_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 5.0],
                                                      "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]}}),
    # A mixture of experts beside the kernels: its router, experts and shared expert (the backend's SiLU gate).
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                     "shared_expert_intermediate_size": 64}),
    # gpt-oss: attention sinks in the prefill, decode and merge kernels (a window of 8 on its first layer), and the
    # fused MoE kernel with its biases and clamped SwiGLU.
    "gpt_oss": ("GptOssConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16,
                                 "sliding_window": 8}),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_triton_backend_matches_transformers_logprobs_for_other_layers(family, tmp_path):
    import transformers

    from .test_parity import hf_logprobs

    cls_name, extra = FAMILIES[family]
    config = getattr(transformers, cls_name)(vocab_size=300, hidden_size=64, intermediate_size=96,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=256, pad_token_id=0, **extra)
    torch.manual_seed(6)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.3)
            if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight", "mlp.router.weight")):
                param.normal_(0.0, 0.3)  # no near ties among experts
            if name.endswith(("_bias", ".sinks")):  # gpt-oss's, zeros as initialised
                param.normal_(0.0, 0.5)
    model.save_pretrained(tmp_path)
    gen = torch.Generator().manual_seed(12)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (1, 17, 40)]
    llm = LLM(str(tmp_path), attention_backend="triton", block_size=16, max_num_batched_tokens=24, dtype="float32")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0))
    for prompt, out in zip(prompts, outs, strict=True):
        tokens, logprobs = hf_logprobs(model, prompt, new_tokens=12)
        assert out.outputs[0].token_ids == tokens
        got = [e.logprob for e in out.outputs[0].logprobs]
        assert max(abs(a - b) for a, b in zip(got, logprobs, strict=True)) < 1e-4
