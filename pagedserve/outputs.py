"""What `LLM.generate` returns, shaped like vLLM's `RequestOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.tool_calls import ToolCall


@dataclass
class Logprob:
    """A token's log-probability under the model's raw distribution (before penalties, biases and
    temperature), its text, and the `k` most likely tokens at its position, best first."""

    token_id: int
    logprob: float | None  # None only for a prompt's first token: nothing predicts it
    token: str | None = None  # None where the model has no tokenizer
    top_logprobs: list[Logprob] = field(default_factory=list)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    # What stopped it when finish_reason is "stop": the stop string or stop token id; None for EOS.
    stop_reason: str | int | None = None
    logprobs: list[Logprob] | None = None  # one per token id, when asked for
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
    # When asked for: one per prompt token (the first one's logprob is None: nothing predicts it).
    prompt_logprobs: list[Logprob] | None = None
    # Prompt tokens found in the prefix cache, not computed (None until the request is admitted)
    num_cached_tokens: int | None = None
