"""Where vLLM's own tests of its OpenAI server found pagedserve answering differently, now as vLLM does (or,
where pagedserve's answer is kept, as the README says why): errors in the client's field names, legacy
completions logprobs, where a chat's prompt logprobs go, usage in a stream, and the fields a whole response
sends as null rather than leaving out."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import openai
import pytest

from pagedserve.client import InvalidArgument
from tests.serving.app import HTTP

PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": "Say hello."}]
BAD_SCHEMA = {"type": "no-such-type"}


@pytest.fixture(scope="module")
def oai(app):
    return openai.OpenAI(base_url=f"{HTTP}/v1", api_key="unused", max_retries=0)


def post(path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"{HTTP}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# (route, body, the field as the client spelled it): each value is checked by the engine under its own name
RENAMED = [
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 10**6}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "min_tokens": 9, "max_completion_tokens": 3}, "min_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": BAD_SCHEMA}}}, "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_object"},
                              "allowed_token_ids": [5]}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": PROMPT, "guided_choice": []}, "guided_choice"),
    ("/v1/completions", {"prompt": PROMPT, "guided_json": BAD_SCHEMA}, "guided_json"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 10**6}, "max_output_tokens"),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                                          "schema": BAD_SCHEMA}}}, "text.format.schema"),
]


@pytest.mark.parametrize("route, body, field", RENAMED, ids=[f"{r}-{f}" for r, _, f in RENAMED])
def test_errors_name_the_field_as_the_client_sent_it(app, route, body, field):
    status, reply = post(route, body)
    assert status == 400, reply
    error = reply["error"]
    assert error["param"] == field and error["message"].startswith(field), error
    engine_names = {"max_tokens", "logprobs", "structured_outputs"} - {field}
    assert not any(re.search(rf"(?<![\w.]){name}[=.]", error["message"]) for name in engine_names), error


def test_grpc_errors_name_the_proto_field(client):
    for kwargs, field in [(dict(logprobs=21), "logprobs"), (dict(max_tokens=0), "max_tokens"),
                          (dict(structured_outputs={"json": BAD_SCHEMA}), "structured_outputs.json")]:
        with pytest.raises(InvalidArgument) as info:
            client.generate("hi", **kwargs)
        assert info.value.field_violations[0][0] == field


def completion_logprobs(oai, **kw):
    return oai.completions.create(model="", prompt=PROMPT, temperature=0, max_tokens=6, **kw).choices[0].logprobs


@pytest.mark.parametrize("k", [0, 1, 3])
def test_completion_top_logprobs_hold_the_chosen_token_first_then_the_top_k(oai, k):
    lp = completion_logprobs(oai, logprobs=k)
    assert len(lp.tokens) == 6
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert next(iter(top)) == token and top[token] == logprob
        assert k <= len(top) <= k + 1 and max(top.values()) <= 0
        if k:  # greedy: the chosen token is the most likely one, among the top k
            assert len(top) == k and logprob == max(top.values())


def test_completion_echo_scores_each_prompt_token_first(oai, offline):
    lp = completion_logprobs(oai, logprobs=2, echo=True)
    prompt = offline.llm_engine.outputs.detokenizer.token_texts(offline.tokenizer.encode(PROMPT))
    assert lp.tokens[:len(prompt)] == prompt
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first
    for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert next(iter(top)) == token and top[token] == logprob and 2 <= len(top) <= 3


def test_chat_prompt_logprobs_are_the_responses_not_a_choices(oai):
    chat = oai.chat.completions.create(model="", messages=MESSAGES, temperature=0, max_tokens=3,
                                       extra_body={"prompt_logprobs": 1, "return_token_ids": True})
    scored = chat.model_extra["prompt_logprobs"]
    prompt = chat.model_extra["prompt_token_ids"]
    assert scored[0] is None and len(scored) == len(prompt)
    for token_id, position in zip(prompt[1:], scored[1:], strict=True):  # vLLM's: the prompt's token, then top 1
        assert next(iter(position)) == str(token_id) and 1 <= len(position) <= 2
        assert all(set(lp) == {"logprob", "rank", "decoded_token"} and lp["rank"] >= 1 for lp in position.values())
    assert "prompt_logprobs" not in chat.choices[0].model_extra
    chunks = list(oai.chat.completions.create(model="", messages=MESSAGES, temperature=0, max_tokens=3, stream=True,
                                              extra_body={"prompt_logprobs": 1, "return_token_ids": True}))
    assert chunks[0].model_extra["prompt_logprobs"] == scored
    assert all("prompt_logprobs" not in c.model_extra for c in chunks[1:])
    plain = oai.chat.completions.create(model="", messages=MESSAGES, temperature=0, max_tokens=3)
    assert plain.prompt_logprobs is None and plain.prompt_token_ids is None  # sent as null: attribute access works


def test_continuous_usage_needs_include_usage(oai):
    def usages(**options):
        stream = oai.chat.completions.create(model="", messages=MESSAGES, temperature=0, max_tokens=4, stream=True,
                                             stream_options=options)
        return [chunk.usage for chunk in stream]

    assert set(usages(include_usage=False, continuous_usage_stats=True)) == {None}
    with_usage = usages(include_usage=True, continuous_usage_stats=True)
    assert all(u is not None for u in with_usage) and with_usage[-1].completion_tokens == 4
    last_only = usages(include_usage=True)
    assert all(u is None for u in last_only[:-1]) and last_only[-1].completion_tokens == 4


def test_whole_responses_send_unasked_fields_as_null(oai):
    completion = oai.completions.create(model="", prompt=PROMPT, max_tokens=2, extra_body={"return_token_ids": False})
    choice = completion.choices[0]
    assert choice.token_ids is None and choice.prompt_logprobs is None and choice.prompt_token_ids is None
    assert completion.usage.prompt_tokens_details.cached_tokens >= 0  # OpenAI's, always sent (README)
    chat = oai.chat.completions.create(model="", messages=MESSAGES, max_tokens=2,
                                       extra_body={"return_token_ids": False})
    assert chat.choices[0].token_ids is None
    card = oai.models.list().data[0]
    assert card.root == card.id and card.parent is None and card.max_model_len > 0
    status, tokens = post("/tokenize", {"prompt": PROMPT})
    assert status == 200 and tokens["token_strs"] is None and tokens["count"] == len(tokens["tokens"])
