"""Conversations to prompts: messages checked in OpenAI's shape (one place for every front end), rendered
through the model's chat template together with the tools offered, and the tool-call format the template
teaches the model.

A template that ignores `tools` (a model not trained for tool calling, such as the embedded SmolLM2) gets
the Hermes instructions in its system message, and past calls and results written into the messages as
Hermes text, so the model sees the tools and its history either way, and its calls are parsed as Hermes.
"""

from __future__ import annotations

import functools
import inspect
import json
from dataclasses import dataclass, field, fields
from typing import Any

from pagedserve.chat.reasoning import ReasoningStart
from pagedserve.chat.tool_calls import (
    HERMES_CLOSE,
    HERMES_OPEN,
    LLAMA_PYTHON_TAG,
    Tool,
    ToolCallFormat,
    ToolParsing,
)
from pagedserve.sampling_params import SamplingParams

# "developer": OpenAI's newer name for the system role, which the models served here know as "system"
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MESSAGE_FIELDS = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning", "reasoning_content")

_HERMES_TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> \
XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass
class ChatPlan:
    """What a chat request becomes: the prompt's token ids, the sampling parameters (with the output
    constraint the tool choice asks for), how to parse the samples' tool calls (None: no tools in play), and
    where their reasoning begins (None: no reasoning parser; see `pagedserve.chat.reasoning`) and the token that
    ends it (`</think>`'s id)."""

    prompt_token_ids: list[int]
    params: SamplingParams
    tool_parsing: ToolParsing | None = None
    reasoning: ReasoningStart | None = None
    reasoning_end_id: int | None = None


@dataclass(frozen=True)
class ChatOptions:
    """How the chat template turns a conversation into a prompt, beyond its messages and tools (vLLM's
    fields of the same names).

    `add_generation_prompt`: end with the assistant's turn opened, for the model to answer.
    `continue_final_message`: leave the last message open instead, for the model to go on writing it (the
    start of its answer, given); not with `add_generation_prompt`.
    `chat_template_kwargs`: more variables for the template, such as Qwen3's `enable_thinking`. A template
    that does not read one renders as without it, as with transformers' `apply_chat_template`.
    `documents`: texts for a template that grounds its answers in them (retrieval-augmented generation),
    each an object of strings such as {"title": ..., "text": ...}; a template without a place for them
    renders as without them.
    `add_special_tokens`: the tokenizer's special tokens (such as a BOS) added to the rendered prompt, on top
    of those the template writes itself (most templates write them all)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    documents: list[dict[str, str]] | None = None
    add_special_tokens: bool = False

    def __post_init__(self) -> None:
        for name in ("add_generation_prompt", "continue_final_message", "add_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be true or false")
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("continue_final_message=true leaves the last message open for the model to go on "
                             "writing: it cannot be combined with add_generation_prompt=true, which opens a new "
                             "turn (set add_generation_prompt to false)")
        kwargs = self.chat_template_kwargs
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise ValueError(f"chat_template_kwargs={kwargs!r} must be an object of template variables by name")
        docs = self.documents
        if docs is not None and (not isinstance(docs, list | tuple) or not all(
                isinstance(d, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in d.items())
                for d in docs)):
            raise ValueError(f"documents={docs!r} must be a list of objects of strings, such as "
                             "{\"title\": ..., \"text\": ...}")
        reserved = sorted(set(kwargs) & _reserved_template_names())
        if reserved:
            raise ValueError(f"chat_template_kwargs: {reserved} are set by the server (the conversation, the "
                             "tools and how they are rendered), not template variables a request may set")

    def changed(self) -> list[str]:
        """The names of the options that differ from their defaults."""
        default = ChatOptions()
        return [f.name for f in fields(self) if getattr(self, f.name) != getattr(default, f.name)]


@functools.cache
def _reserved_template_names() -> frozenset[str]:
    """What a request's template variables may not override: the names the renderer passes to the template
    itself, and `apply_chat_template`'s own parameters (`tokenize`, `return_dict`, ...), which a variable of
    that name would set instead."""
    from transformers import PreTrainedTokenizerBase

    parameters = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    own = {n for n, p in parameters.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and n != "self"}
    return frozenset(own | {"messages", "tools", "documents", "add_generation_prompt"})


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI chat messages as the chat templates take them (a call's arguments as an object, not JSON
    text); ValueError naming the message and field that is wrong."""
    if not isinstance(messages, list | tuple) or not messages:
        raise ValueError("messages is empty")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"{where} must be an object with role and content, got {m!r}")
        unknown = set(m) - set(MESSAGE_FIELDS)
        if unknown:
            raise ValueError(f"{where} has unknown fields {sorted(unknown)} (known: {', '.join(MESSAGE_FIELDS)})")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(f"{where}.role={role!r} must be one of {CHAT_ROLES}")
        message: dict[str, Any] = {"role": role}
        if m.get("name") is not None:
            # the participant's name: to the template, which may show it (most leave it out, as they leave
            # out what they have no place for)
            if not isinstance(m["name"], str) or not m["name"]:
                raise ValueError(f"{where}.name must be a non-empty string")
            message["name"] = m["name"]
        calls = m.get("tool_calls")
        if calls is not None:
            if role != "assistant":
                raise ValueError(f"{where}.tool_calls: only assistant messages carry tool calls")
            message["tool_calls"] = [_check_call(f"{where}.tool_calls[{j}]", c) for j, c in enumerate(calls)]
        reasoning = message_reasoning(where, m)
        content = m.get("content")
        if content is None and (calls or reasoning is not None):
            content = ""  # an answer that is only tool calls, or reasoning cut short before an answer
        if not isinstance(content, str):
            raise ValueError(f"{where}.content must be a string")
        message["content"] = content
        if reasoning is not None:
            # Both names, to whichever a template reads (Qwen3's and DeepSeek-R1's: reasoning_content)
            message["reasoning"] = message["reasoning_content"] = reasoning
        if m.get("tool_call_id") is not None:
            if role != "tool":
                raise ValueError(f"{where}.tool_call_id: only tool messages answer a tool call")
            if not isinstance(m["tool_call_id"], str):
                raise ValueError(f"{where}.tool_call_id must be a string")
            message["tool_call_id"] = m["tool_call_id"]
        out.append(message)
    return out


def message_reasoning(where: str, message: dict[str, Any]) -> str | None:
    """An assistant message's earlier reasoning, sent back as `reasoning` (vLLM's) or `reasoning_content`;
    ValueError naming `where` and the field that is wrong."""
    given = {name: message[name] for name in ("reasoning", "reasoning_content") if message.get(name) is not None}
    if not given:
        return None
    if message["role"] != "assistant":
        raise ValueError(f"{where}.{next(iter(given))}: only assistant messages carry reasoning")
    for name, value in given.items():
        if not isinstance(value, str):
            raise ValueError(f"{where}.{name} must be a string")
    if len(set(given.values())) > 1:
        raise ValueError(f"{where}: reasoning and reasoning_content differ: give one")
    return next(iter(given.values()))


def _check_call(where: str, call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or call.get("type", "function") != "function":
        raise ValueError(f"{where} must be {{'id': ..., 'type': 'function', 'function': {{'name': ..., "
                         "'arguments': ...}}")
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise ValueError(f"{where}.function.name must be a non-empty string")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise ValueError(f"{where}.function.arguments is not valid JSON: {arguments[:60]!r}") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"{where}.function.arguments must be a JSON object")
    out: dict[str, Any] = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if call.get("id") is not None:
        out["id"] = call["id"]
    return out


class ChatTemplate:
    """The tokenizer's chat template, and what it does with tools."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        source = tokenizer.chat_template
        self._source = ("\n".join(source.values()) if isinstance(source, dict) else source) or ""
        # A template that does not name the developer role would drop such a message or show the model a
        # role it never saw: it gets the developer's instructions as the system's
        self.knows_developer = "developer" in self._source
        self.renders_tools = self._renders_tools()
        self.tool_format: ToolCallFormat | None = self._tool_format()

    def render(self, messages: Any, tools: list[Tool], options: ChatOptions | None = None) -> list[int]:
        """The conversation with `tools` offered, as token ids; ValueError naming what is wrong."""
        options = options or ChatOptions()
        checked = check_messages(messages)
        if not self.knows_developer:
            checked = [dict(m, role="system") if m["role"] == "developer" else m for m in checked]
        if not self.renders_tools and (tools or any("tool_calls" in m for m in checked)):
            checked = _as_hermes_text(checked, tools)  # only where tools are in play: a plain chat stays as is
        try:
            text = self.tokenizer.apply_chat_template(
                checked, tools=[t.as_openai() for t in tools] if tools and self.renders_tools else None,
                documents=options.documents or None, add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message, tokenize=False,
                **options.chat_template_kwargs)
        except Exception as e:  # jinja's TemplateError, or raise_exception(...) in the template itself
            if options.continue_final_message and "continue_final_message" in str(e):
                raise ValueError("continue_final_message: the model's chat template does not render the last "
                                 "message's content as given, so it cannot be left open to continue") from None
            raise ValueError(f"messages: the model's chat template refused them: {e}") from None
        # What apply_chat_template(tokenize=True) does, with the special tokens only when asked for
        return list(self.tokenizer.encode(text, add_special_tokens=options.add_special_tokens))

    def _apply(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)

    def _renders_tools(self) -> bool:
        probe = [{"role": "user", "content": "hi"}]
        tool = Tool("pagedserve_probe", {"type": "object", "properties": {}}).as_openai()
        try:
            return "pagedserve_probe" in self._apply(probe, [tool])
        except Exception:  # a template that fails on tools does not take them
            return False

    def _tool_format(self) -> ToolCallFormat | None:
        if not self.renders_tools or HERMES_OPEN in self._source:
            return "hermes"  # ours (the instructions are injected) or the template's own
        if LLAMA_PYTHON_TAG in self._source or "ipython" in self._source:
            return "llama3_json"
        return None


def _as_hermes_text(messages: list[dict[str, Any]], tools: list[Tool]) -> list[dict[str, Any]]:
    """For a template that ignores tools: the tools as Hermes instructions in the system message, past calls
    as `<tool_call>` text, and tool results as `<tool_response>` user turns (consecutive ones joined)."""
    out: list[dict[str, Any]] = []
    after_tool = False  # the previous message was a tool result: this one joins its user turn
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [HERMES_OPEN + "\n" + json.dumps({"name": c["function"]["name"],
                                                      "arguments": c["function"]["arguments"]}) + "\n" + HERMES_CLOSE
                     for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(filter(None, [m["content"], *calls]))})
        elif m["role"] == "tool":
            response = f"<tool_response>\n{m['content']}\n</tool_response>"
            if after_tool:
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response})
        else:
            out.append(dict(m))
        after_tool = m["role"] == "tool"
    if tools:
        prompt = _HERMES_TOOLS_PROMPT.format(tools="\n".join(json.dumps(t.as_openai()) for t in tools))
        if out[0]["role"] == "system":
            out[0] = dict(out[0], content=out[0]["content"] + "\n\n" + prompt)
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
