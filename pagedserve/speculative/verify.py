"""Verification of proposed tokens against the target model, lossless: what a sequence emits in one step.

A step computes the target's distribution at each of a row's k proposals and one position past them (k + 1 rows of
logits, after the sampler's penalties, biases, temperature and truncation). Greedy rows keep the proposals up to the
first that is not the target's argmax, then the argmax there (all k kept: the argmax past them). Sampled rows use
rejection sampling (Leviathan et al. 2023, Chen et al. 2023): proposal x_i drawn from the draft's q_i is kept with
probability min(1, p_i(x_i) / q_i(x_i)); at the first one rejected the token is drawn from the residual
max(0, p_i - q_i), renormalized; all k kept, one more is drawn from p_k. Every emitted token then has the target's
distribution, whatever the draft proposed. A proposer without a distribution (n-gram lookup) is a draft whose q_i
puts all its mass on x_i: x_i is kept with probability p_i(x_i), else the next token is drawn from p_i without x_i.
The sampler verifies such proposals by the draws themselves instead (`Sampler._verify`): each position draws its
token as a step without speculation would, by the same uniform, and x_i is kept where that token is x_i. It keeps
a proposal as often, and emits exactly the tokens decoding one at a time would, seeded draws included.
"""

from __future__ import annotations

import torch

from pagedserve.workers.draw import inverse_transform


def verify_greedy(target_argmax: list[int], proposals: list[int]) -> list[int]:
    """The tokens a greedy row emits: `target_argmax` holds the target's argmax at each proposal's position and one
    past them (len(proposals) + 1), so the row emits 1 to k + 1 tokens, each the target's own greedy choice."""
    if len(target_argmax) != len(proposals) + 1:
        raise ValueError(f"{len(target_argmax)} target tokens for {len(proposals)} proposals: one more is needed")
    kept = 0
    while kept < len(proposals) and proposals[kept] == target_argmax[kept]:
        kept += 1
    return [*proposals[:kept], target_argmax[kept]]


def verify_sampled(target_probs: torch.Tensor, proposals: torch.Tensor, draft_probs: torch.Tensor | None,
                   accept_uniform: torch.Tensor, draw_uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling for B rows of k proposals each.

    target_probs [B, k + 1, V]: the target's distributions (unnormalized allowed, as min-p leaves them) at each
    proposal's position and one past them; proposals [B, k]; draft_probs [B, k, V], or None for a proposer that
    puts all its mass on its proposal; accept_uniform [B, k] and draw_uniform [B, k + 1]: uniforms in [0, 1), the
    first to test each proposal, the second to draw the token after the last one kept (the residual's, or past all).
    Returns (the number of proposals kept [B], the token that follows them [B]): a row emits
    proposals[:kept] and then that token.
    """
    num_rows, k = proposals.shape
    if target_probs.shape[:2] != (num_rows, k + 1):
        raise ValueError(f"target_probs {tuple(target_probs.shape)} for {num_rows} rows of {k} proposals: "
                         f"[{num_rows}, {k + 1}, V] needed")
    p = target_probs / target_probs.sum(dim=-1, keepdim=True)  # [B, k + 1, V]
    proposed = proposals[..., None]  # [B, k, 1]
    p_x = p[:, :k].gather(-1, proposed).squeeze(-1)  # [B, k]: the target's probability of each proposal
    q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs.gather(-1, proposed).squeeze(-1)
    kept_each = accept_uniform * q_x < p_x  # u < p / q, without dividing by a q of 0  [B, k]
    # the proposals kept: those before the first rejected (k where none is)
    kept = torch.cumprod(kept_each.to(torch.int64), dim=-1).sum(dim=-1)  # [B]
    at = kept.clamp(max=k)[:, None, None].expand(-1, 1, p.shape[-1])  # [B, 1, V]
    next_p = p.gather(1, at).squeeze(1)  # [B, V]: the target's distribution where the next token is drawn
    rejected = kept < k
    if bool(rejected.any()):
        if draft_probs is None:
            residual = next_p.scatter(-1, proposals.gather(1, kept.clamp(max=k - 1)[:, None]), 0.0)
        else:
            q = draft_probs.gather(1, kept.clamp(max=k - 1)[:, None, None].expand(-1, 1, p.shape[-1])).squeeze(1)
            residual = (next_p - q / q.sum(dim=-1, keepdim=True)).clamp(min=0.0)
        # a residual without mass: p and q equal but for rounding, which rejected a proposal p keeps surely
        residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, next_p)
        next_p = torch.where(rejected[:, None], residual, next_p)
    uniform = draw_uniform.gather(1, kept[:, None])  # [B, 1]
    return kept, inverse_transform(next_p, uniform)
