"""The OpenAI-compatible routes through the official `openai` client, sync and streaming, field by field,
against the offline engine's answers."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from pagedserve import SamplingParams
from tests.serving.app import HTTP, POOL_BLOCKS, wait_idle

PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def oai(app):
    return openai.OpenAI(base_url=f"{HTTP}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(oai):
    return oai.models.list().data[0].id


def post(path: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(f"{HTTP}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_chat_runs_until_the_context_is_full_by_default_and_completions_stop_at_16(oai, model, client):
    chat = oai.chat.completions.create(model=model, messages=MESSAGES, temperature=0,
                                       extra_body={"ignore_eos": True})
    context = POOL_BLOCKS * 16  # the pool is smaller than max_model_len here
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens == context
    assert len(client.chat(MESSAGES, temperature=0, ignore_eos=True).token_ids) == chat.usage.completion_tokens
    done = oai.completions.create(model=model, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 16
    assert len(client.generate(PROMPT, temperature=0, ignore_eos=True).token_ids) == 16


def test_min_tokens_logit_bias_stop_reason_include_stop_str(oai, model, offline):
    ref = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    first = ref.token_ids[0]
    # min_tokens holds back a stop token id that would otherwise end the output at once
    out = oai.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=12,
                                 extra_body={"stop_token_ids": [first], "min_tokens": 3})
    assert out.usage.completion_tokens >= 3
    stopped = oai.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=12,
                                     extra_body={"stop_token_ids": [first]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].model_extra["stop_reason"] == first
    biased = oai.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=5,
                                    logit_bias={"42": 100}, extra_body={"ignore_eos": True})
    assert biased.choices[0].model_extra["token_ids"] == [42] * 5
    word = ref.text[3:6]
    for stream in (False, True):
        kw = dict(model=model, prompt=PROMPT, temperature=0, max_tokens=12, stop=[word], stream=stream,
                  extra_body={"include_stop_str_in_output": True, "ignore_eos": True})
        if stream:
            chunks = list(oai.completions.create(**kw))
            text, last = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0]
        else:
            last = oai.completions.create(**kw).choices[0]
            text = last.text
        assert text.endswith(word) and text == ref.text[:ref.text.index(word) + len(word)]
        assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == word


def first_token(llm, out) -> str:
    """The text of a prompt's first token, which offline prompt logprobs leave out (None, as vLLM's)."""
    return llm.llm_engine.outputs.detokenizer.token_texts(out.prompt_token_ids[:1])[0]


def test_echo_and_logprobs_in_openai_shape(oai, model, offline):
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    ref = offline.generate(PROMPT, params)[0]
    out = oai.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=3, echo=True, logprobs=2,
                                 extra_body={"ignore_eos": True}).choices[0]
    assert out.text == PROMPT + ref.outputs[0].text
    lp = out.logprobs
    entries = ref.prompt_logprobs[1:] + ref.outputs[0].logprobs
    assert lp.tokens == [first_token(offline, ref)] + [e.token for e in entries]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([e.logprob for e in entries], abs=1e-4)
    # OpenAI's: the token itself first, then the top 2 (it once among them)
    assert all(next(iter(top)) == token and len(top) <= 3
               for token, top in zip(lp.tokens[1:], lp.top_logprobs[1:], strict=True))
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert lp.text_offset[len(ref.prompt_token_ids)] == len("".join(lp.tokens[:len(ref.prompt_token_ids)]))
    # streamed: the same tokens, offsets running on across chunks
    chunks = list(oai.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=3, echo=True,
                                         logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == out.text
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == lp.tokens
    assert [o for c in chunks for o in c.choices[0].logprobs.text_offset] == lp.text_offset

    chat_ref = offline.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2))
    chat = oai.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=4, logprobs=True,
                                       top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    expected = chat_ref[0].outputs[0].logprobs
    assert [c.token for c in content] == [e.token for e in expected]
    assert [c.bytes for c in content] == [list(e.token.encode("utf-8", errors="replace")) for e in expected]
    assert [[t.token for t in c.top_logprobs] for c in content] == [[t.token for t in e.top_logprobs]
                                                                      for e in expected]
    streamed = list(oai.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=4,
                                                logprobs=True, top_logprobs=2, stream=True,
                                                extra_body={"ignore_eos": True}))
    assert [c.token for ch in streamed if ch.choices and ch.choices[0].logprobs
            for c in ch.choices[0].logprobs.content] == [e.token for e in expected]


def test_echo_with_max_tokens_0_scores_the_prompt_alone(oai, model, offline):
    ref = offline.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    for stream in (False, True):
        kw = dict(model=model, prompt=[PROMPT, PROMPT], echo=True, max_tokens=0, logprobs=1, stream=stream)
        if stream:
            chunks = list(oai.completions.create(**kw, stream_options={"include_usage": True}))
            usage, choices = chunks[-1].usage, [c for chunk in chunks[:-1] for c in chunk.choices]
        else:
            done = oai.completions.create(**kw)
            usage, choices = done.usage, done.choices
        for i in (0, 1):
            mine = [c for c in choices if c.index == i]
            assert "".join(c.text for c in mine) == PROMPT
            tokens = [t for c in mine for t in c.logprobs.tokens]
            logprobs = [p for c in mine for p in c.logprobs.token_logprobs]
            assert tokens == [first_token(offline, ref)] + [e.token for e in ref.prompt_logprobs[1:]]
            assert logprobs[0] is None
            assert logprobs[1:] == pytest.approx([e.logprob for e in ref.prompt_logprobs[1:]], abs=1e-4)
            assert [c.finish_reason for c in mine if c.finish_reason] == ["length"]
        assert (usage.prompt_tokens, usage.completion_tokens) == (2 * len(ref.prompt_token_ids), 0)
    status, body = post("/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 0})
    assert status == 400 and body["error"]["message"].startswith("max_tokens=0"), body


def test_prompt_logprobs_extension(model):
    status, body = post("/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 1})
    assert status == 200
    scored = body["choices"][0]["prompt_logprobs"]
    assert scored[0] is None and len(scored) == body["usage"]["prompt_tokens"]
    assert all(len(s) in (1, 2) for s in scored[1:])


def test_stream_usage_only_when_asked(oai, model):
    kw = dict(model=model, prompt=PROMPT, temperature=0, max_tokens=5, stream=True, extra_body={"ignore_eos": True})
    plain = list(oai.completions.create(**kw))
    assert all(c.usage is None for c in plain)
    with_usage = list(oai.completions.create(**kw, stream_options={"include_usage": True}))
    assert all(c.usage is None for c in with_usage[:-1])
    assert with_usage[-1].choices == [] and with_usage[-1].usage.completion_tokens == 5
    continuous = list(oai.chat.completions.create(
        model=model, messages=MESSAGES, temperature=0, max_tokens=5, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(c.usage is not None for c in continuous)
    counts = [c.usage.completion_tokens for c in continuous[:-1]]
    assert counts == sorted(set(counts)) and counts[0] == 1 and counts[-1] == 5  # tokens within an interval merge
    assert continuous[-1].choices == [] and continuous[-1].usage.completion_tokens == 5
    status, body = post("/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 2,
                                            "stream_options": {"include_usage": True}})
    assert status == 400 and body["error"]["param"] == "stream_options"


def test_tokenize_detokenize_and_model_routes(model, offline):
    status, body = post("/tokenize", {"model": model, "prompt": "Hello world", "return_token_strs": True})
    ids = offline.tokenizer.encode("Hello world")
    assert status == 200 and body["tokens"] == ids and body["count"] == len(ids)
    assert body["token_strs"] == offline.tokenizer.convert_ids_to_tokens(ids)
    status, body = post("/tokenize", {"messages": MESSAGES})
    assert status == 200 and body["tokens"] == offline.llm_engine.inputs.chat_prompt(MESSAGES)
    status, body = post("/detokenize", {"model": model, "tokens": ids})
    assert status == 200 and body["prompt"] == offline.tokenizer.decode(ids)
    status, body = post("/detokenize", {"tokens": [10**7]})
    assert status == 400 and "vocabulary" in body["error"]["message"] and body["error"]["code"] == 400
    with urllib.request.urlopen(f"{HTTP}/v1/models/{model}", timeout=10) as r:
        assert json.loads(r.read())["id"] == model
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"{HTTP}/v1/models/no-such-model", timeout=10)
    assert info.value.code == 404
    assert json.loads(info.value.read())["error"] == {
        "message": f"model='no-such-model' is not served here (serving {model!r})", "type": "not_found_error",
        "param": "model", "code": 404}


DOCS = [{"title": "Greeting", "text": "Hello is said on meeting."}]


@pytest.mark.parametrize("messages, options", [
    (MESSAGES, {"chat_template_kwargs": {"enable_thinking": False}}),
    (MESSAGES, {"documents": DOCS}),
    (MESSAGES + [{"role": "assistant", "content": "Hello"}], {"add_generation_prompt": False,
                                                             "continue_final_message": True}),
])
def test_chat_template_options_as_offline(oai, model, offline, messages, options):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = offline.chat(messages, params, **options)[0]
    out = oai.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=8,
                                      extra_body={"ignore_eos": True, **options})
    assert out.choices[0].message.content == ref.outputs[0].text
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert ref.prompt_token_ids != offline.llm_engine.inputs.chat_prompt(messages)  # the options did change the prompt
    status, body = post("/tokenize", {"messages": messages, **options})
    assert status == 200 and body["tokens"] == ref.prompt_token_ids


def test_chat_echo_starts_the_answer_with_the_continued_message(oai, model, offline):
    prefilled = MESSAGES + [{"role": "assistant", "content": "Hello"}]
    go_on = {"add_generation_prompt": False, "continue_final_message": True}
    ref = offline.chat(prefilled, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), **go_on)[0]
    kwargs = dict(model=model, messages=prefilled, temperature=0, max_tokens=8)
    whole = oai.chat.completions.create(**kwargs, extra_body={"ignore_eos": True, "echo": True, **go_on})
    assert whole.choices[0].message.content == "Hello" + ref.outputs[0].text
    chunks = oai.chat.completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True, "echo": True, **go_on})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello" + ref.outputs[0].text
    # the last message is the user's: nothing to echo
    plain = oai.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=8,
                                        extra_body={"ignore_eos": True, "echo": True})
    assert plain.choices[0].message.content == offline.chat(
        MESSAGES, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0].text


def test_allowed_token_ids_truncate_prompt_tokens_and_bad_words_as_offline(oai, model, client, offline):
    allowed = offline.tokenizer.encode(" a b c d e", add_special_tokens=False)
    greedy = dict(temperature=0, max_tokens=6, ignore_eos=True)
    first = offline.generate(PROMPT, SamplingParams(**greedy))[0].outputs[0].text.split()[0]
    for extra in ({"allowed_token_ids": allowed, "truncate_prompt_tokens": 3}, {"bad_words": [first]}):
        ref = offline.generate(PROMPT, SamplingParams(**greedy, **extra))[0]
        out = oai.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True, **extra})
        assert out.choices[0].text == ref.outputs[0].text and out.usage.prompt_tokens == len(ref.prompt_token_ids)
        grpc = client.generate(PROMPT, **greedy, **extra)
        assert grpc.token_ids == ref.outputs[0].token_ids
        assert grpc.usage["prompt_tokens"] == len(ref.prompt_token_ids)
    assert len(ref.prompt_token_ids) == len(offline.tokenizer.encode(PROMPT))  # bad_words cut nothing
    tokens = ref.outputs[0].token_ids
    for ids in offline.llm_engine.inputs.bad_words_token_ids([first]):  # the word, never spelled as tokenized
        assert not any(tokens[i:i + len(ids)] == ids for i in range(len(tokens))), (first, tokens)
    cut = offline.generate(PROMPT, SamplingParams(**greedy, allowed_token_ids=allowed, truncate_prompt_tokens=3))[0]
    assert len(cut.prompt_token_ids) == 3 and set(cut.outputs[0].token_ids) <= set(allowed)


def test_fields_asking_for_nothing_pass_and_others_are_refused_by_name(oai, model):
    nothing = {"use_beam_search": False, "length_penalty": 1.0, "spaces_between_special_tokens": True,
               "logits_processors": [], "guided_decoding_backend": "xgrammar", "guided_whitespace_pattern": None,
               "structural_tag": None, "kv_transfer_params": {}, "vllm_xargs": {}, "store": False,
               "service_tier": "auto", "metadata": {"team": "search"}, "safety_identifier": "u-1",
               "add_special_tokens": True, "priority": 0}
    plain = oai.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0)
    out = oai.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, extra_body=nothing)
    assert out.choices[0].text == plain.choices[0].text
    chat_nothing = {"chat_template": None, "reasoning_effort": None, "include_reasoning": True,
                    "mm_processor_kwargs": {}, "add_special_tokens": False}
    plain = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, temperature=0)
    out = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, temperature=0,
                                      extra_body={**nothing, **chat_nothing})
    assert out.choices[0].message.content == plain.choices[0].message.content
    for field, value in [("logits_processors", ["my.Processor"]),
                         ("guided_decoding_backend", "outlines"), ("guided_whitespace_pattern", " "),
                         ("structural_tag", "{}"), ("kv_transfer_params", {"a": 1}), ("vllm_xargs", {"a": 1}),
                         ("store", True), ("service_tier", "flex")]:
        with pytest.raises(openai.BadRequestError, match=f"{field}=.* is not supported"):
            oai.completions.create(model=model, prompt=PROMPT, max_tokens=2, extra_body={field: value})
    for field, value in [("chat_template", "{{ messages }}"), ("reasoning_effort", "low"),
                         ("include_reasoning", False), ("mm_processor_kwargs", {"a": 1})]:
        with pytest.raises(openai.BadRequestError, match=f"{field}=.* is not supported"):
            oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, extra_body={field: value})


def test_special_tokens_kept_in_the_text_are_never_spaced(oai, model):
    # spaces_between_special_tokens either way: the tokenizer's decode puts no space between them (as vLLM's)
    body = {"skip_special_tokens": False, "ignore_eos": True, "logit_bias": {"2": 100}}  # 2: <|im_end|>
    texts = [oai.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0, extra_body={
        **body, "spaces_between_special_tokens": spaced}).choices[0].text for spaced in (True, False)]
    assert texts == ["<|im_end|>" * 3] * 2


def test_completion_prompt_without_special_tokens(oai, model, offline):
    ids = offline.tokenizer.encode(PROMPT, add_special_tokens=False)
    ref = offline.generate([ids], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    out = oai.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, echo=True,
                                 extra_body={"ignore_eos": True, "add_special_tokens": False})
    assert out.choices[0].text == PROMPT + ref.outputs[0].text and out.usage.prompt_tokens == len(ids)


def test_logprobs_name_tokens_by_id_when_asked(oai, model):
    kwargs = dict(model=model, max_tokens=5, temperature=0, logprobs=2)
    by_text = oai.completions.create(prompt=PROMPT, **kwargs)
    by_id = oai.completions.create(prompt=PROMPT, **kwargs, extra_body={"return_tokens_as_token_ids": True})
    ids = by_id.choices[0].model_extra["token_ids"]
    assert by_id.choices[0].logprobs.tokens == [f"token_id:{t}" for t in ids]
    assert by_id.choices[0].logprobs.text_offset == by_text.choices[0].logprobs.text_offset
    assert by_id.choices[0].logprobs.token_logprobs == by_text.choices[0].logprobs.token_logprobs
    assert all(k.startswith("token_id:") for top in by_id.choices[0].logprobs.top_logprobs for k in top)
    chat = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body={"return_tokens_as_token_ids": True})
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [f"token_id:{t}" for t in chat.choices[0].model_extra["token_ids"]]
    assert all(c.bytes == list(c.token.encode()) for c in content)
    assert all(t.token.startswith("token_id:") for c in content for t in c.top_logprobs)


def test_cached_prompts_are_shared_only_under_the_same_cache_salt(oai, model, client):
    prompt = "Salted: a prompt of its own, long enough to fill a few blocks of the prefix cache. " * 2

    def run(**extra) -> tuple[int, str]:
        before = wait_idle()["prefix_cache_hits"]
        out = oai.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, extra_body=extra)
        return wait_idle()["prefix_cache_hits"] - before, out.choices[0].text

    first = run(cache_salt="tenant-a")
    assert first[0] == 0
    assert run(cache_salt="tenant-b") == (0, first[1])
    assert run() == (0, first[1])
    again = run(cache_salt="tenant-a")
    assert again[0] >= 16 and again[1] == first[1]
    before = wait_idle()["prefix_cache_hits"]
    assert client.generate(prompt, max_tokens=4, temperature=0, cache_salt="tenant-b").text == first[1]
    assert wait_idle()["prefix_cache_hits"] - before == again[0]
    status, body = post("/v1/completions", {"prompt": prompt, "cache_salt": ""})
    assert status == 400 and body["error"]["param"] == "cache_salt"


def test_unsupported_fields_are_refused_by_name(oai, model):
    for kwargs, field in [
        (dict(response_format={"type": "xml"}), "response_format"),
        (dict(tools=[{"type": "function", "function": {"name": "f g"}}]), r"tools\[0\]\.function\.name"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(extra_body={"frobnicate": 1}), "frobnicate"),
    ]:
        with pytest.raises(openai.BadRequestError, match=field):
            oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, **kwargs)
    ok = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, response_format={"type": "text"},
                                     tool_choice="none")
    assert ok.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="suffix"):
        oai.completions.create(model=model, prompt=PROMPT, max_tokens=2, suffix="end")
    with pytest.raises(openai.BadRequestError, match="best_of"):
        oai.completions.create(model=model, prompt=PROMPT, max_tokens=2, best_of=3)
    stats = wait_idle()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_return_token_ids_puts_the_prompt_and_output_ids_where_vllm_does(oai, model, client, offline):
    messages = [{"role": "user", "content": "Say hello."}]
    chat_prompt = offline.llm_engine.inputs.chat_prompt(messages)
    text_prompt = offline.llm_engine.inputs.encode_prompt(PROMPT)
    kw = dict(model=model, temperature=0, max_tokens=5, extra_body={"ignore_eos": True, "return_token_ids": True})
    chat = oai.chat.completions.create(messages=messages, **kw)
    assert chat.model_extra["prompt_token_ids"] == chat_prompt
    ids = chat.choices[0].model_extra["token_ids"]
    assert len(ids) == 5
    chunks = list(oai.chat.completions.create(messages=messages, stream=True, **kw))
    assert chunks[0].model_extra["prompt_token_ids"] == chat_prompt
    assert all("prompt_token_ids" not in c.model_extra for c in chunks[1:])
    assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == ids
    # completions: on each choice (each choice's first chunk), the prompt after truncate_prompt_tokens
    done = oai.completions.create(prompt=PROMPT, n=2, **kw)
    assert [c.model_extra["prompt_token_ids"] for c in done.choices] == [text_prompt] * 2
    cut = dict(kw, extra_body=dict(kw["extra_body"], truncate_prompt_tokens=2))
    firsts = [c for c in oai.completions.create(prompt=PROMPT, stream=True, **cut) if "prompt_token_ids" in
              c.choices[0].model_extra]
    assert [c.choices[0].model_extra["prompt_token_ids"] for c in firsts] == [text_prompt[-2:]]
    # unset: the output's ids as always, not the prompt's; false: neither (null, as vLLM's)
    plain = oai.chat.completions.create(messages=messages, model=model, temperature=0, max_tokens=5,
                                        extra_body={"ignore_eos": True})
    assert plain.choices[0].model_extra["token_ids"] == ids and plain.model_extra["prompt_token_ids"] is None
    off = oai.chat.completions.create(messages=messages, **dict(kw, extra_body={"ignore_eos": True,
                                                                               "return_token_ids": False}))
    assert off.choices[0].model_extra["token_ids"] is None and off.model_extra["prompt_token_ids"] is None
    # gRPC: on the first message, when asked
    assert client.chat(messages, temperature=0, max_tokens=5, ignore_eos=True,
                       return_prompt_token_ids=True).prompt_token_ids == chat_prompt
    assert client.generate(PROMPT, max_tokens=2, return_prompt_token_ids=True).prompt_token_ids == text_prompt
    assert client.generate(PROMPT, max_tokens=2).prompt_token_ids is None


def test_participant_names_and_the_developer_role_are_taken(oai, model, client):
    named = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Say hello.", "name": "al"}]
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
    kw = dict(model=model, temperature=0, max_tokens=6, extra_body={"ignore_eos": True, "return_token_ids": True})
    # this model's template has no place for names and knows no developer role: the prompts are the same
    got, want = (oai.chat.completions.create(messages=m, **kw) for m in (named, plain))
    assert got.model_extra["prompt_token_ids"] == want.model_extra["prompt_token_ids"]
    assert got.choices[0].model_extra["token_ids"] == want.choices[0].model_extra["token_ids"]
    assert client.chat(named, temperature=0, max_tokens=6, ignore_eos=True).token_ids == \
        want.choices[0].model_extra["token_ids"]


def test_a_batch_of_prompts_runs_one_request_each_numbered_as_openai_does(oai, model, offline):
    prompts = [PROMPT, "The capital of France is", "Hello"]
    refs = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    kw = dict(model=model, prompt=prompts, n=2, temperature=0, max_tokens=6,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    whole = oai.completions.create(**kw)
    assert [c.index for c in whole.choices] == list(range(6))  # prompt i's samples are choices 2i, 2i+1
    for c in whole.choices:
        ref = refs[c.index // 2]
        assert (c.text, c.model_extra["token_ids"]) == (ref.outputs[0].text, ref.outputs[0].token_ids)
        assert c.model_extra["prompt_token_ids"] == ref.prompt_token_ids
    assert whole.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in refs)
    assert whole.usage.completion_tokens == 6 * 6
    # streamed: the same choices, each prompt's echoed and scored
    chunks = list(oai.completions.create(**dict(kw, stream=True, echo=True, logprobs=0,
                                                stream_options={"include_usage": True})))
    texts: dict[int, str] = {}
    scored: dict[int, list] = {}
    for chunk in chunks[:-1]:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            scored.setdefault(c.index, []).extend(c.logprobs.tokens)
    assert sorted(texts) == list(range(6))
    for i, text in texts.items():
        ref = refs[i // 2]
        assert text == prompts[i // 2] + ref.outputs[0].text
        assert len(scored[i]) == len(ref.prompt_token_ids) + 6
    assert chunks[-1].usage.completion_tokens == 36 and not chunks[-1].choices
    # a batch of token-id prompts, echoed as their text
    ids = [[5, 6, 7], [8, 9]]
    echoed = oai.completions.create(model=model, prompt=ids, temperature=0, max_tokens=2, echo=True)
    for c, ref in zip(echoed.choices, offline.generate(ids, SamplingParams(temperature=0, max_tokens=2)),
                      strict=True):
        assert c.text == offline.tokenizer.decode(ids[c.index]) + ref.outputs[0].text
    # one prompt refused: the batch is refused, and the prompts already running are ended
    status, reply = post("/v1/completions", {"prompt": [PROMPT, [5] * 600], "max_tokens": 50, "ignore_eos": True})
    assert status == 400 and reply["error"]["message"].startswith("prompt"), reply
    stats = wait_idle()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_usage_counts_the_prompt_tokens_the_prefix_cache_held(oai, model, client):
    import uuid

    messages = [{"role": "user", "content": f"{uuid.uuid4().hex} " + "tell me a story " * 12}]
    kw = dict(model=model, messages=messages, temperature=0, max_tokens=2)
    first = oai.chat.completions.create(**kw).usage
    before = wait_idle()["prefix_cache_hits"]
    again = oai.chat.completions.create(**kw).usage
    cached = again.prompt_tokens_details.cached_tokens
    assert cached == wait_idle()["prefix_cache_hits"] - before > first.prompt_tokens_details.cached_tokens
    assert cached % 16 == 0 and cached < again.prompt_tokens
    assert client.chat(messages, temperature=0, max_tokens=2).usage["cached_tokens"] == cached


def test_beam_search_answers_as_offline_through_completions_chat_and_grpc(oai, model, client, offline):
    """use_beam_search (vLLM's) gives the n best beams, best first, as the offline engine's search (itself
    checked against transformers' num_beams search), in one answer: completions, a streamed chat, gRPC."""
    beams = {"use_beam_search": True, "length_penalty": 0.5}
    want = offline.generate(PROMPT, SamplingParams(n=3, max_tokens=8, temperature=0, **beams))[0].outputs
    assert len({tuple(c.token_ids) for c in want}) == 3
    out = oai.completions.create(model=model, prompt=PROMPT, n=3, max_tokens=8, extra_body=beams)
    assert [(c.index, c.text, c.finish_reason) for c in out.choices] == [
        (i, c.text, c.finish_reason) for i, c in enumerate(want)]
    assert out.usage.completion_tokens == sum(len(c.token_ids) for c in want)

    ask = offline.llm_engine.inputs.chat_prompt(MESSAGES)
    chat_want = offline.generate(ask, SamplingParams(n=2, max_tokens=10, temperature=0, **beams))[0].outputs
    texts = ["", ""]
    for chunk in oai.chat.completions.create(model=model, messages=MESSAGES, n=2, max_tokens=10, stream=True,
                                             extra_body=beams):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [c.text for c in chat_want]

    completion = client.generate(PROMPT, n=3, max_tokens=8, **beams)
    assert [c.token_ids for c in completion.choices] == [c.token_ids for c in want]
    stats = wait_idle()
    assert stats["num_free_blocks"] == stats["num_total_blocks"] and stats["num_streams"] == 0
