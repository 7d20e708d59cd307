"""Speculative decoding's parts against plain definitions: prompt-lookup proposals against a search over every
n-gram, greedy verification against stepping one token at a time, and rejection sampling's output distribution
against the target's (lossless, whatever the draft proposes)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.speculative.ngram import NgramIndex, propose_ngram
from pagedserve.speculative.policy import Acceptance, StepCost, engine_acceptance, sequence_acceptance, worth_verifying
from pagedserve.speculative.verify import verify_greedy, verify_sampled


def lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition: the longest recurring suffix of min_n..max_n tokens, its earliest earlier occurrence, the k
    tokens after it."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for s in range(len(tokens) - n):
            if tokens[s:s + n] == suffix:
                return tokens[s + n:s + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), max_size=40), k=st.integers(1, 6), min_n=st.integers(1, 3),
       extra=st.integers(0, 3))
def test_ngram_proposals_are_the_lookup_definition(tokens, k, min_n, extra):
    assert propose_ngram(tokens, k, min_n, min_n + extra) == lookup(tokens, k, min_n, min_n + extra)


@settings(max_examples=100, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=40), cuts=st.lists(st.integers(1, 5), max_size=10),
       min_n=st.integers(1, 3), extra=st.integers(0, 2))
def test_an_index_extended_step_by_step_proposes_what_a_fresh_lookup_does(tokens, cuts, min_n, extra):
    """A sequence's index grows with the tokens each step appends (one, or several kept proposals)."""
    index = NgramIndex(min_n, min_n + extra)
    end = 0
    for cut in [*cuts, len(tokens)]:
        end = min(len(tokens), end + cut)
        assert index.propose(tokens[:end], 3) == lookup(tokens[:end], 3, min_n, min_n + extra)


def test_ngram_proposals_prefer_the_longest_match_then_the_earliest():
    #         0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 9, 7, 2, 3, 8, 5, 1, 2, 3]
    assert propose_ngram(tokens, 2, 1, 3) == [9, 7]  # "1 2 3" at 0, over "2 3" at 5
    assert propose_ngram(tokens, 2, 1, 2) == [9, 7]  # "2 3": its earliest occurrence, at 1
    assert propose_ngram([4, 4, 4, 4], 3, 2, 2) == [4, 4]  # overlapping the suffix: 2 tokens follow
    assert propose_ngram([1, 2, 3], 2, 1, 2) == []  # nothing recurs
    assert propose_ngram(tokens, 5, 1, 3, max_len=14) == [9, 7]  # not past the sequence's cap
    with pytest.raises(ValueError, match="prompt_lookup_min=3 and prompt_lookup_max=2"):
        propose_ngram(tokens, 2, 3, 2)


def test_greedy_verification_emits_what_stepping_one_token_at_a_time_would():
    assert verify_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all kept, and the token past them
    assert verify_greedy([5, 1, 7, 8], [5, 6, 7]) == [5, 1]  # the first mismatch ends the step with the target's
    assert verify_greedy([2, 6, 7, 8], [5, 6, 7]) == [2]
    assert verify_greedy([3], []) == [3]
    with pytest.raises(ValueError, match="one more is needed"):
        verify_greedy([1, 2], [1, 2])


def emitted(kept: torch.Tensor, next_token: torch.Tensor, proposals: torch.Tensor, position: int) -> torch.Tensor:
    """Each row's token at `position` of what it emits (-1 where it emits fewer)."""
    at = torch.where(kept > position, proposals[:, min(position, proposals.shape[1] - 1)], next_token)
    return torch.where(kept >= position, at, torch.full_like(at, -1))


@pytest.mark.parametrize("draft", ["model", "lookup"])
def test_rejection_sampling_emits_the_targets_distribution(draft):
    """Many rows with the same target distributions: the first token each emits has p_0's distribution, and the
    second, among rows that kept their first proposal, p_1's; proposals drawn from q (a draft model's) or one
    fixed token (a lookup's)."""
    gen = torch.Generator().manual_seed(0)
    rows, k, vocab = 200_000, 3, 6
    p = torch.softmax(torch.randn(k + 1, vocab, generator=gen) * 1.5, dim=-1)
    if draft == "model":
        q = torch.softmax(torch.randn(k, vocab, generator=gen) * 1.5, dim=-1)
        proposals = torch.stack([torch.multinomial(q[i], rows, replacement=True, generator=gen) for i in range(k)],
                                dim=1)  # [rows, k]
        draft_probs = q.expand(rows, k, vocab)
    else:
        proposals = torch.tensor([1, 2, 3]).expand(rows, k)
        draft_probs = None
    kept, next_token = verify_sampled(p.expand(rows, k + 1, vocab), proposals, draft_probs,
                                      torch.rand(rows, k, generator=gen), torch.rand(rows, k + 1, generator=gen))
    for position in (0, 1):
        tokens = emitted(kept, next_token, proposals, position)
        tokens = tokens[tokens >= 0]
        if position == 1:  # given the first proposal kept
            tokens = emitted(kept, next_token, proposals, 1)[(kept >= 1) & (proposals[:, 0] == proposals[0, 0])]
        freq = torch.bincount(tokens, minlength=vocab).double() / tokens.numel()
        # a few standard errors of a frequency over these many draws
        assert torch.allclose(freq, p[position].double(), atol=5 * (0.25 / tokens.numel()) ** 0.5), (position, freq)


def test_a_draft_equal_to_the_target_is_always_kept():
    gen = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(4, 3, 7, generator=gen), dim=-1)  # [B, k + 1, V]
    proposals = torch.stack([torch.multinomial(p[b, :2], 1, generator=gen).squeeze(1) for b in range(4)])
    kept, _ = verify_sampled(p, proposals, p[:, :2], torch.rand(4, 2, generator=gen), torch.rand(4, 3, generator=gen))
    assert kept.tolist() == [2, 2, 2, 2]


def test_a_proposal_without_target_mass_is_never_kept():
    p = torch.tensor([[[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]]])  # [1, k + 1, V], k = 1
    for u in (0.0, 0.5, 0.999):
        kept, token = verify_sampled(p, torch.tensor([[0]]), None, torch.tensor([[u]]), torch.tensor([[0.3, 0.3]]))
        assert kept.item() == 0 and token.item() in (1, 2)


def test_the_step_cost_fit_recovers_a_line_and_forgets_old_steps():
    cost = StepCost()
    assert cost.fit() is None
    for n in [16, 20, 40, 64, 16, 30] * 5:
        cost.observe(n, 0.02 + 0.001 * n)
    base, per_token = cost.fit()
    assert base == pytest.approx(0.02, rel=0.05) and per_token == pytest.approx(0.001, rel=0.05)
    for _ in range(200):  # steps of one size only: no slope to see, so proposals are tried again
        cost.observe(16, 0.036)
    assert cost.fit()[1] < 0.1 * per_token


def test_a_proposal_is_verified_while_its_chance_outweighs_its_cost():
    # one sequence, a step of 8 ms, 1 ms a token more: a proposal pays where it is kept one time in eight
    assert worth_verifying(4, 0.9, (0.007, 0.001), 1) == 4
    assert worth_verifying(4, 0.3, (0.007, 0.001), 1) == 1  # 0.3 > 1/8, 0.09 < 1/8
    assert worth_verifying(4, 0.1, (0.007, 0.001), 1) == 0
    # 16 sequences, 1.3 ms a token in a 27 ms step: only likely proposals (a^j > 0.77)
    assert worth_verifying(4, 0.9, (0.0062, 0.0013), 16) == 2
    assert worth_verifying(4, 0.6, (0.0062, 0.0013), 16) == 0
    assert worth_verifying(4, 0.0, None, 16) == 4  # nothing measured yet
    assert worth_verifying(3, 0.5, (0.01, 0.0), 64) == 3  # tokens cost nothing more (a GPU at small batch)


def test_acceptance_counts_fade_and_fall_back_to_the_prior():
    engine, own = Acceptance(0.5), Acceptance(0.8)
    assert engine_acceptance(engine) == 0.5
    engine.add(4, 0)  # one row, nothing kept
    assert engine_acceptance(engine) == pytest.approx(1 / 3)
    for _ in range(40):
        engine.fade()
    assert engine_acceptance(engine) == pytest.approx(0.5, abs=1e-6)  # tried again
    own.record(4, 4)
    own.record(4, 4)
    assert sequence_acceptance(own, engine) == pytest.approx((7.2 + 1.0) / (7.2 + 2.0))
