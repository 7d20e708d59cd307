"""`speculative_config`, in vLLM's shape: which method proposes tokens, and how many a step verifies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")
_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model"}
# vLLM's default n-gram size when neither bound is given
DEFAULT_LOOKUP = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # k: the most tokens proposed for a sequence per step
    prompt_lookup_min: int = DEFAULT_LOOKUP  # ngram: the shortest n-gram that counts as a match
    prompt_lookup_max: int = DEFAULT_LOOKUP  # ngram: the longest n-gram looked for
    model: str | None = None  # draft_model: the draft's checkpoint (a directory, a .gguf, random:<config.json>)

    @classmethod
    def parse(cls, value: dict[str, Any] | None) -> SpeculativeConfig | None:
        """The settings of a `speculative_config` dict, or ValueError naming the field; None for None."""
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config={value!r} must be a mapping such as "
                             "{'method': 'ngram', 'num_speculative_tokens': 4}")
        unknown = sorted(set(value) - _KEYS)
        if unknown:
            raise ValueError(f"speculative_config.{unknown[0]} is not a setting (known: {sorted(_KEYS)})")
        method = value.get("method")
        if method not in METHODS:
            raise ValueError(f"speculative_config.method={method!r} must be one of {METHODS}")
        k = value.get("num_speculative_tokens")
        if not _positive_int(k):
            raise ValueError(f"speculative_config.num_speculative_tokens={k!r} must be an integer >= 1")
        if method == "draft_model":
            model = value.get("model")
            if not isinstance(model, str) or not model:
                raise ValueError(f"speculative_config.model={model!r}: method='draft_model' needs the draft's "
                                 "checkpoint (a directory, a .gguf file or random:<config.json>)")
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if value.get(name) is not None:
                    raise ValueError(f"speculative_config.{name} is for method='ngram', not 'draft_model'")
            return cls(method, k, model=model)
        if value.get("model") is not None:
            raise ValueError(f"speculative_config.model={value['model']!r} is for method='draft_model', not "
                             f"{method!r}")
        low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        for name, n in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if n is not None and not _positive_int(n):
                raise ValueError(f"speculative_config.{name}={n!r} must be an integer >= 1")
        # As vLLM: one bound given stands for both, none gives the default for both.
        low, high = (low or high or DEFAULT_LOOKUP), (high or low or DEFAULT_LOOKUP)
        if low > high:
            raise ValueError(f"speculative_config.prompt_lookup_min={low} is above prompt_lookup_max={high}")
        return cls(method, k, low, high)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
