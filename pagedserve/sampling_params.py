"""Per-request sampling settings, validated when the request is made.

`SamplingParams.validate` is the one place where a sampling value is checked: the offline API, the gRPC
service and the OpenAI routes all build a `SamplingParams`, so each gives the same error for the same value.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on one bias
SEED_RANGE = (-2**63, 2**63 - 1)  # a signed 64-bit integer: what a seeded draw hashes (vLLM's bound: torch.long's)
# The workers scale and compare logits in float32: a value past its largest finite number is inf there (-inf / inf
# and 0 * inf are NaN, and a row with a NaN draws garbage), and a positive one below its smallest normal number
# may be 0 there (rounded so, or flushed to zero: the engine's process runs with the CPU's flush-to-zero mode set
# by a library it loads, where a float64 subnormal that another process checked as positive reads as 0).
FLOAT32_MAX = (2 - 2.0**-23) * 2.0**127
FLOAT32_TINY = 2.0**-126
# A temperature below this samples greedily, as vLLM's sampling type does (its _SAMPLING_EPS): sampling tends
# to greedy as the temperature tends to 0, which is what a tiny one asks for, and logits divided by a tiny one
# overflow float32 (inf, then NaN).
GREEDY_BELOW = 1e-5
# repetition_penalty's least: a seen token's positive logit multiplied by 1e5 wins every draw already; below
# it only overflows float32 once the temperature divides it too.
MIN_REPETITION_PENALTY = 1e-5
# A beam's score divides by its length ** length_penalty: within +-32 that stays a normal float64 (2**-992 to
# 2**992) for every length below 2**31, where beyond it a long beam's score overflows or divides by 0.
MAX_LENGTH_PENALTY = 32.0


@dataclass
class StructuredOutputs:
    """A constraint on the output, as vLLM's `StructuredOutputsParams`: exactly one of a JSON schema, any
    JSON object, a regular expression, a choice among strings, or a grammar (xgrammar's EBNF, or Lark's syntax)."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object={self.json_object!r} must be true or false")
        given = [name for name in CONSTRAINT_KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(CONSTRAINT_KINDS)} "
                             f"(got {', '.join(given) or 'none'})")
        if self.json is not None and not isinstance(self.json, dict | str):
            raise ValueError("structured_outputs.json must be a JSON schema (an object, or its JSON text)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, list | tuple) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")

    def key(self) -> tuple[str, str]:
        """(kind, text): what identifies the compiled grammar."""
        if self.json is not None:
            return "json", self.json if isinstance(self.json, str) else json.dumps(self.json)  # order: the output's
        if self.json_object:
            return "json_object", ""
        if self.choice is not None:
            return "choice", json.dumps(list(self.choice))
        return ("regex", self.regex) if self.regex is not None else ("grammar", self.grammar)


CONSTRAINT_KINDS = tuple(f.name for f in fields(StructuredOutputs))


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop, shaped like vLLM's `SamplingParams`.

    temperature 0 (or below GREEDY_BELOW) means greedy. top_k == -1 disables top-k. Penalties follow
    the usual definitions: repetition (HF/CTRL, over prompt and output tokens),
    presence and frequency (OpenAI, over output tokens). max_tokens=None runs until
    the model stops or the context (max_model_len, or the KV pool if smaller) is full.
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
    max_tokens: int | None = 16
    min_tokens: int = 0  # EOS, stop_token_ids and stop strings cannot end the output before this many tokens
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    logprobs: int | None = None  # None: no logprobs; k >= 0: sampled token's plus the top-k
    prompt_logprobs: int | None = None  # None: none; k >= 0: each prompt token's logprob plus the top-k
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None  # the output must match it; the sequence stops when done
    allowed_token_ids: list[int] | None = None  # None: any token; else the output's tokens are among these
    bad_words: list[str] = field(default_factory=list)  # words the output never completes (as tokenized)
    # None: the whole prompt; k: only its last k tokens; -1 (vLLM's): as many of its last tokens as leave room
    # for max_tokens in the context (for at least one token when max_tokens is None); a chat's -1 drops its
    # oldest messages whole instead (`LLMEngine.chat_plan`)
    truncate_prompt_tokens: int | None = None
    # Under the engine's scheduling_policy "priority": lower runs first (vLLM's convention); ties go in the order
    # requests came. Other than 0 it is refused by a first-come-first-served engine.
    priority: int = 0
    # Prefix caching among requests with the same salt only (vLLM's): tenants that keep theirs secret cannot
    # reuse, or detect by its speed, another's cached prompt. Make it long and random (e.g. 32 random bytes).
    cache_salt: str | None = None
    # Beam search (vLLM's fields): the n most likely sequences, found as transformers' num_beams=n finds them,
    # best first; each one's score is its log-probability over its length ** length_penalty (`beam_search`)
    use_beam_search: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.structured_outputs, dict):
            unknown = set(self.structured_outputs) - set(CONSTRAINT_KINDS)
            if unknown:
                raise ValueError(f"structured_outputs has unknown keys {sorted(unknown)}")
            self.structured_outputs = StructuredOutputs(**self.structured_outputs)
        self.validate()
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self.bad_words = list(self.bad_words)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}

    def validate(self) -> None:
        """Raise ValueError naming the first field whose value has the wrong type or is out of range. A number
        field given as an int becomes a float."""
        _int(self, "n", lo=1)
        _float(self, "temperature", lo=0, hi=FLOAT32_MAX)
        # (0, 1], as a positive float32: top_p = FLOAT32_TINY already keeps only the most likely token
        _float(self, "top_p", lo=FLOAT32_TINY, hi=1)
        _int(self, "top_k", rule="must be -1 (disabled) or >= 1", ok=lambda v: v == -1 or v >= 1)
        _float(self, "min_p", lo=0, hi=1)
        _float(self, "repetition_penalty", lo=MIN_REPETITION_PENALTY, hi=FLOAT32_MAX)
        _float(self, "presence_penalty", lo=-2, hi=2)
        _float(self, "frequency_penalty", lo=-2, hi=2)
        _int(self, "seed", lo=SEED_RANGE[0], hi=SEED_RANGE[1], optional=True)
        _int(self, "max_tokens", lo=1, optional=True)
        _int(self, "min_tokens", lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}")
        _int(self, "truncate_prompt_tokens", optional=True, ok=lambda v: v == -1 or v >= 1,
             rule="must be None, -1 (the last tokens that leave room for max_tokens) or an integer >= 1")
        _int(self, "priority")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise ValueError(f"cache_salt={self.cache_salt!r} must be a non-empty string (or unset)")
        _int(self, "logprobs", lo=0, hi=MAX_LOGPROBS, optional=True)
        _int(self, "prompt_logprobs", lo=0, hi=MAX_LOGPROBS, optional=True)
        _float(self, "length_penalty", lo=-MAX_LENGTH_PENALTY, hi=MAX_LENGTH_PENALTY)
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "use_beam_search"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be true or false")
        if not isinstance(self.stop, list | tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop={self.stop!r} must be a non-empty string or a list of them")
        if not isinstance(self.stop_token_ids, list | tuple) or not all(
                _is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r} must be a list of non-negative integers")
        if not isinstance(self.bad_words, list | tuple) or not all(
                isinstance(w, str) and w.strip() for w in self.bad_words):
            raise ValueError(f"bad_words={self.bad_words!r} must be a list of words (non-blank strings)")
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, list | tuple) or not self.allowed_token_ids
                or not all(_is_int(t) and t >= 0 for t in self.allowed_token_ids)):
            raise ValueError(f"allowed_token_ids={self.allowed_token_ids!r} must be a non-empty list of token ids "
                             "(or unset: any token)")
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias={self.logit_bias!r} must map token ids to numbers")
        for token, bias in self.logit_bias.items():
            if not _is_int(token) or token < 0:
                raise ValueError(f"logit_bias has key {_value(token)}: keys must be non-negative token ids")
            if not _is_number(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias[{_value(token)}]={_value(bias)} must be a number in "
                                 f"[{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputs):
                raise ValueError("structured_outputs must be a StructuredOutputs (or a dict of its fields)")
            self.structured_outputs.validate()
            # Masks beside the grammar's may leave nothing to draw: the grammar alone says what may come.
            for name in ("allowed_token_ids", "bad_words"):
                if getattr(self, name):
                    raise ValueError(f"{name} cannot be combined with structured_outputs: the grammar decides "
                                     "which tokens may come")
        if self.use_beam_search:
            _check_beside_beam_search(self)
        elif self.length_penalty != 1.0:
            raise ValueError(f"length_penalty={self.length_penalty} weighs beams by their length: it needs "
                             "use_beam_search")

    def token_ids_named(self) -> dict[str, list[int]]:
        """The token ids this request names, by field: checked against the vocabulary by the engine."""
        return {"stop_token_ids": list(self.stop_token_ids), "logit_bias": list(self.logit_bias),
                "allowed_token_ids": list(self.allowed_token_ids or ())}

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


# What a beam search cannot honour, unless left as it is by default: it ranks whole sequences by the model's
# own log-probabilities, and one rule ends them (an end-of-sequence token or max_tokens).
_NOT_WITH_BEAM_SEARCH = {
    "top_k": "it keeps the most likely sequences, it draws nothing",
    "top_p": "it keeps the most likely sequences, it draws nothing",
    "min_p": "it keeps the most likely sequences, it draws nothing",
    "repetition_penalty": "it ranks beams by the model's own log-probabilities",
    "presence_penalty": "it ranks beams by the model's own log-probabilities",
    "frequency_penalty": "it ranks beams by the model's own log-probabilities",
    "logit_bias": "it ranks beams by the model's own log-probabilities",
    "allowed_token_ids": "it ranks beams by the model's own log-probabilities",
    "bad_words": "it ranks beams by the model's own log-probabilities",
    "structured_outputs": "a beam search is not constrained by a grammar here",
    "stop": "a beam ends at an end-of-sequence token, a stop_token_ids token or max_tokens",
    "min_tokens": "a beam ends at an end-of-sequence token, a stop_token_ids token or max_tokens",
    "logprobs": "a beam search returns its sequences, not per-token log-probabilities",
    "prompt_logprobs": "a beam search returns its sequences, not per-token log-probabilities",
}


def _check_beside_beam_search(p: SamplingParams) -> None:
    """ValueError naming the first field set to what a beam search cannot honour (`pagedserve.engine.beam_search`)."""
    defaults = {f.name: f.default if f.default_factory is MISSING else f.default_factory() for f in fields(p)}
    for name, why in _NOT_WITH_BEAM_SEARCH.items():
        if getattr(p, name) != defaults[name]:
            raise ValueError(f"{name}={getattr(p, name)!r} cannot be combined with use_beam_search: {why}")
    if not (p.greedy or p.temperature == 1.0):
        raise ValueError(f"temperature={p.temperature} cannot be combined with use_beam_search: it ranks beams by "
                         "the model's own log-probabilities (leave it unset, 0 or 1)")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    """An int or a finite float (an int is compared as it is: math.isfinite(10**400) raises OverflowError)."""
    return _is_int(v) or (isinstance(v, float) and math.isfinite(v))


def _shown(bound: float) -> str:
    return str(bound) if isinstance(bound, int) else f"{bound:g}"  # an int bound exactly: the seed's 2**63 - 1


def _range_rule(lo: float | None, hi: float | None) -> str:
    if lo is not None and hi is not None:
        return f"in [{_shown(lo)}, {_shown(hi)}]"
    return f">= {_shown(lo)}" if lo is not None else f"<= {_shown(hi)}" if hi is not None else ""


def _value(v: object) -> str:
    """`v` as an error shows it: repr, but an int of hundreds of digits by its size (past 4300 digits Python
    refuses to write one out)."""
    return f"<an integer of {v.bit_length()} bits>" if _is_int(v) and v.bit_length() > 1024 else repr(v)


def _int(p: SamplingParams, name: str, lo: int | None = None, hi: int | None = None, optional: bool = False,
         rule: str | None = None, ok=None) -> None:
    v = getattr(p, name)
    if v is None and optional:
        return
    kind = "None or an integer" if optional else "an integer"
    rule = rule or f"must be {kind}" + (f" {_range_rule(lo, hi)}" if lo is not None or hi is not None else "")
    if not _is_int(v) or (lo is not None and v < lo) or (hi is not None and v > hi) or (ok and not ok(v)):
        raise ValueError(f"{name}={_value(v)} {rule}")


def _float(p: SamplingParams, name: str, lo: float | None = None, hi: float | None = None) -> None:
    v = getattr(p, name)
    if not _is_number(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ValueError(f"{name}={_value(v)} must be a number {_range_rule(lo, hi)}")
    # A float from here on: the workers divide logits by some of these values, and a Python int past 2**63
    # would overflow torch's int64 scalar there, failing the step of every request in the batch.
    setattr(p, name, float(v))
