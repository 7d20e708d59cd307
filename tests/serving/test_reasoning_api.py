"""Reasoning parsed out of chat answers, served: OpenAI's routes (`reasoning`, and the older
`reasoning_content`), streamed and whole, `include_reasoning`, reasoning sent back in a conversation, and
gRPC; on a "thinking" application of its own (the qwen3 parser, a tiny model with think tags of its own)."""

from __future__ import annotations

import re

import openai
import pytest

from tests.serving.app import BLOCK_BYTES, GRPC, HTTP, MAX_MODEL_LEN, POOL_BLOCKS

ASK = [{"role": "user", "content": "What is 2 + 2?"}]
UNTHINK = 49153  # `</think>` in thinking_random
THINKING = {"chat_template_kwargs": {"thinking": True}}  # the template opens the block
NEVER_CLOSES = dict(seed=3, max_tokens=10, extra_body={**THINKING, "logit_bias": {str(UNTHINK): -100}})


@pytest.fixture(scope="module")
def thinking(app, thinking_random):
    from ray import serve

    from pagedserve.serving.serve_app import build_app

    serve.run(build_app({"model": thinking_random, "max_model_len": MAX_MODEL_LEN, "reasoning_parser": "qwen3",
                         "kv_cache_memory": POOL_BLOCKS * BLOCK_BYTES}), name="thinking", route_prefix="/thinking")
    yield "thinking"
    serve.delete("thinking")


@pytest.fixture(scope="module")
def oai(thinking):
    return openai.OpenAI(base_url=f"{HTTP}/{thinking}/v1", api_key="unused", max_retries=0)


def joined(chunks) -> tuple[str, str, str]:
    """A stream's reasoning, reasoning_content and content, joined."""
    parts = ["", "", ""]
    for chunk in chunks:
        delta = chunk.choices[0].delta.model_dump()
        for i, name in enumerate(("reasoning", "reasoning_content", "content")):
            parts[i] += delta.get(name) or ""
    return parts[0], parts[1], parts[2]


def test_a_cut_short_thought_is_all_reasoning_streamed_or_whole(oai):
    whole = oai.chat.completions.create(model="", messages=ASK, **NEVER_CLOSES).choices[0]
    message = whole.message.model_dump()
    assert message["reasoning"] and message["reasoning_content"] == message["reasoning"]
    assert message["content"] is None and whole.finish_reason == "length"
    streamed = joined(oai.chat.completions.create(model="", messages=ASK, stream=True, **NEVER_CLOSES))
    assert streamed == (message["reasoning"], message["reasoning"], "")


def test_an_answer_after_the_reasoning_follows_its_format(oai):
    kwargs = dict(model="", messages=ASK, seed=3, max_tokens=12,
                  response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": {
                      "type": "string", "pattern": "^[a-z]{3,8}$"}}},
                  extra_body={**THINKING, "logit_bias": {str(UNTHINK): 100}})  # it closes the block at once
    whole = oai.chat.completions.create(**kwargs).choices[0]
    assert re.fullmatch('"[a-z]{3,8}"', whole.message.content) and whole.message.model_dump()["reasoning"] is None
    assert joined(oai.chat.completions.create(stream=True, **kwargs))[2] == whole.message.content


def test_without_thinking_there_is_no_reasoning(oai):
    message = oai.chat.completions.create(model="", messages=ASK, seed=3, max_tokens=8,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}}
                                         ).choices[0].message.model_dump()
    assert message["content"] and message["reasoning"] is None


def test_include_reasoning_false_leaves_it_out(oai):
    body = dict(NEVER_CLOSES, extra_body={**NEVER_CLOSES["extra_body"], "include_reasoning": False})
    message = oai.chat.completions.create(model="", messages=ASK, **body).choices[0].message.model_dump()
    assert "reasoning" not in message and "reasoning_content" not in message and message["content"] is None
    assert joined(oai.chat.completions.create(model="", messages=ASK, stream=True, **body)) == ("", "", "")


def test_reasoning_sent_back_in_the_conversation(oai):
    history = ASK + [{"role": "assistant", "content": "4", "reasoning": "2 and 2 make 4."},
                     {"role": "user", "content": "And 3 + 3?"}]
    assert oai.chat.completions.create(model="", messages=history, max_tokens=2).choices[0].message
    old_name = [dict(history[1], reasoning_content=history[1].pop("reasoning"))]
    assert oai.chat.completions.create(model="", messages=ASK + old_name, max_tokens=2).choices[0].message
    with pytest.raises(openai.BadRequestError, match=r"messages\[1\]: reasoning and reasoning_content differ"):
        oai.chat.completions.create(model="", messages=ASK + [dict(old_name[0], reasoning="other")], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\].reasoning: only assistant messages"):
        oai.chat.completions.create(model="", messages=[dict(ASK[0], reasoning="x")], max_tokens=2)


def test_grpc_chat_carries_the_reasoning(oai, thinking):
    from pagedserve.client import Client

    expected = oai.chat.completions.create(model="", messages=ASK, **NEVER_CLOSES).choices[0].message
    sampling = dict(seed=3, max_tokens=10, logit_bias={UNTHINK: -100})
    with Client(GRPC, application=thinking, timeout=120) as c:
        done = c.chat(ASK, chat_template_kwargs={"thinking": True}, **sampling)
        assert done.reasoning == expected.model_dump()["reasoning"] and done.text == ""
        chunks = list(c.stream_chat(ASK, chat_template_kwargs={"thinking": True}, **sampling))
        assert "".join(ch.reasoning for ch in chunks) == done.reasoning
        hidden = c.chat(ASK, chat_template_kwargs={"thinking": True}, include_reasoning=False, **sampling)
        assert hidden.reasoning == "" and hidden.token_ids == done.token_ids
        history = ASK + [{"role": "assistant", "content": "4", "reasoning": "2 and 2 make 4."}, ASK[0]]
        assert c.chat(history, max_tokens=2).token_ids


def test_the_responses_api_gives_the_reasoning_an_item_of_its_own(oai):
    kw = dict(seed=3, max_tokens=10, extra_body=THINKING)
    chat = oai.chat.completions.create(model="", messages=ASK, **kw).choices[0].message.model_dump()
    assert chat["reasoning"] and chat["content"] is None  # this seed's thought runs past 10 tokens
    request = dict(model="", input=ASK[0]["content"], max_output_tokens=10, extra_body={**THINKING, "seed": 3})
    response = oai.responses.create(**request)
    assert [o.type for o in response.output] == ["reasoning"]
    assert response.output[0].content[0].text == chat["reasoning"] and response.output[0].summary == []
    assert response.usage.output_tokens_details.reasoning_tokens == response.usage.output_tokens == 10
    events = list(oai.responses.create(stream=True, **request))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == chat["reasoning"]
    assert events[-1].response.output[0].content[0].text == chat["reasoning"]
