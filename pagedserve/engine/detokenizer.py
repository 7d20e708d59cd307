"""Incremental detokenization and stop strings."""

from __future__ import annotations

from dataclasses import dataclass

# Decoding restarts from a few tokens before the new ones so that tokenizers which drop a leading
# space at the start of a decode (SentencePiece) still produce it.
_CONTEXT_TOKENS = 5


@dataclass
class _State:
    # Text is final up to token `read_offset`; tokens from `prefix_offset` on are decoded again as context.
    prefix_offset: int
    read_offset: int
    text: str = ""


class Detokenizer:
    """Per sequence, the text of its output tokens, decoded as they come: each step decodes a window of the
    last tokens with and without the new ones, and the difference is the new text.

    The text is the tokens' decode without transformers' clean-up of tokenization spaces (as in vLLM): that
    clean-up deletes characters across token boundaries (" ," to ","), which text already streamed cannot
    take back, so applied to each window it lost them."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[int, _State] = {}
        self._decode = _plain_decode(tokenizer) if tokenizer is not None else None

    def text(self, seq_id: int) -> str:
        state = self._states.get(seq_id)
        return state.text if state else ""

    def update(self, seq_id: int, token_ids: list[int], num_prompt_tokens: int, skip_special_tokens: bool,
               stop: list[str], include_stop_str: bool = False) -> str | None:
        """Decode what is new in `token_ids` (one token or several). Returns the stop string that ended the
        text, if one did: the text is cut before it (after it with `include_stop_str`)."""
        if self.tokenizer is None:
            return None
        state = self._states.get(seq_id)
        if state is None:
            state = self._states[seq_id] = self._start(token_ids, num_prompt_tokens, skip_special_tokens)
        elif state.read_offset == len(token_ids):
            return None  # nothing new since the last call
        prefix_text = self._decode(token_ids[state.prefix_offset:state.read_offset], skip_special_tokens)
        # An unfinished character's tokens wait for the next ones; the text before them, when several tokens
        # came at once, goes now.
        end, new_text = self._complete(token_ids, state.prefix_offset, len(token_ids), state.read_offset + 1,
                                       skip_special_tokens)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return None
        delta = new_text[len(prefix_text):]
        state.prefix_offset, state.read_offset = state.read_offset, end
        old_len = len(state.text)
        state.text += delta
        if stop:
            hits = [(i, s) for s in stop if (i := state.text.find(s, max(0, old_len - len(s) + 1))) != -1]
            if hits:
                i, s = min(hits, key=lambda hit: hit[0])
                state.text = state.text[: i + len(s) if include_stop_str else i]
                return s
        return None

    def _start(self, token_ids: list[int], num_prompt_tokens: int, skip_special_tokens: bool) -> _State:
        """A sequence's state before its first output token. The prompt's text is final up to its last token
        whose text is complete: a character the prompt leaves unfinished goes whole to the output that
        finishes it, rather than its first bytes being counted as the prompt's U+FFFD."""
        prefix = max(0, num_prompt_tokens - _CONTEXT_TOKENS)
        read, _ = self._complete(token_ids, prefix, num_prompt_tokens, prefix, skip_special_tokens)
        return _State(prefix, read)

    def _complete(self, token_ids: list[int], start: int, end: int, floor: int,
                  skip_special_tokens: bool) -> tuple[int, str]:
        """The last `end`, down to `floor`, at which the text of token_ids[start:end] does not end in an
        unfinished multi-byte character (U+FFFD), and that text (still unfinished at `floor`)."""
        text = self._decode(token_ids[start:end], skip_special_tokens)
        while text.endswith("\ufffd") and end > floor:
            end -= 1
            text = self._decode(token_ids[start:end], skip_special_tokens)
        return end, text

    def text_of(self, token_ids: list[int], num_prompt_tokens: int, skip_special_tokens: bool) -> str:
        """The text `update` makes of the output token_ids[num_prompt_tokens:] given all at once, keeping no
        state (a beam search's answers, whose tokens no sequence decoded)."""
        key = -1  # no sequence's id (they count from 0); released before returning
        self.update(key, token_ids, num_prompt_tokens, skip_special_tokens, [])
        text = self.text(key)
        self.release(key)
        return text

    def token_texts(self, token_ids: list[int]) -> list[str]:
        """Each token's own text, special tokens included (what logprobs show)."""
        return [self._decode([t], False) for t in token_ids]

    def release(self, seq_id: int) -> None:
        self._states.pop(seq_id, None)


def _plain_decode(tokenizer):
    """Decode without the clean-up of tokenization spaces: the Rust (`tokenizers`) tokenizer's own decode
    where there is one (transformers' Python wrapper costs several times the decode itself, twice per
    sequence per step), else the tokenizer's decode with the clean-up off."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and hasattr(backend, "decode"):
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
