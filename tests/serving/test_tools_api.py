"""Tool calling through the OpenAI chat route (the official client, unary and streamed) and gRPC `Chat`
(the SDK), on the embedded SmolLM2 ("smol" application)."""

from __future__ import annotations

import json
import urllib.request

import jsonschema
import openai
import pytest

from tests.serving.app import GRPC, HTTP, wait_idle
from tests.test_tool_calls import REF_PARAMETERS, REF_TOOLS
from tests.tools_data import ASK, HERMES_CALL, PARAMETERS, TOOLS


@pytest.fixture(scope="module")
def oai(app):
    return openai.OpenAI(base_url=f"{HTTP}/smol/v1", api_key="unused", max_retries=0)


def joined_stream(oai, **kw) -> tuple[str | None, list[dict], str]:
    """(content, tool calls, finish_reason) of a streamed answer, its chunks joined as a client does."""
    content, calls, finish = None, [], None
    for chunk in oai.chat.completions.create(**kw, stream=True):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        if choice.delta.content:
            content = (content or "") + choice.delta.content
        for t in choice.delta.tool_calls or []:
            if t.index == len(calls):
                assert t.id and t.function.name and t.type == "function"  # all on the call's first chunk
                calls.append({"id": t.id, "name": t.function.name, "arguments": t.function.arguments or ""})
            else:
                assert t.id is None
                calls[t.index]["arguments"] += t.function.arguments
        finish = choice.finish_reason or finish
    return content, calls, finish


def unary(oai, **kw) -> tuple[str | None, list[dict], str]:
    choice = oai.chat.completions.create(**kw).choices[0]
    calls = [{"id": t.id, "name": t.function.name, "arguments": t.function.arguments}
             for t in choice.message.tool_calls or []]
    return choice.message.content, calls, choice.finish_reason


def valid(calls: list[dict]) -> list[tuple[str, str]]:
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), PARAMETERS[call["name"]])
        assert call["id"].startswith("call_")
    return [(c["name"], c["arguments"]) for c in calls]


@pytest.mark.parametrize("tool_choice, finish", [
    ("required", "tool_calls"),
    ({"type": "function", "function": {"name": "get_time"}}, "stop"),
])
def test_required_and_named_calls_streamed_and_unary_agree(oai, tool_choice, finish):
    kw = dict(model="", messages=ASK, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
              temperature=0, max_tokens=200)
    whole, streamed = unary(oai, **kw), joined_stream(oai, **kw)
    assert whole[0] is None and streamed[0] is None  # only calls: no content
    assert whole[2] == streamed[2] == finish
    assert valid(whole[1]) == valid(streamed[1])
    assert len(whole[1]) == 1
    if isinstance(tool_choice, dict):
        assert whole[1][0]["name"] == "get_time"


def test_required_with_tools_whose_parameters_have_definitions(oai):
    """Tools from pydantic models, each with its own "Address" under "$defs": `required` answers with a call
    valid against its own tool's schema, unary and streamed alike."""
    kw = dict(model="", messages=[{"role": "user", "content": "Send a parcel to Ann."}], tools=REF_TOOLS[:2],
              tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=200)
    whole, streamed = unary(oai, **kw), joined_stream(oai, **kw)
    assert whole[2] == streamed[2] == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in whole[1]] == [(c["name"], c["arguments"]) for c in streamed[1]]
    assert len(whole[1]) == 1
    jsonschema.validate(json.loads(whole[1][0]["arguments"]), REF_PARAMETERS[whole[1][0]["name"]])


def test_auto_parses_a_forced_hermes_call_and_keeps_the_content(oai):
    """"auto" parses a Hermes-format call out of the model's text, unary and streamed alike, and the text before
    it is the content. The text is forced by a regex (HERMES_CALL): this checks the parsing of such a text, not
    that the model calls a tool on its own."""
    kw = dict(model="", messages=ASK, tools=TOOLS, temperature=0, max_tokens=120,
              extra_body={"structured_outputs": {"regex": HERMES_CALL}})
    whole, streamed = unary(oai, **kw), joined_stream(oai, **kw)
    assert whole[0] == streamed[0] == "Checking."
    assert whole[2] == streamed[2] == "tool_calls"
    assert valid(whole[1]) == valid(streamed[1])
    # no call made: the content is the whole answer
    plain = oai.chat.completions.create(model="", messages=ASK, tools=TOOLS, temperature=0, max_tokens=12)
    assert plain.choices[0].message.content and plain.choices[0].message.tool_calls is None


def test_a_conversation_carries_calls_and_results(oai):
    first = oai.chat.completions.create(model="", messages=ASK, tools=TOOLS, tool_choice="required",
                                        parallel_tool_calls=False, temperature=0, max_tokens=200)
    message = first.choices[0].message
    history = ASK + [message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": '{"temperature": 21}'}]
    after = oai.chat.completions.create(model="", messages=history, tools=TOOLS, temperature=0, max_tokens=16)
    assert after.choices[0].message.content
    with_tools, without = (tokenize({"messages": history, "tools": TOOLS}), tokenize({"messages": history}))
    assert with_tools["count"] > without["count"]  # the tools are part of the prompt


def tokenize(body: dict) -> dict:
    request = urllib.request.Request(f"{HTTP}/smol/tokenize", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.loads(r.read())


def test_sdk_chat_with_tools(app):
    from pagedserve.client import Client

    with Client(GRPC, application="smol", timeout=120) as c:
        kw = dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=200)
        done = c.chat(ASK, **kw)
        assert done.finish_reason == "tool_calls" and done.text == ""
        calls = valid([vars(t) for t in done.tool_calls])
        chunks = list(c.stream_chat(ASK, **kw))
        assert [d.name for ch in chunks for d in ch.tool_calls if d.name] == [calls[0][0]]
        assert "".join(d.arguments for ch in chunks for d in ch.tool_calls) == calls[0][1]
        assert chunks[-1].finish_reason == "tool_calls"
        named = c.chat(ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                       temperature=0, max_tokens=200)
        assert named.finish_reason == "stop" and [t.name for t in named.tool_calls] == ["get_weather"]
        valid([vars(t) for t in named.tool_calls])
        history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments}}
            for t in done.tool_calls]}, {"role": "tool", "tool_call_id": done.tool_calls[0].id, "content": "21 C"}]
        assert c.chat(history, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=10).text
        assert len(c.tokenize(messages=history, tools=TOOLS)) > len(c.tokenize(messages=history))
    stats = wait_idle("smol")
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
