"""The one-call rotary embeddings of queries and keys against transformers' `q * cos + rotate_half(q) * sin`:
the Triton kernel, in Triton's interpreter off-GPU (TRITON_INTERPRET=1, set in conftest.py), and the CPU's
native one (fp32; other dtypes take the reference's torch ops). The same roundings, so the same bits. The
interpreter mishandles bf16, so bf16 runs only on a GPU."""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401

from pagedserve.kernels import reference
from pagedserve.kernels.cpu import ops as cpu
from pagedserve.kernels.gpu.rotary import rotate_qk as triton_rotate_qk
from pagedserve.workers.models.model_config import ModelConfig
from pagedserve.workers.models.rotary_embedding import RotaryEmbedding

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
ROTATIONS = [triton_rotate_qk] + ([cpu.rotate_qk] if DEVICE.type == "cpu" else [])  # the CPU's on the CPU only


def reference_rotate_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """The reference's rotation, in place as the kernels rotate."""
    q_rotated, k_rotated = reference.rotate_qk(q, k, cos, sin)
    q.copy_(q_rotated)
    k.copy_(k_rotated)


def hf_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb for one tensor, op for op."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return (x * cos) + (torch.cat((-x2, x1), dim=-1) * sin)


@pytest.mark.parametrize("rotate_qk", ROTATIONS, ids=lambda f: f.__module__)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(14, 2, 64), (4, 4, 80), (7, 1, 32)])
def test_rotation_matches_transformers_bit_for_bit(rotate_qk, dtype, num_q_heads, num_kv_heads, head_dim):
    config = ModelConfig.from_dict(dict(model_type="llama", vocab_size=100, hidden_size=num_q_heads * head_dim,
                                        intermediate_size=64, num_hidden_layers=1, num_attention_heads=num_q_heads,
                                        num_key_value_heads=num_kv_heads, head_dim=head_dim,
                                        max_position_embeddings=4096))
    rope = RotaryEmbedding(config, 4096)
    gen = torch.Generator().manual_seed(head_dim)
    positions = torch.tensor([0, 1, 17, 700, 4095])
    cos, sin = (t.to(DEVICE) for t in rope.cos_sin(positions, dtype=dtype))
    # q, k and v as views of one projection's output, as the model has them
    qkv = (torch.randn(5, (num_q_heads + 2 * num_kv_heads) * head_dim, generator=gen) * 4).to(dtype).to(DEVICE)
    q, k, v = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k = q.view(5, num_q_heads, head_dim), k.view(5, num_kv_heads, head_dim)
    expected_q, expected_k, v_before = hf_rotate(q, cos, sin), hf_rotate(k, cos, sin), v.clone()
    rotate_qk(q, k, cos, sin)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    assert torch.equal(v, v_before)  # the rest of the projection is left alone


@pytest.mark.parametrize("rotate_qk", ROTATIONS, ids=lambda f: f.__module__)
def test_empty_steps_pass_and_bad_shapes_are_named(rotate_qk):
    q, k = torch.zeros(0, 4, 64, device=DEVICE), torch.zeros(0, 2, 64, device=DEVICE)
    rotate_qk(q, k, torch.zeros(0, 1, 64, device=DEVICE), torch.zeros(0, 1, 64, device=DEVICE))
    q, k = torch.zeros(3, 4, 64, device=DEVICE), torch.zeros(3, 2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="rotate_qk needs"):
        rotate_qk(q, k, torch.zeros(3, 64, device=DEVICE), torch.zeros(3, 64, device=DEVICE))
    with pytest.raises(ValueError, match="rotate_qk needs"):
        rotate_qk(q, k.half(), torch.zeros(3, 1, 64, device=DEVICE), torch.zeros(3, 1, 64, device=DEVICE))
    for width in (66, 31):  # wider than a head; odd
        with pytest.raises(ValueError, match="rotate_qk needs"):
            rotate_qk(q, k, torch.zeros(3, 1, width, device=DEVICE), torch.zeros(3, 1, width, device=DEVICE))


# Phi-4-mini's rotary embedding, scaled down: LongRoPE over the first 0.75 of each head (12 of 16 dims).
PHI3_LONGROPE = dict(model_type="phi3", vocab_size=100, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                     original_max_position_embeddings=256, partial_rotary_factor=0.75,
                     rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.7, 2.5, 4.0],
                                   "long_factor": [1.0, 1.5, 3.0, 6.0, 12.0, 30.0]})


def hf_phi3_cos_sin(d: dict, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Phi3RotaryEmbedding for one sequence whose last position is positions' last."""
    import transformers
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = transformers.Phi3Config(**{k: v for k, v in d.items() if k != "model_type"}, pad_token_id=0)
    return Phi3RotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions[None])


@pytest.mark.parametrize("seq_len", [200, 256, 257, 3000])
def test_longrope_cos_sin_match_transformers_bit_for_bit(seq_len):
    """The short factors up to original_max_position_embeddings (256), the long ones past it; the scale and the
    rotated width (partial_rotary_factor) as transformers has them."""
    config = ModelConfig.from_dict(PHI3_LONGROPE)
    positions = torch.tensor([0, 1, 100, seq_len // 2, seq_len - 1])
    cos, sin = RotaryEmbedding(config, 4096).cos_sin(positions, torch.full((5,), seq_len))
    hf_cos, hf_sin = hf_phi3_cos_sin(PHI3_LONGROPE, positions)
    assert cos.shape == (5, 1, 12)
    assert torch.equal(cos[:, 0], hf_cos[0]) and torch.equal(sin[:, 0], hf_sin[0])


@pytest.mark.parametrize("rotate_qk", [*ROTATIONS, reference_rotate_qk], ids=lambda f: f.__module__ + f.__name__)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_partial_rotation_matches_transformers_bit_for_bit(rotate_qk, dtype):
    """Each head's first 12 of 16 dims rotated (transformers' Phi-3 apply_rotary_pos_emb), the last 4 untouched."""
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    config = ModelConfig.from_dict(PHI3_LONGROPE)
    positions = torch.tensor([0, 3, 255, 256, 4000])
    cos, sin = (t.to(DEVICE) for t in RotaryEmbedding(config, 4096).cos_sin(positions, torch.full((5,), 4001), dtype))
    gen = torch.Generator().manual_seed(12)
    qkv = (torch.randn(5, 8 * 16, generator=gen) * 4).to(dtype).to(DEVICE)
    q, k, v = qkv.split([64, 32, 32], dim=-1)
    q, k = q.view(5, 4, 16), k.view(5, 2, 16)
    # transformers' layout: [batch, heads, T, D], cos/sin [batch, T, R]
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None, :, 0],
                                      sin[None, :, 0])
    v_before = v.clone()
    rotate_qk(q, k, cos, sin)
    assert torch.equal(q, hf_q[0].transpose(0, 1)) and torch.equal(k, hf_k[0].transpose(0, 1))
    assert torch.equal(v, v_before)
