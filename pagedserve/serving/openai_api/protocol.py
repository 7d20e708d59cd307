"""The OpenAI-compatible request bodies as typed models (pydantic, strict, unknown fields refused), and their
translation into `SamplingParams`, which checks every value's range (the one place for that).

A field is either honoured or refused with 400 naming it: fields the server cannot honour (`suffix`,
`best_of` other than n, ...) are typed here so that their "ask for nothing" values pass and anything else
is refused by name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from pagedserve.chat.template import ChatOptions
from pagedserve.sampling_params import SamplingParams, StructuredOutputs

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's; chat runs until the model stops or the context is full


class StrictBody(BaseModel):
    # strict: a string is not a number, a number not a string; forbid: an unknown field is an error, not a no-op
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(StrictBody):
    include_usage: bool = False  # a last chunk with empty choices and the usage
    continuous_usage_stats: bool = False  # the usage so far on every chunk


class JsonSchemaFormat(StrictBody):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the output always follows the schema; strict or not, it is enforced


class ResponseFormat(StrictBody):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Sampling(StrictBody):
    """Fields the completions and chat routes share."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None  # JSON object keys are strings: token ids as strings
    user: str | None = None  # the end user's id, for the operator's records; it does not change the output
    best_of: int | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    bad_words: list[str] | None = None
    priority: int | None = None  # with the server's scheduling_policy "priority": lower runs first
    cache_salt: str | None = None  # the prefix cache is shared only among requests with the same salt
    request_id: str | None = None  # the id to abort it by (gRPC Abort); one is made when absent
    return_tokens_as_token_ids: bool | None = None  # logprobs name tokens as "token_id:<id>" (vLLM's)
    # vLLM's: true adds the prompt's token ids; false leaves out the choices' token ids too (unset: sent)
    return_token_ids: bool | None = None
    use_beam_search: bool | None = None  # the n most likely sequences, best first (pagedserve.engine.beam_search)
    length_penalty: float | None = None  # a beam's score: its log-probability over its length ** this
    # Fields that change nothing when asked for nothing: accepted then, refused by name otherwise (`_NOTHING`)
    # Either value gives the same text: the (fast) tokenizer's decode puts no space between special tokens, as
    # vLLM's does (a slow tokenizer's option; with skip_special_tokens, the default, there are none to space)
    spaces_between_special_tokens: bool = True
    logits_processors: list[Any] | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structural_tag: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    metadata: dict[str, str] | None = None  # the client's tags, for its own records: no effect on the output
    safety_identifier: str | None = None  # as `user`
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's: the engine's own type, checked as it is parsed
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def constraint_field(self) -> str | None:
        """The field the output constraint came in (errors about it name this field)."""
        if self.response_format is not None and self.response_format.type != "text":
            return "response_format"
        names = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
        return next((name for name in names if getattr(self, name) is not None), None)

    def engine_names(self) -> dict[str, str]:
        """The engine's names of the fields this body sent under other names (engine name -> the body's): the
        engine's errors about them are told in the client's words (`spelled_as_sent`)."""
        return constraint_names(self.constraint_field())

    def constraint(self) -> StructuredOutputs | None:
        """The one output constraint the body asks for, if any; ValueError naming the fields otherwise."""
        asked: dict[str, StructuredOutputs] = {}
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            asked["response_format"] = StructuredOutputs(json_object=True)
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise ValueError("response_format.json_schema.schema is required with type 'json_schema'")
            asked["response_format"] = StructuredOutputs(json=fmt.json_schema.schema_)
        if self.structured_outputs is not None:
            asked["structured_outputs"] = self.structured_outputs
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                asked[name] = StructuredOutputs(**{kind: getattr(self, name)})
        if len(asked) > 1:
            raise ValueError(f"{', '.join(asked)}: give one output constraint, not {len(asked)}")
        return next(iter(asked.values()), None)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """ValueError naming the field for a value out of range or a field that cannot be honoured."""
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of={self.best_of} is not supported (only best_of equal to n)")
        refuse_what_is_asked(self, _NOTHING)
        with spelled_as_sent(self.engine_names()):
            return self._engine_params(max_tokens, logprobs, prompt_logprobs)

    def _engine_params(self, max_tokens: int | None, logprobs: int | None,
                       prompt_logprobs: int | None) -> SamplingParams:
        kwargs: dict[str, Any] = {"max_tokens": max_tokens, "logprobs": logprobs, "n": self.n,
                                  "prompt_logprobs": prompt_logprobs, "structured_outputs": self.constraint()}
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "top_k", "min_p",
                     "repetition_penalty", "min_tokens", "stop_token_ids", "ignore_eos",
                     "include_stop_str_in_output", "skip_special_tokens", "prompt_logprobs", "stop",
                     "allowed_token_ids", "truncate_prompt_tokens", "bad_words", "priority", "cache_salt",
                     "use_beam_search", "length_penalty"):
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        if self.logit_bias:
            bias = {}
            for key, value in self.logit_bias.items():
                if not key.strip().isdigit():
                    raise ValueError(f"logit_bias has key {key!r}: keys must be token ids")
                bias[int(key)] = value
            kwargs["logit_bias"] = bias
        return SamplingParams(**kwargs)


# Where each constraint field puts what the engine calls structured_outputs.<kind>: its errors name the former
_CONSTRAINT_PARTS = {
    "response_format": {"json": "response_format.json_schema.schema"},
    "text.format": {"json": "text.format.schema"},
    **{f"guided_{kind}": {kind: f"guided_{kind}"} for kind in ("json", "regex", "choice", "grammar")},
}


def constraint_names(field: str | None) -> dict[str, str]:
    """Engine name -> the client's, for an output constraint sent in `field` (None: no constraint)."""
    if field is None or field == "structured_outputs":
        return {}
    parts = {f"structured_outputs.{kind}": name for kind, name in _CONSTRAINT_PARTS.get(field, {}).items()}
    return {**parts, "structured_outputs": field}


def as_sent(message: str, names: dict[str, str]) -> str:
    """`message` with each engine field name of `names` replaced by the client's (whole names only: "logprobs"
    is renamed, "prompt_logprobs" is not unless named itself)."""
    if not names:
        return message
    pattern = "|".join(re.escape(name) for name in sorted(names, key=len, reverse=True))
    return re.sub(rf"(?<![\w.])(?:{pattern})(?![\w])", lambda m: names[m.group(0)], message)


@contextlib.contextmanager
def spelled_as_sent(names: dict[str, str]) -> Iterator[None]:
    """Within it, a ValueError from the engine's side is raised again in the client's field names."""
    try:
        yield
    except ValueError as e:
        if not names:
            raise
        raise ValueError(as_sent(str(e), names)) from None


def refuse_what_is_asked(body: BaseModel, nothing: dict[str, tuple[tuple[Any, ...], str]], where: str = "") -> None:
    """ValueError naming the first field of `nothing` (field -> (the values that ask for nothing, why others
    cannot be honoured)) that the body (at `where` in the request) sets to something else."""
    for name, (accepted, why) in nothing.items():
        value = getattr(body, name) if name in type(body).model_fields else accepted[0]
        if value not in accepted:
            raise ValueError(f"{where}{name}={_short(value)} is not supported: {why}")


# field -> (the values that ask for nothing, why others cannot be honoured)
_NOTHING: dict[str, tuple[tuple[Any, ...], str]] = {
    "logits_processors": ((None, []), "this server runs no code named by a request"),
    "guided_decoding_backend": ((None, "auto", "xgrammar"), "structured outputs are decoded by xgrammar"),
    "guided_whitespace_pattern": ((None,), "JSON outputs follow xgrammar's whitespace rules"),
    "structural_tag": ((None,), "give the constraint as structured_outputs or response_format"),
    "kv_transfer_params": ((None, {}), "this server does not transfer KV caches between servers"),
    "vllm_xargs": ((None, {}), "this server has no extensions that read them"),
    "store": ((None, False), "this server keeps no completions for later retrieval"),
    "service_tier": ((None, "auto", "default"), "this server has one tier"),
    "chat_template": ((None,), "the model's own chat template renders the messages"),
    "reasoning_effort": ((None,), "a chat template that reads it takes it from chat_template_kwargs"),
    "mm_processor_kwargs": ((None, {}), "this server serves text only"),
}


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = COMPLETIONS_DEFAULT_MAX_TOKENS
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True  # the tokenizer's special tokens (such as a BOS) around a text prompt

    def prompts(self) -> list[str | list[int]]:
        """The prompts: one (a text or token ids), or a batch of them (a list of either), whose prompt i's
        samples are the response's choices i*n to i*n+n-1, as OpenAI's."""
        prompt = self.prompt
        batch = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str | list)
        prompts = prompt if batch else [prompt]
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt[{i}] is empty" if batch else "prompt is empty")
        return prompts

    def scores_only(self) -> bool:
        """echo with max_tokens 0 (OpenAI's legacy way to score a text): the prompt, and its logprobs when
        asked for, with nothing generated."""
        return self.echo and self.max_tokens == 0

    def _echo_scores(self) -> bool:
        # echo with logprobs scores the prompt too: its tokens' logprobs come from prompt_logprobs
        return self.echo and self.logprobs is not None and self.prompt_logprobs is None

    def engine_names(self) -> dict[str, str]:
        # token ids are a prompt here: the engine checks them as prompt_token_ids (vLLM's prompt dict's key)
        names = {**super().engine_names(), "prompt_token_ids": "prompt"}
        return {**names, **({"prompt_logprobs": "logprobs"} if self._echo_scores() else {})}

    def to_sampling_params(self) -> SamplingParams:
        if self.suffix:
            raise ValueError("suffix is not supported (no model served here is trained for insertion)")
        # scoring only: the engine draws one token (a request runs until it has one), left out of the answer
        max_tokens = 1 if self.scores_only() else self.max_tokens
        return self.sampling_params(max_tokens, self.logprobs, self.logprobs if self._echo_scores() else None)


class TextPart(StrictBody):
    type: Literal["text"]
    text: str


class FunctionCall(StrictBody):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallParam(StrictBody):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictBody):
    role: str  # which roles exist, and what each may carry, is the engine's to say (pagedserve.chat.template)
    content: str | list[TextPart] | None = None
    name: str | None = None  # the participant's name, for a template that shows it
    tool_calls: list[ToolCallParam] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    reasoning: str | None = None  # an assistant's earlier reasoning (vLLM's name; the older one below)
    reasoning_content: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        for part in content if isinstance(content, list) else []:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"only text content parts are supported, got type {kind!r}")
        return content

    def as_dict(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "".join(p.text for p in self.content)
        return message


class _Templated(StrictBody):
    """How the chat template renders the messages (`pagedserve.chat.template.ChatOptions`)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None
    add_special_tokens: bool | None = None  # None: false, the template writes the special tokens

    def chat_options(self) -> ChatOptions:
        return ChatOptions(self.add_generation_prompt, self.continue_final_message, self.chat_template_kwargs or {},
                           self.documents, bool(self.add_special_tokens))


class ChatCompletionRequest(_Sampling, _Templated):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None  # checked by the engine (pagedserve.chat.tool_calls), as for gRPC
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    echo: bool = False  # vLLM's: the answer starts with the last message when that is the assistant's
    chat_template: str | None = None
    reasoning_effort: str | None = None
    include_reasoning: bool = True  # false: no reasoning fields (needs the engine's reasoning_parser)
    mm_processor_kwargs: dict[str, Any] | None = None

    def echoed(self) -> str | None:
        """The text the answer starts with under `echo`: the last message's, when the assistant wrote it (a
        start of the answer the model goes on from, with continue_final_message)."""
        last = self.messages[-1] if self.messages else None
        if not self.echo or last is None or last.role != "assistant":
            return None
        return last.as_dict().get("content") or ""

    def engine_names(self) -> dict[str, str]:
        names = super().engine_names()
        if self.top_logprobs is not None:  # the engine's logprobs is the number of alternatives
            names["logprobs"] = "top_logprobs"
        if self.max_completion_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        return names

    def to_sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens disagree: give one")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)


class TokenizeRequest(_Templated):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None  # with messages: the prompt offers them
    return_token_strs: bool = False

    def chat_options(self) -> ChatOptions:
        # add_special_tokens goes to the engine on its own: unset, it is true for a prompt, false for messages
        return dataclasses.replace(super().chat_options(), add_special_tokens=False)


class DetokenizeRequest(StrictBody):
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(StrictBody):
    """vLLM's body of `/v1/load_lora_adapter`."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(StrictBody):
    """vLLM's body of `/v1/unload_lora_adapter` (its lora_int_id is accepted and not needed: names are unique)."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


def parse(model: type[BaseModel], body: bytes) -> Any:
    """The body as `model`; ValueError naming the first wrong field."""
    try:
        return model.model_validate_json(body or b"{}")
    except ValidationError as e:
        error = e.errors(include_url=False)[0]
        where = _path(error["loc"]) or "body"
        got = error.get("input")
        shown = "" if error["type"] in ("missing", "json_invalid") else f", got {_short(got)}"
        raise ValueError(f"{where}: {error['msg']}{shown}") from None


def _path(loc: tuple[str | int, ...]) -> str:
    """pydantic's location as the engine names a field: `messages[0].content`, a list item by its index."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif _is_field(part):
            path += f".{part}" if path else part
    return path


def _is_field(part: str | int) -> bool:
    # pydantic names the union member it tried ('str', 'list[int]', 'function-after[...]'): not a field
    return isinstance(part, int) or (part.isidentifier() and part not in ("str", "int", "float", "bool"))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
