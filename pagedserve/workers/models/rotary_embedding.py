"""Rotary position embeddings as Hugging Face computes them (default, linear, dynamic NTK, llama3).

The float ops follow transformers' rope init functions so fp32 results match bit for bit.
"""

from __future__ import annotations

import math

import torch

from pagedserve.workers.models.model_config import ModelConfig


def _inv_freq(base: float, dim: int, device: torch.device | None = None) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int, local: bool = False) -> None:
        """`local`: the sliding layers' rope where the config gives them a base of their own (Gemma 3's
        `local_rope_theta`, default type, no scaling)."""
        super().__init__()
        self.dim = config.head_dim
        self.base = config.local_rope_theta if local else config.rope_theta
        self.scaling = None if local else config.rope_scaling
        self.max_position_embeddings = config.max_position_embeddings
        inv_freq = _inv_freq(self.base, self.dim)
        rope_type = self.scaling["rope_type"] if self.scaling else "default"
        if rope_type == "linear":
            inv_freq = inv_freq / self.scaling["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, self.scaling)
        self.dynamic = rope_type == "dynamic"
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [P, D/2]
        self.register_buffer("cos_cached", freqs.cos(), persistent=False)
        self.register_buffer("sin_cached", freqs.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, seq_lens: torch.Tensor | None = None,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, 1, D] for each token, built once per step for all layers.
        Dynamic NTK needs each token's sequence length."""
        cos, sin = self._half_cos_sin(positions, seq_lens)
        # Duplicated halves as in transformers' cat((freqs, freqs)); cast like its rotary forward.
        cos = torch.cat([cos, cos], dim=-1)[:, None, :].to(dtype)
        sin = torch.cat([sin, sin], dim=-1)[:, None, :].to(dtype)
        return cos, sin

    def _half_cos_sin(self, positions: torch.Tensor, seq_lens: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        if not self.dynamic or seq_lens is None or bool((seq_lens <= self.max_position_embeddings).all()):
            return self.cos_cached[positions], self.sin_cached[positions]
        # Past the trained length the base grows with the sequence, as in transformers.
        factor = self.scaling["factor"]
        inv = []
        for n in seq_lens.tolist():
            n = max(n, self.max_position_embeddings)
            base = self.base * ((factor * n / self.max_position_embeddings) - (factor - 1)) ** (
                self.dim / (self.dim - 2))
            inv.append(_inv_freq(base, self.dim, positions.device))
        freqs = positions.float()[:, None] * torch.stack(inv)  # [T, D/2]
        return freqs.cos(), freqs.sin()
