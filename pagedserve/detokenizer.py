"""Incremental detokenization and stop strings."""

from __future__ import annotations

from dataclasses import dataclass

# Decoding restarts from a few tokens before the new ones so that tokenizers which drop a leading
# space at the start of a decode (SentencePiece) still produce it.
_CONTEXT_TOKENS = 5


@dataclass
class _State:
    prefix_offset: int
    read_offset: int
    text: str = ""


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[int, _State] = {}
        self._decode = _fast_decode(tokenizer) if tokenizer is not None else None

    def text(self, seq_id: int) -> str:
        state = self._states.get(seq_id)
        return state.text if state else ""

    def update(self, seq_id: int, token_ids: list[int], num_prompt_tokens: int, skip_special_tokens: bool,
               stop: list[str], include_stop_str: bool = False) -> str | None:
        """Decode what is new in `token_ids`. Returns the stop string that ended the text, if one did: the
        text is cut before it (after it with `include_stop_str`)."""
        if self.tokenizer is None:
            return None
        state = self._states.get(seq_id)
        if state is None:
            state = self._states[seq_id] = _State(max(0, num_prompt_tokens - _CONTEXT_TOKENS), num_prompt_tokens)
        prefix_text = self._decode(token_ids[state.prefix_offset:state.read_offset], skip_special_tokens)
        new_text = self._decode(token_ids[state.prefix_offset:], skip_special_tokens)
        # A trailing U+FFFD is an unfinished multi-byte character: wait for the next token.
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return None
        delta = new_text[len(prefix_text):]
        state.prefix_offset, state.read_offset = state.read_offset, len(token_ids)
        old_len = len(state.text)
        state.text += delta
        if stop:
            hits = [(i, s) for s in stop if (i := state.text.find(s, max(0, old_len - len(s) + 1))) != -1]
            if hits:
                i, s = min(hits, key=lambda hit: hit[0])
                state.text = state.text[: i + len(s) if include_stop_str else i]
                return s
        return None

    def token_texts(self, token_ids: list[int]) -> list[str]:
        """Each token's own text, special tokens included (what logprobs show)."""
        return [self._decode([t], False) for t in token_ids]

    def release(self, seq_id: int) -> None:
        self._states.pop(seq_id, None)


def _fast_decode(tokenizer):
    """`tokenizer.decode`, or the Rust tokenizer's own decode where transformers would add nothing to it.

    transformers' Python wrapper costs several times the decode itself, twice per sequence per step.
    It only adds clean-up of tokenization spaces, so it is bypassed when that is off.
    """
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and hasattr(backend, "decode") and not getattr(tokenizer, "clean_up_tokenization_spaces",
                                                                         True):
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)
