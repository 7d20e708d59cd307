"""A forced tool call beside a response format, as agent frameworks send them, through the official `openai`
client on the embedded SmolLM2 ("smol" application): the OpenAI Agents SDK's first turn of an agent with tools,
a structured `output_type` and a forced `tool_choice` (chat and Responses models), and instructor's tool modes
(a named function, a pydantic model as the tool). The forced call writes no message text, so the format has
nothing to shape: the call's constraint is the one the request runs under, as with OpenAI and vLLM."""

from __future__ import annotations

import json

import jsonschema
import openai
import pydantic
import pytest

from tests.serving.app import HTTP, wait_idle
from tests.tools_data import ASK, PARAMETERS, TOOLS

# The Agents SDK's response_format for an agent's output_type (a strict schema named final_output)
FINAL_OUTPUT = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
                "additionalProperties": False}
AGENT_FORMAT = {"type": "json_schema", "json_schema": {"name": "final_output", "strict": True, "schema": FINAL_OUTPUT}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def oai(app):
    return openai.OpenAI(base_url=f"{HTTP}/smol/v1", api_key="unused", max_retries=0)


def check(calls: list[tuple[str, str]], names: set[str]) -> None:
    assert calls, "no tool call"
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(json.loads(arguments), PARAMETERS[name])


def chat_calls(oai, stream: bool, **kw) -> tuple[list[tuple[str, str]], str | None, str]:
    """(calls, content, finish_reason) of a chat, its stream joined as a client does."""
    kw = {"model": "", "messages": ASK, "tools": TOOLS, "parallel_tool_calls": False, "temperature": 0,
          "max_tokens": 200, **kw}
    if not stream:
        choice = oai.chat.completions.create(**kw).choices[0]
        calls = [(t.function.name, t.function.arguments) for t in choice.message.tool_calls or []]
        return calls, choice.message.content, choice.finish_reason
    names: list[str] = []
    arguments: list[str] = []
    content, finish = None, None
    for chunk in oai.chat.completions.create(**kw, stream=True):
        for choice in chunk.choices:
            content = (content or "") + choice.delta.content if choice.delta.content else content
            for t in choice.delta.tool_calls or []:
                if t.index == len(names):
                    names.append(t.function.name)
                    arguments.append("")
                arguments[t.index] += t.function.arguments or ""
            finish = choice.finish_reason or finish
    return list(zip(names, arguments, strict=True)), content, finish


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
@pytest.mark.parametrize("tool_choice, finish", [("required", "tool_calls"), (NAMED, "stop")],
                         ids=["required", "named"])
@pytest.mark.parametrize("response_format", [AGENT_FORMAT, {"type": "json_object"}], ids=["json_schema", "json_object"])
def test_agents_sdk_chat_turn_with_a_forced_call_and_an_output_type(oai, stream, tool_choice, finish,
                                                                     response_format):
    calls, content, reason = chat_calls(oai, stream, tool_choice=tool_choice, response_format=response_format)
    check(calls, {"get_weather"} if tool_choice is NAMED else set(PARAMETERS))
    assert content is None and reason == finish
    assert calls == chat_calls(oai, stream, tool_choice=tool_choice)[0]  # the format changed nothing


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=20)
    unit: str = pydantic.Field(pattern="^(celsius|fahrenheit)$")


class Answer(pydantic.BaseModel):
    answer: str


def test_openai_parse_with_a_pydantic_tool_forced_beside_a_pydantic_format(oai):
    """The official client's `parse`: strict pydantic tools and a pydantic response_format; the forced call's
    arguments come back parsed into the tool's model."""
    completion = oai.chat.completions.parse(model="", messages=ASK, tools=[openai.pydantic_function_tool(Weather)],
                                            tool_choice="required", response_format=Answer, parallel_tool_calls=False,
                                            temperature=0, max_tokens=200)
    message = completion.choices[0].message
    assert message.content is None and message.parsed is None
    (call,) = message.tool_calls
    assert call.function.name == "Weather" and isinstance(call.function.parsed_arguments, Weather)


def responses_calls(oai, stream: bool, **kw) -> list[tuple[str, str]]:
    """The function calls of a response, whole or from its stream's completed response."""
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    kw = dict(model="", input=ASK[0]["content"], tools=tools, parallel_tool_calls=False, temperature=0,
              max_output_tokens=200, **kw)
    if stream:
        events = list(oai.responses.create(**kw, stream=True))
        assert events[-1].type == "response.completed"
        response = events[-1].response
    else:
        response = oai.responses.create(**kw)
    assert response.status == "completed"
    assert not [item for item in response.output if item.type == "message"]  # a forced call writes no text
    return [(item.name, item.arguments) for item in response.output if item.type == "function_call"]


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}],
                         ids=["required", "named"])
def test_responses_forced_call_beside_text_format(oai, stream, tool_choice):
    """The Agents SDK's Responses model and instructor's RESPONSES_TOOLS mode: a forced call with text.format."""
    text = {"format": {"type": "json_schema", "name": "final_output", "strict": True, "schema": FINAL_OUTPUT}}
    calls = responses_calls(oai, stream, tool_choice=tool_choice, text=text)
    check(calls, {"get_weather"} if isinstance(tool_choice, dict) else set(PARAMETERS))
    assert calls == responses_calls(oai, stream, tool_choice=tool_choice)
    stats = wait_idle("smol")
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_a_forced_call_cut_by_max_tokens_is_no_call(oai, stream, tool_choice):
    """Cut short, a forced call's arguments are not JSON: no call is sent (vLLM's), and what the model wrote is
    the content, with finish_reason "length"."""
    calls, content, reason = chat_calls(oai, stream, tool_choice=tool_choice, max_tokens=5)
    assert calls == [] and reason == "length" and content
    if tool_choice is NAMED:  # the start of the arguments it writes when given room
        assert chat_calls(oai, False, tool_choice=tool_choice)[0][0][1].startswith(content)
    else:
        assert content.startswith("[")
