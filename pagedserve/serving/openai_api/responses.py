"""OpenAI's Responses API (`POST /v1/responses`) on the chat path: the request's input items become chat
messages (its instructions the system's), its function tools and tool choice the chat's, its text format an
output constraint; the answer's reasoning, text and function calls become output items, whole or as the
Responses stream's events.

Nothing is stored: a response is answered and forgotten, so `store: true`, `previous_response_id`,
`conversation` and `background` ask for what this server does not keep, and are refused by name (send the
conversation in `input`, as a stateless client does). Hosted tools (web search, file search, ...) and
non-text input are refused by name too.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import Field

from pagedserve.chat.reasoning import ReasoningStart, reasoning_tokens
from pagedserve.chat.template import ChatOptions
from pagedserve.chat.tool_calls import ToolCallDelta
from pagedserve.sampling_params import SamplingParams, StructuredOutputs
from pagedserve.serving.deltas import Delta, cached_of
from pagedserve.serving.error_status import classify
from pagedserve.serving.openai_api.protocol import StrictBody, constraint_names, refuse_what_is_asked, spelled_as_sent


class TextFormat(StrictBody):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # strict or not, the schema is enforced


class TextConfig(StrictBody):
    format: TextFormat | None = None


class ReasoningConfig(StrictBody):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(StrictBody):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = None  # the client's tags, returned on the response
    user: str | None = None  # the end user's id, for the operator's records; it does not change the output
    safety_identifier: str | None = None  # as `user`
    prompt_cache_key: str | None = None  # OpenAI's routing hint: the prefix cache here finds prefixes itself
    max_tool_calls: int | None = None  # bounds hosted tools' calls, and this server runs none
    # "auto": a conversation too long for the context loses its oldest turns (a chat's truncate_prompt_tokens
    # -1); "disabled", the default: it is refused
    truncation: Literal["auto", "disabled"] | None = None
    # Fields that change nothing when asked for nothing: accepted then, refused by name otherwise (`_NOTHING`)
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    service_tier: str | None = None
    prompt: dict[str, Any] | None = None
    stream_options: dict[str, Any] | None = None
    # vLLM's extensions
    chat_template_kwargs: dict[str, Any] | None = None  # more template variables, such as Qwen3's enable_thinking
    request_id: str | None = None
    priority: int | None = None
    cache_salt: str | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    def sampling_params(self) -> SamplingParams:
        """ValueError naming the field for a value out of range or a field that cannot be honoured."""
        refuse_what_is_asked(self, _NOTHING)
        if self.reasoning is not None:
            refuse_what_is_asked(self.reasoning, _REASONING_NOTHING, "reasoning.")
        with spelled_as_sent(self.engine_names()):
            constraint = self.constraint()
        kwargs: dict[str, Any] = {"max_tokens": self.max_output_tokens, "structured_outputs": constraint}
        if self.truncation == "auto":
            kwargs["truncate_prompt_tokens"] = -1
        for name in ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty", "stop", "ignore_eos",
                     "priority", "cache_salt"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        with spelled_as_sent(self.engine_names()):
            return SamplingParams(**kwargs)

    def engine_names(self) -> dict[str, str]:
        """The engine's names of the fields this body sent under other names (engine name -> the body's)."""
        fmt = self.text.format if self.text is not None else None
        constrained = fmt is not None and fmt.type != "text"
        return {**constraint_names("text.format" if constrained else None), "max_tokens": "max_output_tokens",
                "truncate_prompt_tokens": "truncation"}

    def constraint(self) -> StructuredOutputs | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputs(json_object=True)
        if fmt.schema_ is None:
            raise ValueError("text.format.schema is required with type 'json_schema'")
        return StructuredOutputs(json=fmt.schema_)

    def messages(self) -> list[dict[str, Any]]:
        """The conversation as chat messages (checked again, by role and field, by the engine); ValueError
        naming the input item that cannot be one."""
        out: list[dict[str, Any]] = []
        if self.instructions:
            out.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*out, {"role": "user", "content": self.input}]
        reasoning: str | None = None  # a reasoning item's text, for the assistant turn it precedes
        for i, item in enumerate(self.input):
            where = f"input[{i}]"
            if not isinstance(item, dict):
                raise ValueError(f"{where} must be an object (a message or another input item)")
            kind = item.get("type", "message")
            _known_keys(where, item, _ITEM_KEYS.get(kind, ()))
            if kind == "message":
                message = {"role": item.get("role"), "content": _text(f"{where}.content", item.get("content"))}
                if message["role"] == "assistant" and reasoning is not None:
                    message["reasoning"], reasoning = reasoning, None
                out.append(message)
            elif kind == "function_call":
                call = {"type": "function", "id": _string(where, item, "call_id"), "function": {
                    "name": _string(where, item, "name"), "arguments": _string(where, item, "arguments")}}
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant" and reasoning is None:
                    last.setdefault("tool_calls", []).append(call)  # the calls of one turn, joined
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
                    if reasoning is not None:
                        out[-1]["reasoning"], reasoning = reasoning, None
            elif kind == "function_call_output":
                out.append({"role": "tool", "tool_call_id": _string(where, item, "call_id"),
                            "content": _text(f"{where}.output", item.get("output"))})
            elif kind == "reasoning":
                if item.get("encrypted_content") is not None:
                    raise ValueError(f"{where}.encrypted_content is not supported: this server encrypts no "
                                     "reasoning (send its text as content)")
                parts = item.get("content") or item.get("summary") or []
                text = _text(f"{where}.content", parts) if parts else ""
                reasoning = text if reasoning is None else reasoning + "\n" + text
            else:
                raise ValueError(f"{where}.type={kind!r} is not supported: input items are messages, "
                                 "function_call, function_call_output and reasoning")
        if reasoning is not None:
            out.append({"role": "assistant", "content": "", "reasoning": reasoning})
        return out

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """The function tools in the chat's shape; ValueError naming a tool this server cannot run."""
        if self.tools is None:
            return None
        out = []
        for i, tool in enumerate(self.tools):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"tools[{i}].type={kind!r} is not supported: this server runs no hosted tools "
                                 "(give function tools, which the client runs)")
            _known_keys(f"tools[{i}]", tool, ("type", "name", "description", "parameters", "strict"))
            out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
        return out

    def chat_options(self) -> ChatOptions:
        return ChatOptions(chat_template_kwargs=self.chat_template_kwargs or {})

    def chat_tool_choice(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function" or set(choice) != {"type", "name"}:
                raise ValueError(f"tool_choice={choice!r} is not supported: give 'none', 'auto', 'required' or "
                                 "{'type': 'function', 'name': ...}")
            return {"type": "function", "function": {"name": choice["name"]}}
        return choice


_NOTHING: dict[str, tuple[tuple[Any, ...], str]] = {
    "store": ((None, False), "this server keeps no responses: it answers and forgets (send store: false)"),
    "previous_response_id": ((None,), "this server keeps no responses to go on from: send the conversation "
                                      "in input"),
    "conversation": ((None,), "this server keeps no conversations: send the conversation in input"),
    "background": ((None, False), "this server answers while the request is open, not in the background"),
    "include": ((None, []), "this server adds no optional output data"),
    "top_logprobs": ((None, 0), "logprobs are given by /v1/chat/completions"),
    "service_tier": ((None, "auto", "default"), "this server has one tier"),
    "prompt": ((None,), "this server keeps no prompt templates"),
    "stream_options": ((None, {}, {"include_obfuscation": False}), "this server pads no stream events"),
}
_REASONING_NOTHING: dict[str, tuple[tuple[Any, ...], str]] = {
    "effort": ((None,), "a chat template that reads it takes it from /v1/chat/completions' chat_template_kwargs"),
    "summary": ((None,), "this server returns the reasoning itself, not a summary of it"),
    "generate_summary": ((None,), "this server returns the reasoning itself, not a summary of it"),
}
_ITEM_KEYS: dict[str, tuple[str, ...]] = {
    "message": ("type", "role", "content", "id", "status"),
    "function_call": ("type", "id", "call_id", "name", "arguments", "status"),
    "function_call_output": ("type", "id", "call_id", "output", "status"),
    "reasoning": ("type", "id", "summary", "content", "encrypted_content", "status"),
}
_TEXT_PARTS = ("input_text", "output_text", "text", "reasoning_text", "summary_text")


def _known_keys(where: str, item: dict[str, Any], known: tuple[str, ...]) -> None:
    unknown = sorted(set(item) - set(known))
    if unknown and known:
        raise ValueError(f"{where} has unknown fields {unknown} (known: {', '.join(known)})")


def _string(where: str, item: dict[str, Any], key: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ValueError(f"{where}.{key} must be a string")
    return value


def _text(where: str, content: Any) -> str:
    """A content's text: a string, or text parts joined; ValueError naming a part that is not text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ValueError(f"{where}[{j}].type={kind!r} is not supported: this server takes text parts "
                             f"({', '.join(_TEXT_PARTS)}) with their text")
        texts.append(part["text"])
    return "".join(texts)


class ResponseBuilder:
    """One response's output items, built from its chat deltas, and the stream's events that build them: a
    reasoning item, then message items for the text and function_call items for the calls, in the order the
    model wrote them. `whole` returns the response; `sse` streams the events (server-sent, `event:` and
    `data:` lines)."""

    def __init__(self, rid: str, created: int, model: str, body: ResponsesRequest,
                 reasoning: ReasoningStart | None, reasoning_end_id: int | None) -> None:
        self.rid, self.created, self.model, self.body = rid, created, model, body
        self.reasoning_start, self.reasoning_end_id = reasoning, reasoning_end_id
        self.items: list[dict[str, Any]] = []
        self._index: dict[str, int] = {}  # an item's place in `items`, by its id
        self._open: dict[str, Any] | None = None  # the item being written
        self._calls: dict[int, dict[str, Any]] = {}  # the function_call items by the chat's call index
        self._events: list[dict[str, Any]] = []  # made and not yet sent
        self._streaming = False  # events are made only for a stream
        self._sequence = 0
        self.token_ids: list[int] = []
        self.reasoning_text = ""
        self.usage: dict[str, Any] = {}
        self.finish_reason: str | None = None

    # ---- the response ----

    def response(self, status: str) -> dict[str, Any]:
        body = self.body
        fmt = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format \
            else {"type": "text"}
        out: dict[str, Any] = {
            "id": self.rid, "object": "response", "created_at": self.created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if self.finish_reason == "length" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": body.max_tool_calls, "metadata": body.metadata or {}, "model": self.model,
            "output": self.items if status != "in_progress" else [],
            "parallel_tool_calls": body.parallel_tool_calls is not False, "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None}, "store": False, "temperature": body.temperature,
            "text": {"format": fmt}, "tool_choice": body.tool_choice or ("auto" if body.tools else "none"),
            "tools": body.tools or [], "top_p": body.top_p, "truncation": body.truncation or "disabled",
            "user": body.user,
            "background": False, "usage": None,
        }
        if status != "in_progress" and self.usage:
            u = self.usage
            thought = 0 if self.reasoning_start is None or self.reasoning_end_id is None else reasoning_tokens(
                self.reasoning_start, self.token_ids, self.reasoning_end_id, self.reasoning_text)
            out["usage"] = {"input_tokens": u["prompt_tokens"],
                            "input_tokens_details": {"cached_tokens": cached_of(u)},
                            "output_tokens": u["completion_tokens"],
                            "output_tokens_details": {"reasoning_tokens": thought},
                            "total_tokens": u["total_tokens"]}
        return out

    def _status(self) -> str:
        return {"length": "incomplete", "abort": "cancelled"}.get(self.finish_reason or "", "completed")

    # ---- events ----

    def _event(self, kind: str, **fields: Any) -> None:
        if self._streaming:
            self._events.append({"type": kind, "sequence_number": self._sequence, **fields})
            self._sequence += 1

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self._index[item["id"]]}

    def _start(self, item: dict[str, Any], part: dict[str, Any] | None) -> dict[str, Any]:
        self._close("completed")
        self._index[item["id"]] = len(self.items)
        self.items.append(item)
        self._open = item
        self._event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item, content=[])
                    if "content" in item else dict(item))
        if part is not None:
            item["content"].append(part)
            self._event("response.content_part.added", **self._where(item), content_index=0, part=dict(part))
        return item

    def _close(self, status: str) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        item["status"] = status
        where = self._where(item)
        if item["type"] == "function_call":
            self._event("response.function_call_arguments.done", **where, name=item["name"],
                        arguments=item["arguments"])
        else:
            part = item["content"][0]
            if item["type"] == "message":
                self._event("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[])
            else:
                self._event("response.reasoning_text.done", **where, content_index=0, text=part["text"])
            self._event("response.content_part.done", **where, content_index=0, part=dict(part))
        self._event("response.output_item.done", output_index=where["output_index"], item=item)

    def add(self, d: Delta) -> None:
        self.token_ids += d.token_ids
        self.usage = d.usage or self.usage
        if d.reasoning:
            self.reasoning_text += d.reasoning
            item = self._open if self._open is not None and self._open["type"] == "reasoning" else self._start(
                {"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "summary": [], "content": [],
                 "status": "in_progress"}, {"type": "reasoning_text", "text": ""})
            item["content"][0]["text"] += d.reasoning
            self._event("response.reasoning_text.delta", **self._where(item), content_index=0, delta=d.reasoning)
        if d.text:
            item = self._open if self._open is not None and self._open["type"] == "message" else self._start(
                {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "status": "in_progress",
                 "content": []}, {"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            item["content"][0]["text"] += d.text
            self._event("response.output_text.delta", **self._where(item), content_index=0, delta=d.text,
                        logprobs=[])
        for call in d.tool_calls:
            self._call(call)
        if d.finish_reason is not None:
            self.finish_reason = d.finish_reason

    def _call(self, call: ToolCallDelta) -> None:
        if call.id is not None:  # a new call: its id and name come first
            self._calls[call.index] = self._start(
                {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "call_id": call.id, "name": call.name,
                 "arguments": "", "status": "in_progress"}, None)
        item = self._calls[call.index]
        if call.arguments:
            item["arguments"] += call.arguments
            self._event("response.function_call_arguments.delta", **self._where(item), delta=call.arguments)

    def _finish(self) -> dict[str, Any]:
        """The last item closed, and the response as it ends: completed, or incomplete (cut short by
        max_output_tokens, or cancelled by an abort)."""
        status = self._status()
        self._close("completed" if status == "completed" else "incomplete")
        response = self.response(status)
        self._event("response.completed" if status == "completed" else "response.incomplete", response=response)
        return response

    async def whole(self, first: Delta | None, deltas: AsyncIterator[Delta]) -> dict[str, Any]:
        d = first
        while d is not None:
            self.add(d)
            d = await anext(deltas, None)
        return self._finish()

    async def sse(self, first: Delta | None, deltas: AsyncIterator[Delta]) -> AsyncIterator[str]:
        self._streaming = True
        self._event("response.created", response=self.response("in_progress"))
        self._event("response.in_progress", response=self.response("in_progress"))
        d = first
        try:
            while d is not None:
                self.add(d)
                for chunk in self._drain():
                    yield chunk
                d = await anext(deltas, None)
            self._finish()
        except Exception as e:  # mid-stream: the status line is gone, report it as the stream's error event
            err = classify(e)
            self._event("error", code=str(err.http_status), message=err.message, param=err.param)
        for chunk in self._drain():
            yield chunk

    def _drain(self) -> list[str]:
        events, self._events = self._events, []
        return [f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events]
