"""The one-call rotary embeddings of queries and keys against transformers' `q * cos + rotate_half(q) * sin`:
the Triton kernel, in Triton's interpreter off-GPU (TRITON_INTERPRET=1, set in conftest.py), and the CPU's
native one (fp32; other dtypes take the reference's torch ops). The same roundings, so the same bits. The
interpreter mishandles bf16, so bf16 runs only on a GPU."""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401

from pagedserve.kernels.cpu import ops as cpu
from pagedserve.kernels.gpu.rotary import rotate_qk as triton_rotate_qk
from pagedserve.workers.models.model_config import ModelConfig
from pagedserve.workers.models.rotary_embedding import RotaryEmbedding

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
ROTATIONS = [triton_rotate_qk] + ([cpu.rotate_qk] if DEVICE.type == "cpu" else [])  # the CPU's on the CPU only


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
