"""Linear layers with oneDNN-packed weights compute what F.linear computes, and a packed model's forward
matches the unpacked one (the HF parity tests run packed end to end)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels.backend import AttentionContext, get_attention_backend
from pagedserve.kernels.cpu.packed_linear import PackedLinear, can_pack, pack_linears
from pagedserve.workers.loader import build_model, resolve_model
from pagedserve.workers.models.llama import linear_product
from pagedserve.workers.models.model_config import ModelConfig

pytestmark = pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.float32),
                                reason="oneDNN cannot pack fp32 weights on this CPU")


@pytest.mark.parametrize("rows", [1, 5, 16, 300])
def test_packed_linear_matches_f_linear(rows):
    gen = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(rows, 64, generator=gen)
    packed = PackedLinear(w, b, batch_hint=16)
    torch.testing.assert_close(packed(x), F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(linear_product(packed, x), x @ w.T, atol=1e-4, rtol=1e-5)
    assert packed(x.view(rows, 1, 64)).shape == (rows, 1, 96)  # leading dims kept


def test_can_pack_only_cpu_and_supported_dtypes():
    assert not can_pack(torch.device("meta"), torch.float32)
    assert not can_pack(torch.device("cpu"), torch.float16)


def test_packed_model_matches_unpacked(tiny_random):
    source = resolve_model(tiny_random)
    config = ModelConfig.from_file(source.config_path)
    plain = build_model(source, config, torch.float32, torch.device("cpu"), 64, seed=3)
    packed = build_model(source, config, torch.float32, torch.device("cpu"), 64, seed=3)
    pack_linears(packed, batch_hint=16)
    assert not any(isinstance(m, torch.nn.Linear) for m in packed.modules())
    tokens = 11
    ids = torch.randint(0, config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(tokens)
    reference = get_attention_backend("reference", torch.device("cpu"))
    outs = []
    for model in (plain, packed):
        pool = torch.zeros(config.num_layers, 2, 1, 16, config.num_kv_heads, config.head_dim)
        ctx = AttentionContext(backend=reference, slot_mapping=positions, cu_seqlens_q=torch.tensor([0, tokens]),
                               context_lens=torch.tensor([tokens]), block_tables=torch.tensor([[0]]),
                               max_query_len=tokens, max_context_len=tokens)
        with torch.inference_mode():
            outs.append(model.compute_logits(model(ids, positions, pool, ctx)))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-4)
