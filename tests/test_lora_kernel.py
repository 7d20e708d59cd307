"""The Triton kernel of LoRA's products (kernels/gpu/lora_bgmv.py), in Triton's interpreter off-GPU: each token through
its own slot equals the products grouped by adapter with torch (kernels/lora_products.py); and the engine on the
Triton backend gives PEFT's tokens."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, LoRARequest
from pagedserve.kernels.lora_products import LoRAStep
from pagedserve.kernels.lora_products import add_lora as grouped

from .test_lora import GREEDY, make_adapter, peft_greedy


@pytest.mark.parametrize(("parts", "rank", "dtype"), [((48, 16, 16), 8, torch.float32), ((40, 40), 4, torch.float32),
                                                      ((64,), 16, torch.float32), ((48, 16, 16), 8, torch.bfloat16)])
def test_each_tokens_slot_through_the_kernel_equals_the_grouped_products(parts, rank, dtype):
    from pagedserve.kernels.gpu.lora_bgmv import add_lora

    gen = torch.Generator().manual_seed(0)
    slots, k, tokens = 3, 72, 11
    a = torch.randn(slots, len(parts) * rank, k, generator=gen).to(dtype)  # [S, parts * R, in]
    b = torch.randn(slots, sum(parts), rank, generator=gen).to(dtype)  # [S, out, R]
    a[1, :, :] = 0  # a slot whose adapter targets none of the parts
    x = torch.randn(tokens, k, generator=gen).to(dtype)
    out = torch.randn(tokens, sum(parts), generator=gen).to(dtype)
    token_slots = [0, 2, -1, 2, 2, 1, -1, 0, 0, 2, -1]
    groups = tuple((s, torch.tensor([t for t, ts in enumerate(token_slots) if ts == s])) for s in (0, 1, 2))
    want = grouped(x.float(), out.float().clone(), a.float(), b.float(), parts, LoRAStep(groups))
    got = add_lora(x, out.clone(), a, b, parts, torch.tensor(token_slots, dtype=torch.int32))
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    assert torch.allclose(got.float(), want, rtol=tolerance, atol=tolerance * 10)
    untouched = [t for t, s in enumerate(token_slots) if s in (-1, 1)]
    assert torch.equal(got[untouched], out[untouched])  # the base model's tokens, and a slot adding nothing


def test_the_engine_on_the_triton_backend_gives_pefts_tokens(tmp_path):
    pytest.importorskip("peft")  # a GPU node's image may lack it: the kernel's own test above runs there anyway
    import transformers

    from .test_lora import llama_config

    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(llama_config(), dtype=torch.float32).eval()
    base.save_pretrained(tmp_path / "base")
    make_adapter(base, tmp_path / "qkv", 4, 8, False, ["q_proj", "k_proj", "v_proj", "down_proj"], seed=1)
    prompts = [[5, 17, 200, 3, 9], [40, 41, 42]]
    adapters = [LoRARequest("qkv", 1, str(tmp_path / "qkv")), None]
    llm = LLM(str(tmp_path / "base"), attention_backend="triton", block_size=16, dtype="float32",
              enable_lora=True, max_lora_rank=8)
    outs = llm.generate(prompts, GREEDY, lora_request=adapters)
    assert [o.outputs[0].token_ids for o in outs] == [peft_greedy(tmp_path, "qkv", prompts[0]),
                                                      peft_greedy(tmp_path, None, prompts[1])]
