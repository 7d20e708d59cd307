"""Per-request sampling settings, validated when the request is made."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop, shaped like vLLM's `SamplingParams`.

    temperature == 0 means greedy. top_k == -1 disables top-k. Penalties follow
    the usual definitions: repetition (HF/CTRL, over prompt and output tokens),
    presence and frequency (OpenAI, over output tokens).
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k >= 0: sampled token's plus the top-k
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first field that is out of range."""
        _check(isinstance(self.n, int) and self.n >= 1, "n", self.n, "must be an integer >= 1")
        _check(self.temperature >= 0, "temperature", self.temperature, "must be >= 0")
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]")
        _check(
            isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1),
            "top_k", self.top_k, "must be -1 (disabled) or >= 1",
        )
        _check(0 <= self.min_p <= 1, "min_p", self.min_p, "must be in [0, 1]")
        _check(self.repetition_penalty > 0, "repetition_penalty", self.repetition_penalty, "must be > 0")
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", self.presence_penalty,
               "must be in [-2, 2]")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", self.frequency_penalty,
               "must be in [-2, 2]")
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", self.max_tokens,
               "must be an integer >= 1")
        _check(self.seed is None or isinstance(self.seed, int), "seed", self.seed, "must be an integer")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
               "logprobs", self.logprobs, "must be None or an integer in [0, 20]")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop,
               "must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               self.stop_token_ids, "must be non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def _check(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} {rule}")
