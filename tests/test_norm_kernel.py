"""The Triton RMSNorm (and its fused residual add) against transformers' order of operations, in Triton's
interpreter off-GPU (TRITON_INTERPRET=1, set in conftest.py). The interpreter mishandles bf16, so bf16 runs
only on a GPU."""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401

from pagedserve.kernels.gpu.norm import rms_norm

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
# One unit in the last place of each dtype's values near 1: the kernel sums squares in another order.
ULP = {torch.float32: 2e-7, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, op for op."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [64, 96, 896])  # a power of two, and two that are not (masked lanes)
def test_rms_norm_matches_transformers(dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(5, hidden, generator=gen) * 3).to(dtype).to(DEVICE)
    weight = (1 + torch.randn(hidden, generator=gen) / 4).to(dtype).to(DEVICE)
    out = rms_norm(x, weight, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, hf_rms_norm(x, weight, 1e-6), atol=ULP[dtype], rtol=ULP[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_add_updates_the_residual_and_normalizes_the_sum(dtype):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(6, 80, generator=gen).to(dtype).to(DEVICE)
    residual = torch.randn(6, 80, generator=gen).to(dtype).to(DEVICE)
    weight = torch.rand(80, generator=gen).to(dtype).to(DEVICE)
    expected_sum = residual + x
    out = rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(residual, expected_sum)  # in place, rounded as torch's add rounds it
    torch.testing.assert_close(out, hf_rms_norm(expected_sum, weight, 1e-5), atol=ULP[dtype],
                               rtol=ULP[dtype])


def test_weight_dtype_sets_the_output_dtype_and_empty_rows_pass():
    x = torch.randn(3, 32).half().to(DEVICE)
    weight = torch.rand(32).to(DEVICE)  # fp32 weight over fp16 rows: fp32 out, as `weight * x` would be
    out = rms_norm(x, weight, 1e-6)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, hf_rms_norm(x, weight, 1e-6), atol=1e-5, rtol=1e-5)
    assert rms_norm(x[:0], weight, 1e-6).shape == (0, 32)


def test_bad_shapes_are_named():
    x = torch.randn(4, 32, device=DEVICE)
    with pytest.raises(ValueError, match="rows \\[T, H\\] contiguous in H"):
        rms_norm(x.t(), torch.ones(4, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(16, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, torch.ones(32, device=DEVICE), 1e-6, torch.zeros(2, 32, device=DEVICE))
