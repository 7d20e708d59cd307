"""The engine on the Triton kernels (interpreted off-GPU) gives the same greedy tokens as HF transformers,
through prefill, decode, chunked prefill, prefix-cache hits and copy-on-write forks, with and without a sliding
window, and for a Gemma 2 whose windowed layers' scores are soft-capped."""

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
    llm = LLM(str(path), attention_backend="triton", block_size=16, max_num_batched_tokens=24)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    # Again: now the long prompts hit the prefix cache. Then n=2 forks share a partial block.
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.stats()["prefix_cache_hits"] > 0
    two = llm.generate(prompts[3:4], SamplingParams(n=2, temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert [c.token_ids for c in two.outputs] == [expected[3]] * 2
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_total_blocks"]
