"""Tool calling: the tools a chat request offers, what `tool_choice` makes of the output, and the tool calls
parsed out of a sample's text as it grows.

`tool_choice="auto"` leaves the output free and parses the model's own format: Hermes / Qwen2.5
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`) or Llama 3.x JSON (`{"name": ...,
"parameters": {...}}`, several joined by `;`). `"required"` and a named function constrain the output with
a JSON schema (a non-empty array of calls, or the named function's arguments), so their calls are valid
whatever the model: the grammar, not the model's habits, decides what is well-formed.

Parsing is a pure function of the text so far, and every earlier result is a prefix of every later one
(content only grows, a call's arguments only grow), so a stream's deltas joined are exactly the unary
answer. Only pure Python here: the SDK imports `ToolCall` without the engine's dependencies.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pagedserve.sampling_params import StructuredOutputs

ToolCallFormat = Literal["hermes", "llama3_json"]
TOOL_CHOICE_MODES = ("none", "auto", "required")
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")  # OpenAI's rule for a function name
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
LLAMA_PYTHON_TAG = "<|python_tag|>"  # Llama 3.x may open a call with it (kept only with skip_special_tokens off)


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, its arguments' JSON schema, and what it does."""

    name: str
    parameters: dict[str, Any]
    description: str | None = None

    def as_openai(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    mode: Literal["none", "auto", "required", "function"]
    function: str | None = None  # the named function, with mode "function"


@dataclass
class ToolCall:
    """A parsed call, as OpenAI's `tool_calls[i]`: `arguments` is JSON text."""

    id: str
    name: str
    arguments: str


@dataclass
class ToolCallDelta:
    """What a stream adds to call `index`: its id and name on the call's first delta, then arguments text."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass(frozen=True)
class ToolParsing:
    """How one request's samples are parsed: plain data, so it crosses processes with the request.

    mode "auto": the model's `format`; "required": a JSON array of {"name", `args_key`} objects; "function":
    the whole text is the arguments of `function`. `max_calls` 1 when parallel calls are off."""

    mode: Literal["auto", "required", "function"]
    format: ToolCallFormat = "hermes"
    function: str | None = None
    max_calls: int | None = None

    @property
    def args_key(self) -> str:
        return "parameters" if self.format == "llama3_json" else "arguments"


def parse_tools(tools: Any) -> list[Tool]:
    """OpenAI's `tools` list as `Tool`s; ValueError naming the bad entry and field."""
    if tools is None:
        return []
    if not isinstance(tools, list | tuple):
        raise ValueError(f"tools must be a list of function tools, got {type(tools).__name__}")
    out: list[Tool] = []
    for i, entry in enumerate(tools):
        where = f"tools[{i}]"
        function = entry.get("function") if isinstance(entry, dict) and entry.get("type") == "function" else None
        if not isinstance(function, dict):
            raise ValueError(f"{where} must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}")
        unknown = set(entry) - {"type", "function"}
        unknown |= {f"function.{k}" for k in set(function) - {"name", "description", "parameters", "strict"}}
        if unknown:
            raise ValueError(f"{where} has unknown fields {sorted(unknown)}")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"{where}.function.name={name!r} must be 1-64 letters, digits, '_', '.' or '-'")
        if any(t.name == name for t in out):
            raise ValueError(f"{where}.function.name={name!r} is given twice")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise ValueError(f"{where}.function.description must be a string")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise ValueError(f"{where}.function.parameters must be a JSON schema object")
        out.append(Tool(name, parameters, description))
    return out


def parse_tool_choice(choice: Any, tools: list[Tool]) -> ToolChoice:
    """OpenAI's `tool_choice` against the tools offered; absent means "auto" with tools, "none" without."""
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(choice, str):
        if choice not in TOOL_CHOICE_MODES:
            raise ValueError(f"tool_choice={choice!r} must be one of {TOOL_CHOICE_MODES} or "
                             "{'type': 'function', 'function': {'name': ...}}")
        if choice != "none" and not tools:
            raise ValueError(f"tool_choice={choice!r} needs tools")
        return ToolChoice(choice)
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ValueError(f"tool_choice={choice!r} must be one of {TOOL_CHOICE_MODES} or "
                         "{'type': 'function', 'function': {'name': ...}}")
    if not any(t.name == name for t in tools):
        raise ValueError(f"tool_choice names function {name!r}, which is not among tools "
                         f"({', '.join(t.name for t in tools) or 'none given'})")
    return ToolChoice("function", name)


def plan(tools: list[Tool], choice: ToolChoice, parallel_tool_calls: bool | None,
         fmt: ToolCallFormat | None) -> tuple[StructuredOutputs | None, ToolParsing | None]:
    """The output constraint and the parsing a request's tool choice asks for. `fmt` is the chat template's
    format (None: one this module cannot parse, where only grammar-enforced choices work)."""
    max_calls = 1 if parallel_tool_calls is False else None
    if choice.mode == "none":
        return None, None
    if choice.mode == "auto":
        if fmt is None:
            raise ValueError("tool_choice='auto': this model's chat template writes tool calls in a format "
                             "pagedserve cannot parse; use tool_choice='required' or a named function")
        return None, ToolParsing("auto", fmt, max_calls=max_calls)
    if choice.mode == "function":
        tool = next(t for t in tools if t.name == choice.function)
        return StructuredOutputs(json=tool.parameters), ToolParsing("function", fmt or "hermes", tool.name)
    parsing = ToolParsing("required", fmt or "hermes", max_calls=max_calls)
    return StructuredOutputs(json=calls_schema(tools, parsing.args_key, max_calls)), parsing


def calls_schema(tools: list[Tool], args_key: str, max_calls: int | None) -> dict[str, Any]:
    """The JSON schema of `required`'s output: a non-empty array of calls, each {"name", `args_key`} of one
    tool. A tool's parameters that refer to themselves (`$ref` "#/$defs/X", "#/definitions/X", "#") would
    point at this array's root once nested here, so they move whole under the root's `$defs`, named by the
    tool (names are unique), their references rewritten to follow."""
    defs: dict[str, Any] = {}
    calls = []
    for t in tools:
        parameters = t.parameters
        home = f"#/$defs/{t.name}"
        rebased = _rebased(parameters, home)
        if rebased != parameters:  # it has local references
            defs[t.name], parameters = rebased, {"$ref": home}
        calls.append({"type": "object", "properties": {"name": {"type": "string", "enum": [t.name]},
                                                      args_key: parameters},
                      "required": ["name", args_key], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    if defs:
        schema["$defs"] = defs
    return schema


# Keywords whose values are JSON data, not schemas: a "$ref" in them is data, never a reference.
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})
# Keywords whose values map names to schemas: a property may be named "enum" and still be a schema.
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _rebased(schema: Any, home: str) -> Any:
    """`schema` with its local references ("#", "#/...") resolved from `home` instead of the document's root.
    Other references (anchors, other documents) do not depend on where the schema sits: kept as they are."""
    if isinstance(schema, list):
        return [_rebased(item, home) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = home + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _rebased(sub, home) for name, sub in value.items()}
        else:
            out[key] = _rebased(value, home)
    return out


# ---- parsing --------------------------------------------------------------------------------------------

_Item = tuple[str, str] | tuple[str, str, str]  # ("text", text) | ("call", name, arguments)


def _call_from(obj: Any, args_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments JSON) if `obj` is a call object; None otherwise."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in args_keys:
        if key in obj:
            args = obj[key]
            return (obj["name"], json.dumps(args, ensure_ascii=False)) if isinstance(args, dict) else None
    return None


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _hermes_items(text: str, final: bool) -> list[_Item]:
    items: list[_Item] = []
    pos = 0
    while True:
        start = text.find(HERMES_OPEN, pos)
        if start < 0:
            tail = text[pos:]
            if not final:
                tail = tail[:len(tail) - _held_prefix(tail, HERMES_OPEN)]
            items.append(("text", tail))
            return items
        items.append(("text", text[pos:start]))
        body_start = start + len(HERMES_OPEN)
        end = text.find(HERMES_CLOSE, body_start)
        if end < 0 and not final:
            return items  # an open block: nothing of it is known yet
        body = text[body_start:end if end >= 0 else len(text)]
        call = None
        try:
            call = _call_from(json.loads(body), ("arguments", "parameters"))
        except ValueError:
            pass
        stop = end + len(HERMES_CLOSE) if end >= 0 else len(text)
        items.append(("call", *call) if call else ("text", text[start:stop]))
        if end < 0:
            return items
        pos = stop


def _llama_items(text: str, final: bool) -> list[_Item]:
    """Llama 3.x: the whole answer is one call object, or several joined by ';'; anything else is text."""
    decoder = json.JSONDecoder()
    items: list[_Item] = []
    stripped = text.lstrip()
    pos = len(text) - len(stripped) + len(LLAMA_PYTHON_TAG) if stripped.startswith(LLAMA_PYTHON_TAG) else 0
    while True:
        start = len(text) - len(text[pos:].lstrip())
        if start == len(text):
            if items or not final:
                return items  # only whitespace yet: a call may still come
            return [("text", text)]
        if text[start] != "{":
            return items + [("text", text[pos:])]
        try:
            obj, end = decoder.raw_decode(text, start)
        except ValueError:
            if final:
                return items + [("text", text[pos:])]
            return items  # an object still being written
        call = _call_from(obj, ("parameters", "arguments"))
        if call is None:
            return items + [("text", text[pos:])]
        items.append(("call", *call))
        rest = text[end:].lstrip()
        if not rest.startswith(";"):
            return items + [("text", text[end:])] if rest else items
        pos = end + text[end:].index(";") + 1


def _array_items(text: str, final: bool, args_key: str) -> list[_Item]:
    """`required`: the grammar makes the text a JSON array of call objects; each is taken once complete."""
    decoder = json.JSONDecoder()
    items: list[_Item] = []
    pos = text.find("[") + 1
    while pos > 0:
        while pos < len(text) and text[pos] in " \n\t,":
            pos += 1
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except ValueError:
            break
        call = _call_from(obj, (args_key,))
        if call is None:
            break
        items.append(("call", *call))
    if final and not items:
        return [("text", text)]  # cut short before its first call (max_tokens): show what there is
    return items


def _named_call(name: str, text: str, final: bool) -> tuple[str, list[tuple[str, str]]]:
    """A named function: the grammar makes the whole text its arguments, taken once they are a whole JSON
    object (after which the grammar allows nothing more), so a call cut short (max_tokens) is never sent half;
    cut short, its text is shown as is, as `required`'s."""
    whole = False
    if text.rstrip().endswith("}"):  # only then can it be whole: a growing text is not parsed at every step
        try:
            whole = isinstance(json.loads(text), dict)
        except ValueError:
            pass
    if not whole:
        return (text if final else ""), []
    return "", [(name, text)]


def split(parsing: ToolParsing, text: str, final: bool) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) of a sample's text so far; `final` once the sample has finished."""
    if parsing.mode == "function":
        return _named_call(parsing.function or "", text, final)
    if parsing.mode == "required":
        items = _array_items(text, final, parsing.args_key)
    elif parsing.format == "llama3_json":
        items = _llama_items(text, final)
    else:
        items = _hermes_items(text, final)
    calls = [(item[1], item[2]) for item in items if item[0] == "call"]
    if parsing.max_calls is not None:
        calls = calls[:parsing.max_calls]
    return _content(items, final), calls


def _content(items: list[_Item], final: bool) -> str:
    """The text around the calls. Whitespace that touches a call is layout, not content; the end of the
    text so far is held back while a call may still follow it."""
    merged: list[_Item] = []
    for item in items:
        if item[0] == "text" and merged and merged[-1][0] == "text":
            merged[-1] = ("text", merged[-1][1] + item[1])
        else:
            merged.append(item)
    parts = []
    for i, item in enumerate(merged):
        if item[0] != "text":
            continue
        text = item[1]
        after_call = i > 0
        last = i == len(merged) - 1
        if after_call:
            text = text.lstrip()
        if not last or not final:
            text = text.rstrip()  # a call follows, or may
        if text:
            parts.append(text)
    return "\n".join(parts)


def join_deltas(calls: list[ToolCall], deltas: list[ToolCallDelta]) -> None:
    """Add a stream's tool-call deltas to the calls they extend (a new index starts a call)."""
    for delta in deltas:
        if delta.index == len(calls):
            calls.append(ToolCall(delta.id or "", delta.name or "", delta.arguments))
        else:
            calls[delta.index].arguments += delta.arguments


class ToolCallStream:
    """One sample's tool calls and content as its text grows: `update` returns what is new since the last
    call (the same parse, whole, gives the unary answer)."""

    def __init__(self, parsing: ToolParsing) -> None:
        self.parsing = parsing
        self.calls: list[ToolCall] = []
        self._content_sent = 0

    def update(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        content, calls = split(self.parsing, text, final)
        new_content, self._content_sent = content[self._content_sent:], max(self._content_sent, len(content))
        deltas: list[ToolCallDelta] = []
        for i, (name, arguments) in enumerate(calls):
            if i == len(self.calls):
                self.calls.append(ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, arguments))
                deltas.append(ToolCallDelta(i, arguments, self.calls[i].id, name))
            elif len(arguments) > len(self.calls[i].arguments):
                deltas.append(ToolCallDelta(i, arguments[len(self.calls[i].arguments):]))
                self.calls[i].arguments = arguments
        return new_content, deltas

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" when the model chose to call (auto, required) and stopped by itself."""
        if reason == "stop" and self.calls and self.parsing.mode != "function":
            return "tool_calls"
        return reason
