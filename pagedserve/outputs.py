"""What `LLM.generate` returns, shaped like vLLM's `RequestOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.chat.tool_calls import ToolCall


@dataclass(slots=True)
class Logprob:
    """One token's log-probability under the model's raw distribution (before penalties, biases and
    temperature), as vLLM's `Logprob(logprob, rank, decoded_token)`, with the token's id."""

    logprob: float | None  # None only for a prompt's first token in the engine's outputs: nothing predicts it
    rank: int | None = None  # 1 = the most likely; a sampled token's: how many tokens are at least as likely
    decoded_token: str | None = None  # None where the model has no tokenizer
    token_id: int | None = None

    @property
    def token(self) -> str | None:
        """The token's text (`decoded_token`)."""
        return self.decoded_token


class PositionLogprobs(dict[int, Logprob]):
    """One position's logprobs, as vLLM gives them: {token id: Logprob} for the sampled (or prompt) token
    first, then the top k by rank; a token among both appears once, with its top-k rank. Also pagedserve's
    view of the position: the token's `token_id`, `logprob`, `token`, and `top_logprobs` best first."""

    __slots__ = ("token_id", "top_logprobs")

    def __init__(self, token_id: int, scored: Logprob, top_logprobs: list[Logprob] | None = None) -> None:
        super().__init__()
        self.token_id = token_id
        self.top_logprobs = top_logprobs if top_logprobs is not None else []
        self[token_id] = scored
        for top in self.top_logprobs:  # as vLLM's dict: a top-k entry replaces the token's own, in first place
            self[top.token_id] = top

    @property
    def logprob(self) -> float | None:
        return self[self.token_id].logprob

    @property
    def rank(self) -> int | None:
        return self[self.token_id].rank

    @property
    def token(self) -> str | None:
        return self[self.token_id].decoded_token


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    # What stopped it when finish_reason is "stop": the stop string or stop token id; None for EOS.
    stop_reason: str | int | None = None
    # When asked for, one per token id: {token id: Logprob} for it and its top k (`PositionLogprobs`).
    logprobs: list[PositionLogprobs] | None = None
    # The calls parsed from `text` when a chat offered tools (`LLM.chat(..., tools=...)`); `text` stays
    # what the model wrote.
    tool_calls: list[ToolCall] | None = None
    # The thinking parsed from `text` when the engine has a reasoning parser (`LLM.chat`); None without one.
    # The calls above are parsed from the answer after it.
    reasoning: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    error: str | None = None  # set when a worker failure ended the request
    # When asked for, one per prompt token. Nothing predicts the first: `LLM` gives None there, as vLLM does;
    # the engine's own outputs (which the server renders) hold its id and text there, with logprob None.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # Prompt tokens found in the prefix cache, not computed (None until the request is admitted)
    num_cached_tokens: int | None = None
