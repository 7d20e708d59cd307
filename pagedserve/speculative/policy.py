"""How many of a sequence's proposals are worth verifying this step.

A proposed token costs what computing one more token of the step costs (the step's time per token, `StepCost`),
and pays when it is kept: one more token out of the step, worth the step's time per sequence. So the j-th proposal
of a sequence is worth it while a^j * T(B) / B > beta, where a is the chance the sequence's next proposal is kept
(`Acceptance`), B the sequences decoding, T(B) the time of their step and beta the time of one more token. Where a
step costs little more for a few more tokens (a GPU at small batch, a CPU at one sequence) every proposal goes; where
each token costs its share of the arithmetic (a CPU at 16 sequences) only those likely to be kept do.
The output does not depend on any of it (every proposal is verified losslessly): only the speed does.
"""

from __future__ import annotations

import math

# The fit forgets old steps at this rate a step (about the last 20 steps count), and shrinks the time per token
# towards 0 where the steps' token counts barely vary: proposals are then tried, and their steps measure it again.
_FORGET = 0.95
_RIDGE = 0.25  # tokens^2: the variance of a step's token count below which the fit does not trust its slope
# Pseudo-counts of a prior in a record: an even chance in the engine's, the engine's in a sequence's
_PRIOR_WEIGHT = 2.0
SEQUENCE_DECAY = 0.8  # a sequence's counts of kept and missed proposals fade at this rate a verifying step
# The engine's fade at this rate a step, verifying or not: after steps that verified nothing (too few proposals
# were kept to be worth it) it returns to even chances and tries again, as new requests may copy more.
ENGINE_DECAY = 0.99


class StepCost:
    """A step's time as `base + per_token * tokens`, fitted by weighted least squares to the steps measured."""

    def __init__(self) -> None:
        self._sums = [0.0] * 5  # weighted: count, tokens, tokens^2, seconds, tokens * seconds

    def observe(self, num_tokens: int, seconds: float) -> None:
        n, t = float(num_tokens), seconds
        self._sums = [_FORGET * s + x for s, x in zip(self._sums, (1.0, n, n * n, t, n * t), strict=True)]

    def fit(self) -> tuple[float, float] | None:
        """(base, per_token) in seconds, or None before any step."""
        w, sn, snn, st, snt = self._sums
        if w == 0:
            return None
        variance = snn / w - (sn / w) ** 2
        covariance = snt / w - sn * st / w**2
        per_token = max(0.0, covariance / (variance + _RIDGE))
        return st / w - per_token * sn / w, per_token


class Acceptance:
    """Kept and missed proposals, the engine's and one sequence's: the chance a proposal is kept, each taken to be
    kept with one chance until the first that is not (a row's proposals after a missed one are not tried). Older
    rows fade by `decay` a row."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.kept = 0.0
        self.missed = 0.0

    def record(self, num_proposed: int, num_kept: int) -> None:
        """A row's proposals, the older rows faded."""
        self.fade()
        self.add(num_proposed, num_kept)

    def add(self, num_proposed: int, num_kept: int) -> None:
        self.kept += num_kept
        self.missed += num_kept < num_proposed

    def fade(self) -> None:
        self.kept *= self.decay
        self.missed *= self.decay

    def rate(self, prior: float = 0.5, prior_weight: float = 0.0) -> float:
        total = self.kept + self.missed + prior_weight
        return (self.kept + prior * prior_weight) / total if total else prior


def worth_verifying(num_proposals: int, acceptance: float, fit: tuple[float, float] | None, num_decoding: int) -> int:
    """How many of `num_proposals` proposals (the first ones) pay, at `acceptance` a proposal, in a step whose cost
    is `fit` (None: unmeasured, all go) with `num_decoding` sequences."""
    if fit is None or num_proposals == 0:
        return num_proposals
    base, per_token = fit
    batch = max(1, num_decoding)
    value = (base + per_token * batch) / batch  # the step's time per sequence: what a kept proposal saves
    if per_token <= 0 or acceptance >= 1:
        return num_proposals
    if acceptance <= 0 or value <= per_token:
        return 0
    # a^j * value > per_token  <=>  j < log(per_token / value) / log(a)
    return min(num_proposals, max(0, math.ceil(math.log(per_token / value) / math.log(acceptance)) - 1))


def sequence_acceptance(own: Acceptance, engine: Acceptance) -> float:
    """A sequence's chance of a kept proposal: its own recent record, weighted with the engine's."""
    return own.rate(engine_acceptance(engine), _PRIOR_WEIGHT)


def engine_acceptance(engine: Acceptance) -> float:
    """The chance of a kept proposal engine-wide: its record, weighted with an even chance."""
    return engine.rate(0.5, _PRIOR_WEIGHT)
