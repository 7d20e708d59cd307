"""Reasoning outputs: the thinking a reasoning model writes between `<think>` and `</think>`, parsed out of its
answer.

`reasoning_parser` (an engine setting; vLLM's names): "qwen3" for Qwen3 models, which open a thinking block
themselves (or find it opened by the chat template, as the Thinking-2507 ones do), or answer at once when
`enable_thinking` is false; "deepseek_r1" for the DeepSeek-R1 family, which reasons first whether or not it
writes `<think>`.

Where the output begins is read from the prompt (`ReasoningTags.start`): a prompt whose last thinking tag is
an open `<think>` (the template opened the block) leaves the model reasoning; one that ends in a closed block
(an empty one: thinking switched off) leaves it answering; otherwise Qwen3 reasons only if its output opens
with `<think>`, and DeepSeek-R1 reasons from the start. The first `</think>` ends the reasoning.

Splitting is a pure function of the text so far, and every earlier result is a prefix of every later one, so
a stream's deltas joined are exactly the unary answer (as with tool calls). Only pure Python here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

REASONING_PARSERS = ("qwen3", "deepseek_r1")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

# "reasoning": the output starts inside a thinking block; "may_open": it reasons only if it opens with
# `<think>`; "answer": it has no reasoning.
ReasoningStart = Literal["reasoning", "may_open", "answer"]


def check_reasoning_parser(name: str | None) -> None:
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser={name!r} must be one of {REASONING_PARSERS} or null (no parsing)")


@dataclass(frozen=True)
class ReasoningTags:
    """A reasoning parser and its model's `<think>` and `</think>` token ids."""

    parser: str
    open_id: int
    close_id: int

    def start(self, prompt_token_ids: Sequence[int], decode: Callable[[Sequence[int]], str]) -> ReasoningStart:
        """Where a sample of `prompt_token_ids` begins (`decode` turns the ids after the prompt's last closing
        tag into text, to see whether the prompt ends right after it)."""
        last_open = last_close = -1
        for i in range(len(prompt_token_ids) - 1, -1, -1):
            token = prompt_token_ids[i]
            if token == self.open_id and last_open < 0:
                last_open = i
            elif token == self.close_id and last_close < 0:
                last_close = i
            if last_open >= 0 and last_close >= 0:
                break
        if last_open > last_close:
            return "reasoning"
        if last_close >= 0 and not decode(prompt_token_ids[last_close + 1:]).strip():
            return "answer"
        return "reasoning" if self.parser == "deepseek_r1" else "may_open"


def _held(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def split_reasoning(start: ReasoningStart, text: str, final: bool) -> tuple[str, str]:
    """(reasoning, answer) of a sample's text so far (`final` once it has finished). Whitespace around the
    reasoning and before the answer is layout; text that may yet be a tag is held back until it is known."""
    if start == "answer":
        return "", text
    lead = text.lstrip()
    if lead.startswith(THINK_OPEN):
        body = lead[len(THINK_OPEN):]
    elif not final and THINK_OPEN.startswith(lead):
        return "", ""  # nothing yet, or the start of `<think>`
    elif start == "may_open":
        return "", text  # it answers without thinking
    else:
        body = text  # the prompt opened the block
    end = body.find(THINK_CLOSE)
    if end < 0:
        if not final:
            body = body[:len(body) - _held(body, THINK_CLOSE)]
        return body.strip(), ""  # reasoning cut short (max_tokens) is still reasoning, not an answer
    return body[:end].strip(), body[end + len(THINK_CLOSE):].lstrip()


def reasoning_tokens(start: ReasoningStart, token_ids: Sequence[int], end_id: int, reasoning: str) -> int:
    """How many of a sample's output tokens are its reasoning (`reasoning`: the text `split_reasoning` gave
    it): those up to the `</think>` that ends it (`end_id`) and that token, or all of them when it never
    ended (cut short); none where the sample answered without thinking."""
    if start == "answer" or (start == "may_open" and not reasoning):
        return 0
    return token_ids.index(end_id) + 1 if end_id in token_ids else len(token_ids)


class ReasoningStream:
    """One sample's reasoning and answer as its text grows: `update` returns what is new of each since its
    last call (the same split, whole, gives the unary answer)."""

    def __init__(self, start: ReasoningStart) -> None:
        self.start = start
        self._sent = (0, 0)

    def update(self, text: str, final: bool) -> tuple[str, str]:
        reasoning, answer = split_reasoning(self.start, text, final)
        r0, a0 = self._sent
        self._sent = (max(r0, len(reasoning)), max(a0, len(answer)))
        return reasoning[r0:], answer[a0:]
