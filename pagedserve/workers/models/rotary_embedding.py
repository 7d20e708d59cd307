"""Rotary position embeddings as Hugging Face computes them (default, linear, dynamic NTK, llama3, LongRoPE, YaRN), over
each head's first `rotary_dim` dims (all of them but for a partial rotary embedding).

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


def _longrope_attention_factor(scaling: dict, max_position_embeddings: int) -> float:
    """The scale of LongRoPE's cos/sin: `attention_factor`, else from `factor` (else the ratio of the context lengths,
    as Phi-3 configs imply it) as transformers' `_compute_longrope_parameters` derives it."""
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _longrope_inv_freq(base: float, dim: int, factors: list[float]) -> torch.Tensor:
    ext = torch.tensor(factors, dtype=torch.float32)
    return 1.0 / (ext * base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _yarn_inv_freq(base: float, dim: int, scaling: dict, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """YaRN's frequencies and cos/sin scale, as transformers' `_compute_yarn_parameters`: the interpolated
    frequencies (divided by `factor`) below a ramp over the dims between the beta_fast and beta_slow rotation counts,
    the original ones above it; the scale `attention_factor`, else 0.1 ln(factor) + 1 (with mscale and
    mscale_all_dim: their ratio)."""
    factor = scaling.get("factor") or max_position_embeddings / scaling["original_max_position_embeddings"]
    original = scaling["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp  # [D/2]: 1 where the original frequency is kept
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int, local: bool = False) -> None:
        """`local`: the sliding layers' rope where the config gives them a base of their own (Gemma 3's
        `local_rope_theta`, default type, no scaling)."""
        super().__init__()
        self.dim = config.rotary_dim
        self.base = config.local_rope_theta if local else config.rope_theta
        self.scaling = None if local else config.rope_scaling
        self.max_position_embeddings = config.max_position_embeddings
        inv_freq = _inv_freq(self.base, self.dim)
        rope_type = self.scaling["rope_type"] if self.scaling else "default"
        if rope_type == "linear":
            inv_freq = inv_freq / self.scaling["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, self.scaling)
        elif rope_type == "longrope":
            inv_freq = _longrope_inv_freq(self.base, self.dim, self.scaling["short_factor"])
        scale = 1.0  # of cos and sin: LongRoPE's and YaRN's attention factor
        if rope_type == "yarn":
            inv_freq, scale = _yarn_inv_freq(self.base, self.dim, self.scaling, self.max_position_embeddings)
        self.dynamic = rope_type == "dynamic"
        # LongRoPE: the long factors for a sequence longer than this, the short ones up to it
        self.long_after = self.scaling["original_max_position_embeddings"] if rope_type == "longrope" else None
        # whether each token's sequence length chooses its frequencies
        self.needs_seq_lens = self.dynamic or self.long_after is not None
        if self.long_after:
            scale = _longrope_attention_factor(self.scaling, self.max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        positions = torch.arange(max_positions, dtype=torch.float32)
        self.register_buffer("cos_cached", self._scaled((positions[:, None] * inv_freq[None, :]).cos(), scale),
                             persistent=False)  # [P, D/2]
        self.register_buffer("sin_cached", self._scaled((positions[:, None] * inv_freq[None, :]).sin(), scale),
                             persistent=False)
        if self.long_after is not None:
            freqs = positions[:, None] * _longrope_inv_freq(self.base, self.dim, self.scaling["long_factor"])[None, :]
            self.register_buffer("long_cos_cached", self._scaled(freqs.cos(), scale), persistent=False)
            self.register_buffer("long_sin_cached", self._scaled(freqs.sin(), scale), persistent=False)

    @staticmethod
    def _scaled(x: torch.Tensor, scale: float) -> torch.Tensor:
        # transformers multiplies even by 1.0 (a no-op on the bits); only LongRoPE's and YaRN's factors differ
        return x if scale == 1.0 else x * scale

    def cos_sin(self, positions: torch.Tensor, seq_lens: torch.Tensor | None = None,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, 1, rotary_dim] for each token, built once per step for all layers.
        Dynamic NTK and LongRoPE need each token's sequence length (`seq_lens` [T])."""
        cos, sin = self._half_cos_sin(positions, seq_lens)
        # Duplicated halves as in transformers' cat((freqs, freqs)); cast like its rotary forward.
        cos = torch.cat([cos, cos], dim=-1)[:, None, :].to(dtype)
        sin = torch.cat([sin, sin], dim=-1)[:, None, :].to(dtype)
        return cos, sin

    def _half_cos_sin(self, positions: torch.Tensor, seq_lens: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        if self.long_after is not None and seq_lens is not None:
            # LongRoPE, as transformers chooses: the long factors where the sequence is past the trained length.
            # (The scale was applied to the tables: transformers scales cos/sin after the cos, as they were.)
            long = (seq_lens > self.long_after)[:, None]  # [T, 1]
            cos = torch.where(long, self.long_cos_cached[positions], self.cos_cached[positions])
            sin = torch.where(long, self.long_sin_cached[positions], self.sin_cached[positions])
            return cos, sin
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
