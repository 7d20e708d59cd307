"""A draw from a distribution by one uniform: where the uniform falls in the cumulative mass, and the uniform of a
seeded draw, a hash of its place."""

from __future__ import annotations

import torch
import xxhash


def draw_uniform(seed: int, sample_index: int, output_len: int, stream: int = 0) -> float:
    """The uniform in [0, 1) of one seeded draw: a hash of the request's seed and the draw's place only, so
    the same seed gives the same tokens whatever else is in the batch, even after preemption, and whether the
    draw verifies a proposal (speculative decoding) or not. `stream`: another uniform for the same place, apart
    from the draw's (a draft model's draw there, and rejection sampling's test of its proposal)."""
    places = (seed, sample_index, output_len) + ((stream,) if stream else ())
    data = b"".join(x.to_bytes(8, "little", signed=True) for x in places)
    return (xxhash.xxh64_intdigest(data) >> 40) * 2.0**-24  # the top 24 bits: exact in fp32, below 1


def inverse_transform(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Each row's token [D] for its uniform in [0, 1) [D, 1], looked up in the row's cumulative mass
    (probs [D, V] need not sum to 1: min-p leaves them unnormalised). A token without mass is never
    picked: its cumulative mass equals its predecessor's."""
    cumulative = probs.cumsum(dim=-1)  # [D, V]
    total = cumulative[:, -1:]
    # Strictly below the total, should rounding carry u * total up to it: else the pick would fall past the
    # last token with mass.
    target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    tokens = torch.searchsorted(cumulative, target, right=True).squeeze(1)
    return tokens.clamp_(max=probs.shape[-1] - 1)  # only a row of NaNs gets past its end
