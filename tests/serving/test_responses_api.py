"""OpenAI's Responses API (`/v1/responses`) through the official client, whole and streamed: the text the
chat route gives for the same conversation, function tools and their calls sent back, a JSON schema, and
what a server that stores nothing refuses (by name: tests/serving/test_bad_input.py). Reasoning items:
tests/serving/test_reasoning_api.py."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.serving.app import HTTP
from tests.tools_data import ASK, PARAMETERS, TIME, WEATHER

GREEDY = dict(model="", temperature=0, max_output_tokens=8, extra_body={"ignore_eos": True})
TOOLS = [{"type": "function", **WEATHER["function"]}, {"type": "function", **TIME["function"]}]


@pytest.fixture(scope="module")
def plain(app):
    return openai.OpenAI(base_url=f"{HTTP}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def smol(app):
    return openai.OpenAI(base_url=f"{HTTP}/smol/v1", api_key="unused", max_retries=0)


def test_the_text_is_the_chat_routes_for_the_same_conversation(plain):
    chat = plain.chat.completions.create(model="", messages=[{"role": "system", "content": "Be brief."},
                                                             {"role": "user", "content": "Say hello."}],
                                         temperature=0, max_tokens=8, extra_body={"ignore_eos": True})
    response = plain.responses.create(instructions="Be brief.", input="Say hello.", **GREEDY)
    assert response.output_text == chat.choices[0].message.content
    assert response.id.startswith("resp_") and response.object == "response" and response.store is False
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert [(o.type, o.role, o.status) for o in response.output] == [("message", "assistant", "incomplete")]
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (chat.usage.prompt_tokens, 8)
    assert usage.total_tokens == usage.input_tokens + 8 and usage.output_tokens_details.reasoning_tokens == 0
    # the same conversation as input items: a developer message, and text parts
    items = plain.responses.create(input=[{"role": "developer", "content": "Be brief."},
                                          {"type": "message", "role": "user", "content": [
                                              {"type": "input_text", "text": "Say "},
                                              {"type": "input_text", "text": "hello."}]}], **GREEDY)
    assert items.output_text == response.output_text


def test_a_stream_builds_the_same_response_event_by_event(plain):
    whole = plain.responses.create(input="Say hello.", **GREEDY)
    events = list(plain.responses.create(input="Say hello.", stream=True, **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    last = events[-1].response
    assert text == whole.output_text == last.output_text == events[-4].text
    assert last.usage.output_tokens == 8 and last.output[0].id == events[2].item.id
    # the client's own accumulator of events (responses.stream) takes them all, the last as OpenAI ends a cut
    # answer (its final response is only for a completed one: tested with tools below)
    with plain.responses.stream(input="Say hello.", **GREEDY) as stream:
        accumulated = list(stream)
    assert accumulated[-1].type == "response.incomplete" and accumulated[-1].response.output_text == whole.output_text


def test_function_tools_are_called_and_their_results_sent_back(smol):
    kw = dict(model="", input=ASK[0]["content"], tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"},
              temperature=0, max_output_tokens=60)
    response = smol.responses.create(**kw)
    calls = [o for o in response.output if o.type == "function_call"]
    assert [c.name for c in calls] == ["get_weather"] and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), PARAMETERS["get_weather"])
    assert response.status == "completed" and response.tool_choice.name == "get_weather"
    events = list(smol.responses.create(stream=True, **kw))
    added = [e.item for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    assert [(a.name, a.arguments) for a in added] == [("get_weather", "")]
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert streamed == done[0] == calls[0].arguments
    with smol.responses.stream(**kw) as stream:  # the client's own accumulator of events
        final = stream.get_final_response()
    assert [(o.name, o.arguments) for o in final.output if o.type == "function_call"] == \
        [(c.name, c.arguments) for c in calls]
    # the call and the tool's result go back in the input, as a client that ran the tool sends them
    follow = smol.responses.create(model="", tools=TOOLS, temperature=0, max_output_tokens=12, input=[
        {"role": "user", "content": ASK[0]["content"]}, calls[0].model_dump(exclude_unset=True),
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 degrees and sunny"}])
    assert follow.output and follow.usage.input_tokens > response.usage.input_tokens


def test_a_json_schema_shapes_the_text(smol):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    response = smol.responses.create(model="", input="Name a city in France as JSON.", temperature=0,
                                     max_output_tokens=40, text={"format": {"type": "json_schema", "name": "city",
                                                                            "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema" and response.status == "completed"


def test_truncation_auto_drops_the_oldest_turns_of_a_conversation_too_long(plain):
    import urllib.request

    from tests.serving.app import POOL_BLOCKS

    turns: list[dict] = []
    for i in range(30):
        turns += [{"role": "user", "content": f"Question {i}: tell me about the number {i}."},
                  {"role": "assistant", "content": f"The number {i} is a fine number."}]
    turns.append({"role": "user", "content": "And the number 99?"})
    with pytest.raises(openai.BadRequestError, match="max_model_len|positions|KV blocks"):
        plain.responses.create(model="", input=turns, max_output_tokens=4)
    cut = plain.responses.create(model="", input=turns, max_output_tokens=4, truncation="auto",
                                 extra_body={"ignore_eos": True})
    assert cut.truncation == "auto" and cut.usage.output_tokens == 4

    def tokens(messages: list[dict]) -> int:
        body = json.dumps({"messages": messages}).encode()
        request = urllib.request.Request(f"{HTTP}/tokenize", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as r:
            return json.loads(r.read())["count"]

    context = POOL_BLOCKS * 16  # the pool holds less than max_model_len here
    latest = next(turns[i:] for i in range(0, len(turns), 2) if tokens(turns[i:]) <= context - 4)
    assert cut.usage.input_tokens == tokens(latest) and len(latest) < len(turns)


def test_input_items_become_the_chat_messages_of_the_same_conversation():
    from pagedserve.serving.openai_api.protocol import parse
    from pagedserve.serving.openai_api.responses import ResponsesRequest

    body = parse(ResponsesRequest, json.dumps({"instructions": "Be brief.", "input": [
        {"role": "user", "content": "Weather and time in Paris?"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Two calls."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny, noon."}]},
    ]}).encode())
    calls = [{"type": "function", "id": f"c{i}", "function": {"name": name, "arguments": "{}"}}
             for i, name in ((1, "get_weather"), (2, "get_time"))]
    assert body.messages() == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather and time in Paris?"},
        # one assistant turn: the reasoning before its calls, the calls joined
        {"role": "assistant", "content": None, "tool_calls": calls, "reasoning": "Two calls."},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}, {"role": "tool", "tool_call_id": "c2",
                                                                      "content": "noon"},
        {"role": "assistant", "content": "Sunny, noon."}]


def test_a_client_that_leaves_a_stream_ends_what_it_asked_for(smol):
    from tests.serving.app import wait_idle

    long = dict(model="", temperature=0, stream=True, extra_body={"ignore_eos": True})
    # each would run for a minute on this model: idle within seconds only if they were ended
    for start in (lambda: smol.completions.create(prompt=["Tell me a story.", "Once upon"], max_tokens=1900, **long),
                  lambda: smol.responses.create(input="Tell me a story.", max_output_tokens=1900, **long)):
        stream = start()
        next(iter(stream))
        stream.close()
        stats = wait_idle("smol", timeout=15)
        assert stats["num_running"] == stats["num_waiting"] == 0, stats
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
