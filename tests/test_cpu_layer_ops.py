"""The CPU backend's native RMSNorm (of rows, and of each head) and SiLU gate (csrc/layer_ops.c) against
transformers' formulas: within an ulp or two (their sum of squares and exp are their own), and the same bits
for a row alone as in any batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu import native
from pagedserve.kernels.cpu import ops as cpu

pytestmark = pytest.mark.skipif(native.layer_ops_library() is None, reason="no C compiler: layer_ops.c not built")


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, op for op, in float64 (the exact value the kernel rounds)."""
    h = x.double()
    return weight.double() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("hidden", [64, 576, 901])  # 901: a tail past the 8-lane sums
def test_rms_norm_matches_transformers_and_adds_the_residual_in_place(hidden):
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(70, hidden, generator=gen) * 3  # 70 rows: the threaded loop
    residual = torch.randn(70, hidden, generator=gen)
    weight = 1 + torch.randn(hidden, generator=gen) / 4
    total = residual + x  # rounded as the kernel's add rounds it
    out = cpu.rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(residual, total), "the residual must hold residual + x"
    torch.testing.assert_close(out.double(), hf_rms_norm(total, weight, 1e-6), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(cpu.rms_norm(x, weight, 1e-6).double(), hf_rms_norm(x, weight, 1e-6), atol=1e-6,
                               rtol=1e-6)


def test_per_head_norm_of_a_strided_view():
    """Qwen3's q/k norms: each head of q [T, heads, D], a view into the fused qkv projection's rows."""
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(6, 4 * 64 + 2 * 2 * 64, generator=gen) * 2  # [T, (Hq + 2 Hkv) * D]
    q = qkv[:, :256].view(6, 4, 64)  # [T, Hq, D], rows 384 apart
    weight = 1 + torch.randn(64, generator=gen) / 4
    out = cpu.rms_norm_heads(q, weight, 1e-6)
    assert out.shape == (6, 4, 64) and out.is_contiguous()
    torch.testing.assert_close(out.double(), hf_rms_norm(q, weight, 1e-6), atol=1e-6, rtol=1e-6)
    assert torch.equal(out[:, 2], cpu.rms_norm(q[:, 2].contiguous(), weight, 1e-6)), "the same arithmetic per head"


@pytest.mark.parametrize("width", [1536, 13])  # 13: a gate whose last lanes are padding
def test_silu_gate_matches_transformers(width):
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(40, 2 * width, generator=gen) * 6
    x[0, :8] = torch.tensor([-200.0, -88.0, -30.0, -1e-8, 0.0, 1e-8, 30.0, 200.0])  # both clamps of exp
    gate, up = x.double().chunk(2, dim=-1)
    out = cpu.silu_mul(x)
    assert out.shape == (40, width) and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), gate / (1 + torch.exp(-gate)) * up, atol=1e-30, rtol=1e-6)
    g, u = x.chunk(2, dim=-1)
    torch.testing.assert_close(out, F.silu(g) * u, atol=1e-30, rtol=1e-6)


def test_a_row_gets_the_same_bits_in_any_batch():
    gen = torch.Generator().manual_seed(0)
    x, residual = torch.randn(100, 576, generator=gen), torch.randn(100, 576, generator=gen)
    weight, gate_up = torch.randn(576, generator=gen), torch.randn(100, 2 * 1536, generator=gen)
    together_residual = residual.clone()
    together = cpu.rms_norm(x, weight, 1e-5, together_residual)
    gates = cpu.silu_mul(gate_up)
    for i in (0, 37, 99):
        row_residual = residual[i:i + 1].clone()
        assert torch.equal(cpu.rms_norm(x[i:i + 1], weight, 1e-5, row_residual), together[i:i + 1])
        assert torch.equal(row_residual, together_residual[i:i + 1])
        assert torch.equal(cpu.silu_mul(gate_up[i:i + 1]), gates[i:i + 1])


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="rms_norm needs x"):
        cpu.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-5)
    with pytest.raises(ValueError, match="rms_norm needs x"):
        cpu.rms_norm(torch.randn(2, 8), torch.randn(8), 1e-5, torch.randn(3, 8))
    with pytest.raises(ValueError, match="rms_norm_heads needs x"):
        cpu.rms_norm_heads(torch.randn(2, 3, 8), torch.randn(4), 1e-5)
    with pytest.raises(ValueError, match="silu_mul needs x"):
        cpu.silu_mul(torch.randn(2, 7))
