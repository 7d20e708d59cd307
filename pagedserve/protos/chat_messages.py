"""Chat messages, tools and tool choices: OpenAI's dict shapes <-> the proto's messages, both ways, so the
SDK and the gRPC service speak the shapes the engine (and every OpenAI client) uses. Values are checked by the
engine (pagedserve.chat.template, pagedserve.chat.tool_calls); here only what the wire cannot carry is refused."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from pagedserve.chat.template import MESSAGE_FIELDS, ChatOptions, message_reasoning
from pagedserve.protos import pagedserve_pb2 as pb


def messages_to_proto(messages: Sequence[dict[str, Any]]) -> list[pb.ChatMessage]:
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a dict with role and content, got {type(message).__name__}")
        extra = set(message) - set(MESSAGE_FIELDS)
        if extra:  # dropped silently, they would change the prompt unseen
            raise ValueError(f"messages[{i}]: unsupported keys {sorted(extra)} (known: {', '.join(MESSAGE_FIELDS)})")
        if "role" not in message or ("content" not in message and not message.get("tool_calls")):
            raise ValueError(f"messages[{i}] needs both 'role' and 'content'")
        msg = pb.ChatMessage(role=message["role"], content=message.get("content") or "",
                             tool_call_id=message.get("tool_call_id") or "", name=message.get("name") or "",
                             reasoning=message_reasoning(f"messages[{i}]", message) or "")
        for j, call in enumerate(message.get("tool_calls") or []):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict):
                raise ValueError(f"messages[{i}].tool_calls[{j}] must be {{'id': ..., 'type': 'function', "
                                 "'function': {'name': ..., 'arguments': ...}}")
            arguments = function.get("arguments", "{}")
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments)
            msg.tool_calls.append(pb.ToolCall(id=call.get("id") or "", name=function.get("name", ""),
                                              arguments=arguments))
        out.append(msg)
    return out


def messages_from_proto(messages: Sequence[pb.ChatMessage]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments or "{}"}}
                                     for c in m.tool_calls]
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        if m.reasoning:
            message["reasoning"] = m.reasoning
        if m.name:
            message["name"] = m.name
        out.append(message)
    return out


def tools_to_proto(tools: Sequence[dict[str, Any]] | None) -> list[pb.Tool]:
    out = []
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                             "'parameters': ...}}")
        parameters = function.get("parameters")
        out.append(pb.Tool(name=function.get("name", ""), description=function.get("description"),
                           parameters=json.dumps(parameters) if parameters is not None else ""))
    return out


def tools_from_proto(tools: Sequence[pb.Tool]) -> list[dict[str, Any]]:
    out = []
    for i, t in enumerate(tools):
        function: dict[str, Any] = {"name": t.name}
        if t.HasField("description"):
            function["description"] = t.description
        if t.parameters:
            try:
                function["parameters"] = json.loads(t.parameters)
            except ValueError:
                raise ValueError(f"tools[{i}].parameters is not valid JSON: {t.parameters[:60]!r}") from None
        out.append({"type": "function", "function": function})
    return out


def tool_choice_to_proto(choice: str | dict[str, Any] | None) -> pb.ToolChoice | None:
    """"none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}."""
    if choice is None:
        return None
    if isinstance(choice, str):
        return pb.ToolChoice(mode=choice)
    function = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(f"tool_choice={choice!r} must be 'none', 'auto', 'required' or "
                         "{'type': 'function', 'function': {'name': ...}}")
    return pb.ToolChoice(function=function["name"])


def tool_choice_from_proto(request: pb.ChatRequest) -> str | dict[str, Any] | None:
    which = request.tool_choice.WhichOneof("choice") if request.HasField("tool_choice") else None
    if which == "function":
        return {"type": "function", "function": {"name": request.tool_choice.function}}
    return request.tool_choice.mode if which == "mode" else None


TEMPLATE_OPTIONS = tuple(f.name for f in fields(ChatOptions))  # the SDK's keywords for them


def chat_options_to_proto(add_generation_prompt: bool | None = None, continue_final_message: bool = False,
                          chat_template_kwargs: dict[str, Any] | None = None,
                          documents: Sequence[dict[str, str]] | None = None,
                          add_special_tokens: bool = False) -> pb.ChatTemplateOptions:
    """The template options (`ChatOptions`'s fields) as the wire carries them: the variables as JSON text."""
    try:
        kwargs = json.dumps(chat_template_kwargs) if chat_template_kwargs is not None else ""
    except TypeError as e:
        raise ValueError(f"chat_template_kwargs must hold JSON values: {e}") from None
    docs = []
    for i, doc in enumerate(documents or []):
        if not isinstance(doc, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in doc.items()):
            raise ValueError(f"documents[{i}] must be a dict of strings, got {doc!r:.60}")
        docs.append(pb.Document(fields=doc))
    return pb.ChatTemplateOptions(add_generation_prompt=add_generation_prompt,
                                  continue_final_message=continue_final_message, chat_template_kwargs=kwargs,
                                  documents=docs, add_special_tokens=add_special_tokens)


def chat_options_from_proto(options: pb.ChatTemplateOptions) -> ChatOptions:
    """ValueError naming the field if the variables are not a JSON object."""
    kwargs: Any = {}
    if options.chat_template_kwargs:
        try:
            kwargs = json.loads(options.chat_template_kwargs)
        except ValueError:
            raise ValueError(f"template.chat_template_kwargs is not valid JSON: "
                             f"{options.chat_template_kwargs[:60]!r}") from None
        if not isinstance(kwargs, dict):
            raise ValueError(f"template.chat_template_kwargs must be a JSON object, got "
                             f"{options.chat_template_kwargs[:60]!r}")
    add = options.add_generation_prompt if options.HasField("add_generation_prompt") else True
    documents = [dict(d.fields) for d in options.documents] or None
    return ChatOptions(add, options.continue_final_message, kwargs, documents, options.add_special_tokens)
