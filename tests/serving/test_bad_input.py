"""A corpus of bad input over HTTP, gRPC and the offline API. Each case must be refused as the client's
fault (4xx, INVALID_ARGUMENT, ValueError) naming the field; none may be a 5xx; afterwards the server still
serves and every KV block is back.

Naming the field means, exactly: over HTTP the error's `param` is the field, over gRPC the first field
violation is; offline the ValueError's message starts with it. A field is named by its path, a list item by
its index (`messages[0].content`), as every route names it; a prompt of token ids is the `prompt` a
completion sent, and `prompt_token_ids` (the engine's name, vLLM's prompt dict's key) over gRPC and offline."""

from __future__ import annotations

import json
import math
import re
import urllib.error
import urllib.request

import pytest

from pagedserve import SamplingParams
from tests.serving.app import HTTP, MAX_MODEL_LEN, engine_stats, wait_idle

MSG = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
HUGE = 10**12

# (route, body: a dict, or raw bytes sent as they are, the field the error must name: its param)
HTTP_CASES = [
    ("/v1/completions", {"prompt": "hi", "stop": 5}, "stop"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', "temperature"),
    ("/v1/completions", b'{"prompt": "hi", "top_p": Infinity}', "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": 0}, "top_k"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "hi", "n": True}, "n"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": HUGE}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "16"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": -2.5}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "hi", "min_p": 1.5}, "min_p"),
    ("/v1/completions", {"prompt": "hi", "seed": 1.5}, "seed"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [10**7]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias[5]"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"five": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 20, "max_tokens": 5}, "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": [10**7]}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": [5], "guided_regex": "a+"}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": "hi", "bad_words": "hi"}, "bad_words"),
    ("/v1/completions", {"prompt": "hi", "bad_words": [" "]}, "bad_words"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 10**7]}, "prompt"),
    ("/v1/completions", {"prompt": [1, -2]}, "prompt"),
    ("/v1/completions", {"prompt": [5] * (MAX_MODEL_LEN + 1)}, "prompt"),
    ("/v1/completions", {"prompt": ["a", ""]}, "prompt[1]"),
    ("/v1/completions", {"prompt": ["a", [5]]}, "prompt"),
    ("/v1/completions", {"prompt": 42}, "prompt"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "frobnicate": True}, "frobnicate"),
    ("/v1/completions", {"prompt": "hi", "echo": "yes"}, "echo"),
    ("/v1/completions", {"prompt": "hi", "stream": 1}, "stream"),
    ("/v1/completions", {"prompt": "hi", "stream": True, "stream_options": {"include_usage": "y"}},
     "stream_options.include_usage"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, "model"),
    ("/v1/completions", b'{"prompt": "hi",', "body"),
    ("/v1/completions", b'[1, 2, 3]', "body"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [1]}, "messages[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": ""}]}, "messages[0].name"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": 7}]}, "messages[0].name"),
    ("/v1/chat/completions", {"messages": MSG, "top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MSG, "documents": [{"title": 1}]}, "documents[0].title"),
    ("/v1/completions", {"prompt": "hi", "use_beam_search": True, "top_p": 0.5}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "use_beam_search": True, "n": 11}, "n"),
    ("/v1/chat/completions", {"messages": MSG, "use_beam_search": True, "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "length_penalty": 0.5}, "length_penalty"),
    ("/v1/completions", {"prompt": "hi", "priority": 3}, "priority"),
    ("/v1/chat/completions", {"messages": MSG, "priority": 1.5}, "priority"),
    ("/v1/chat/completions", {"messages": MSG, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MSG, "response_format": {"type": "json_schema"}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"messages": MSG, "response_format": {"type": "xml"}}, "response_format.type"),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "("}, "guided_regex"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs"),
    ("/v1/chat/completions", {"messages": MSG, "tools": [{"type": "function"}]}, "tools[0]"),
    ("/v1/chat/completions", {"messages": MSG, "tools": [TOOL, TOOL]}, "tools[1].function.name"),
    ("/v1/chat/completions", {"messages": MSG, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": MSG, "tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": MSG, "tools": [TOOL], "tool_choice": {
        "type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ("/v1/chat/completions", {"messages": MSG, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "no-such-type"}}}], "tool_choice": "required"}, "tools"),
    ("/v1/chat/completions", {"messages": MSG, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{x"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "tool_call_id": "c"}]},
     "messages[0].tool_call_id"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 5, "max_completion_tokens": 6}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MSG, "continue_final_message": True}, "continue_final_message"),
    ("/v1/chat/completions", {"messages": MSG, "continue_final_message": "yes"}, "continue_final_message"),
    ("/v1/chat/completions", {"messages": MSG, "echo": 1}, "echo"),
    ("/v1/chat/completions", {"messages": MSG, "chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": MSG, "chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ("/tokenize", {"prompt": "hi", "chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/detokenize", {"tokens": ["a"]}, "tokens[0]"),
    ("/detokenize", {"tokens": [10**7]}, "tokens"),
    ("/v1/responses", {"input": "hi", "store": True}, "store"),
    ("/v1/responses", {"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ("/v1/responses", {"input": "hi", "background": True}, "background"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": "a b"}]}, "tools[0].function.name"),
    ("/v1/responses", {"input": "hi", "tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ("/v1/responses", {"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ("/v1/responses", {"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
    ("/v1/responses", {"input": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ("/v1/responses", {"input": "hi", "reasoning": {"effort": "high"}}, "reasoning.effort"),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ("/v1/responses", {"input": "hi", "frobnicate": 1}, "frobnicate"),
    ("/v1/responses", {"input": "hi", "truncation": "sometimes"}, "truncation"),
]


def starts_with_field(message: str, field: str) -> bool:
    """The message names `field` first: the field, then anything but more of a name (a word character, `.`
    or `[`), so that `n` is not found in `n_best` nor `prompt` in `prompt_token_ids`."""
    return re.match(rf"{re.escape(field)}(?![\w.\[])", message) is not None


def send(route: str, body: dict | bytes) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(f"{HTTP}{route}", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("route, body, field", HTTP_CASES, ids=[f"http-{i}" for i in range(len(HTTP_CASES))])
def test_http_bad_input_is_4xx_naming_the_field(app, route, body, field):
    status, reply = send(route, body)
    assert 400 <= status < 500, reply
    error = reply["error"]
    assert error["param"] == field and field in error["message"], error
    assert error["code"] == status and error["type"] != "server_error"


# Values that once reached the workers unchecked: a seed past 64 bits failed the step of every request in
# flight, and values past float32 (inf, NaN, or flushed to 0) drew garbage; a beam's length ** length_penalty
# overflowed float64. Each is refused by name: the error's param is the field. Bodies in bytes where a float64
# subnormal must go out as it is written.
WORKER_CASES = [
    ("/v1/chat/completions", {"messages": MSG, "seed": 2**63, "temperature": 1}, "seed"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**63, "temperature": 1}, "seed"),
    ("/v1/completions", {"prompt": "hi", "seed": -2**63 - 1, "temperature": 1}, "seed"),
    ("/v1/responses", {"input": "hi", "seed": 2**64}, "seed"),
    ("/v1/completions", {"prompt": "hi", "temperature": 1e39, "allowed_token_ids": [5, 6]}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1e-50}, "top_p"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "top_p": 1e-320}', "top_p"),
    ("/v1/completions", b'{"prompt": "hi", "repetition_penalty": 1e-320}', "repetition_penalty"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 1e-30}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 1e39}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "hi", "use_beam_search": True, "n": 2, "length_penalty": 1e308}, "length_penalty"),
    ("/v1/chat/completions", {"messages": MSG, "use_beam_search": True, "n": 2, "length_penalty": -1e308},
     "length_penalty"),
]


@pytest.mark.parametrize("route, body, field", WORKER_CASES, ids=[f"worker-{i}" for i in range(len(WORKER_CASES))])
def test_http_values_the_workers_cannot_compute_with_are_400_naming_the_param(app, route, body, field):
    status, reply = send(route, body)
    assert status == 400 and reply["error"]["param"] == field, reply
    assert reply["error"]["message"].startswith(f"{field}="), reply


def test_bad_values_beside_a_running_stream_leave_it_whole(app, client):
    failures = engine_stats()["num_worker_failures"]
    with client.stream("Tell me a long story", max_tokens=300, ignore_eos=True, temperature=1.0, seed=5) as stream:
        chunks = [next(stream)]  # running now
        for route, body, field in WORKER_CASES:
            assert send(route, body)[0] == 400, field
        chunks += list(stream)
    assert sum(len(c.token_ids) for c in chunks) == 300 and chunks[-1].finish_reason == "length"
    assert engine_stats()["num_worker_failures"] == failures


def test_grpc_seed_is_int64_on_the_wire_and_its_extremes_are_served(client):
    # The proto's int64 cannot carry 2**63: the SDK refuses it before sending, naming it
    with pytest.raises(ValueError, match="seed=9223372036854775808"):
        client.generate("hi", seed=2**63, temperature=1.0)
    for seed in (2**63 - 1, -2**63):
        assert len(client.generate("hi", seed=seed, temperature=1.0, max_tokens=3, ignore_eos=True).token_ids) == 3


GRPC_CASES = [
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(top_p=math.inf), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(n=0), "n"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=2**31 - 1), "max_tokens"),
    (dict(logprobs=21), "logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(stop_token_ids=[10**7]), "stop_token_ids"),
    (dict(logit_bias={10**7: 1.0}), "logit_bias"),
    (dict(logit_bias={5: -101.0}), "logit_bias[5]"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(allowed_token_ids=[10**7]), "allowed_token_ids"),
    (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
    (dict(priority=2), "priority"),  # the served engine runs first come, first served
    (dict(use_beam_search=True, top_k=5), "top_k"),
    (dict(length_penalty=0.5), "length_penalty"),  # weighs beams, without use_beam_search
    # float32 on the wire: a subnormal top_p is 0 to a kernel that flushes it; tiny repetition penalties
    # overflowed the logits they divide (NaN); a beam's length ** 1e30 overflowed float64
    (dict(temperature=1.0, top_p=1e-45), "top_p"),
    (dict(temperature=1.0, repetition_penalty=1e-30), "repetition_penalty"),
    (dict(temperature=1.0, repetition_penalty=1e-40), "repetition_penalty"),
    (dict(use_beam_search=True, n=2, length_penalty=1e30), "length_penalty"),
]


@pytest.mark.parametrize("kwargs, field", GRPC_CASES, ids=[f"grpc-{i}" for i in range(len(GRPC_CASES))])
def test_grpc_bad_input_is_invalid_argument_naming_the_field(client, kwargs, field):
    from pagedserve.client import InvalidArgument

    with pytest.raises(InvalidArgument) as info:
        client.generate("hi", **kwargs)
    assert field in info.value.details and info.value.field_violations[0][0] == field, info.value.field_violations


@pytest.mark.parametrize("call, field", [
    (lambda c: c.generate(""), "prompt"),
    (lambda c: c.generate([1, 10**7]), "prompt_token_ids"),
    (lambda c: c.chat([]), "messages"),
    (lambda c: c.chat([{"role": "robot", "content": "x"}]), "messages[0].role"),
    (lambda c: c.chat([{"role": "", "content": "x"}]), "messages[0].role"),
    (lambda c: c.tokenize(text=""), "text"),
    (lambda c: c.abort(""), "request_id"),
    (lambda c: c.chat(MSG, tools=[{"type": "function", "function": {"name": "a b"}}]), "tools[0].function.name"),
    (lambda c: c.chat(MSG, tool_choice="required"), "tool_choice"),
    (lambda c: c.chat(MSG, tools=[TOOL], tool_choice={"type": "function", "function": {"name": "x"}}),
     "tool_choice"),
    (lambda c: c.chat([{"role": "tool", "content": "1", "tool_calls": [{"function": {"name": "f"}}]}]),
     "messages[0].tool_calls"),
    (lambda c: c.chat(MSG, continue_final_message=True), "continue_final_message"),
    (lambda c: c.chat(MSG, chat_template_kwargs={"messages": []}), "chat_template_kwargs"),
    (lambda c: c.tokenize(text="hi", add_generation_prompt=False), "add_generation_prompt"),
    (lambda c: c.tokenize(text="hi", tools=[TOOL]), "tools"),
], ids=[f"grpc-call-{i}" for i in range(15)])
def test_grpc_bad_requests_name_the_field(client, call, field):
    from pagedserve.client import InvalidArgument

    with pytest.raises(InvalidArgument) as info:
        call(client)
    assert field in info.value.details and info.value.field_violations[0][0] == field, info.value.field_violations


OFFLINE_CASES = [
    (dict(temperature=math.nan), "temperature"),
    (dict(temperature="0.5"), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(n=2.0), "n"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(stop=[""]), "stop"),
    (dict(stop=5), "stop"),
    (dict(logit_bias={"a": 1.0}), "logit_bias"),
    (dict(logit_bias={1: math.inf}), "logit_bias[1]"),
    (dict(ignore_eos="yes"), "ignore_eos"),
    (dict(prompt_logprobs=21), "prompt_logprobs"),
    (dict(min_tokens=3, max_tokens=2), "min_tokens"),
    (dict(seed=2**63), "seed"),
    (dict(seed=-2**63 - 1), "seed"),
    (dict(temperature=10**400), "temperature"),  # compared as an int, not an OverflowError
    (dict(repetition_penalty=1e39), "repetition_penalty"),
    (dict(use_beam_search=True, n=2, length_penalty=-1e308), "length_penalty"),
]


@pytest.mark.parametrize("kwargs, field", OFFLINE_CASES, ids=[f"offline-{i}" for i in range(len(OFFLINE_CASES))])
def test_offline_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert starts_with_field(str(info.value), field), info.value


def test_offline_bad_requests_name_the_field(offline):
    for prompt, params, field in [("hi", SamplingParams(stop_token_ids=[10**7]), "stop_token_ids"),
                                  ("hi", SamplingParams(logit_bias={10**7: 1.0}), "logit_bias"),
                                  ([1, 10**7], SamplingParams(), "prompt_token_ids"),
                                  ("hi", SamplingParams(max_tokens=10**6), "max_tokens")]:
        with pytest.raises(ValueError) as info:
            offline.generate(prompt, params)
        # the batch's prompt first, then the field: LLM.generate names which of its prompts is refused
        assert starts_with_field(str(info.value), f"prompts[0]: {field}"), info.value
    with pytest.raises(ValueError) as info:
        offline.chat([{"role": "robot", "content": "x"}])
    assert starts_with_field(str(info.value), "messages[0].role"), info.value
    assert offline.stats()["num_free_blocks"] == offline.stats()["num_total_blocks"]


def test_after_the_corpus_the_server_serves_with_every_block_back(app, client):
    assert len(client.generate("still serving", max_tokens=3, ignore_eos=True).token_ids) == 3
    status, reply = send("/v1/completions", {"prompt": "still serving", "max_tokens": 3, "ignore_eos": True})
    assert status == 200 and reply["usage"]["completion_tokens"] == 3
    stats = wait_idle()
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]
