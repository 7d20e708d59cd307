"""The served application end to end: streams against the offline engine, chat, tokenize, model info,
concurrency and preemption, cancellation, queue bounds, metrics, reflection, a lost engine."""

from __future__ import annotations

import asyncio
import re
import sys
import time
import urllib.request

import pytest
import ray

from pagedserve import SamplingParams
from pagedserve.chat.template import ChatOptions
from pagedserve.serving.model_server import replica_actor_names
from tests.serving.app import GREEDY, GRPC, HTTP, MAX_MODEL_LEN, METRICS_PORT, POOL_BLOCKS, wait_idle


def test_build_app_refuses_bad_settings_before_deploying():
    from pagedserve.serving.serve_app import build_app

    with pytest.raises(ValueError, match="executor='local': a served engine runs its workers as Ray actors"):
        build_app({"executor": "local"})
    with pytest.raises(ValueError, match="block_size=12"):
        build_app({"block_size": 12})
    build_app({"tensor_parallel_size": 2})  # needs executor='ray', which a served engine always has


def test_stream_equals_unary_and_offline_greedy(client, offline):
    prompt = "The quick brown fox jumps over"
    chunks = list(client.stream(prompt, **GREEDY))
    unary = client.generate(prompt, **GREEDY)
    assert "".join(c.text for c in chunks) == unary.text
    assert [t for c in chunks for t in c.token_ids] == unary.token_ids
    expected = offline.generate([prompt], SamplingParams(**GREEDY))[0].outputs[0]
    assert unary.token_ids == expected.token_ids and unary.text == expected.text
    assert unary.finish_reason == "length"
    assert unary.usage["completion_tokens"] == 24 and chunks[-1].usage is not None


def test_chat_tokenize_model_info_health(client, offline):
    messages = [{"role": "user", "content": "Say hello."}]
    out = client.chat(messages, **GREEDY)
    assert out.token_ids == offline.chat(messages, SamplingParams(**GREEDY))[0].outputs[0].token_ids
    assert client.tokenize(text="Hello world") == offline.tokenizer.encode("Hello world")
    assert client.tokenize(text="Hello world", add_special_tokens=False) == offline.tokenizer.encode(
        "Hello world", add_special_tokens=False)
    info = client.model_info()
    assert info["max_model_len"] == MAX_MODEL_LEN and info["block_size"] == 16
    assert info["num_kv_blocks"] == POOL_BLOCKS and info["kv_capacity_tokens"] == POOL_BLOCKS * 16
    assert client.health() == "SERVING"


def test_chat_template_options_over_grpc_as_offline(client, offline):
    prefilled = [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello"}]
    options = dict(add_generation_prompt=False, continue_final_message=True)
    ref = offline.chat(prefilled, SamplingParams(**GREEDY), **options)[0]
    assert client.chat(prefilled, **options, **GREEDY).token_ids == ref.outputs[0].token_ids
    assert client.tokenize(messages=prefilled, **options) == ref.prompt_token_ids
    thinking_off = {"enable_thinking": False}
    ids = client.tokenize(messages=prefilled[:1], chat_template_kwargs=thinking_off)
    assert ids == offline.llm_engine.inputs.chat_prompt(prefilled[:1],
                                                        options=ChatOptions(chat_template_kwargs=thinking_off))
    assert offline.tokenizer.decode(ids).endswith("<think>\n\n</think>\n\n")
    docs = [{"title": "Greeting", "text": "Hello is said on meeting."}]
    ref = offline.chat(prefilled[:1], SamplingParams(**GREEDY), documents=docs)[0]
    assert client.chat(prefilled[:1], documents=docs, **GREEDY).token_ids == ref.outputs[0].token_ids
    assert client.tokenize(messages=prefilled[:1], documents=docs) == ref.prompt_token_ids
    assert ref.prompt_token_ids != offline.llm_engine.inputs.chat_prompt(prefilled[:1])
    with pytest.raises(ValueError, match=r"documents\[0\] must be a dict of strings"):
        client.chat(prefilled[:1], documents=[{"title": 1}], **GREEDY)


def test_50_concurrent_streams_complete(app, offline):
    from pagedserve.client import AsyncClient

    prompts = [f"Request number {i} says" for i in range(50)]

    async def run():
        async with AsyncClient(GRPC, application=app, timeout=300) as c:
            async def one(i):
                chunks = [ch async for ch in c.stream(prompts[i], temperature=0, max_tokens=40 + i % 9,
                                                      ignore_eos=True)]
                return [t for ch in chunks for t in ch.token_ids], chunks[-1].finish_reason
            return await asyncio.gather(*(one(i) for i in range(50)))

    results = asyncio.run(run())
    for i, (tokens, reason) in enumerate(results):
        assert len(tokens) == 40 + i % 9 and reason == "length"
    expected = offline.generate(prompts[:5], [SamplingParams(temperature=0, max_tokens=40 + i % 9, ignore_eos=True)
                                              for i in range(5)])
    assert [r[0] for r in results[:5]] == [o.outputs[0].token_ids for o in expected]
    stats = wait_idle()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_preemptions"] > 0  # 50 streams of 3-4 blocks each on a 24-block pool


def test_cancelled_stream_frees_its_blocks(client):
    stream = client.stream("Tell me a long story", max_tokens=300, ignore_eos=True)
    first = next(iter(stream))
    assert first.token_ids
    stream.close() if hasattr(stream, "close") else None
    del stream
    stats = wait_idle()
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]


BAD = [
    (dict(prompt=""), "prompt"),
    (dict(prompt=[1, 2, 10**6]), "prompt_token_ids"),
    (dict(prompt=[5] * (MAX_MODEL_LEN + 1)), "max_model_len"),
    (dict(prompt="hi", max_tokens=0), "max_tokens"),
    (dict(prompt="hi", temperature=-1.0), "temperature"),
    (dict(prompt="hi", top_p=0.0), "top_p"),
    (dict(prompt="hi", top_p=1.5), "top_p"),
    (dict(prompt="hi", top_k=0), "top_k"),
    (dict(prompt="hi", top_k=-2), "top_k"),
    (dict(prompt="hi", n=0), "n"),
    (dict(prompt=[5] * 10, max_tokens=400), "can never fit"),
]


@pytest.mark.parametrize("kwargs, field", BAD)
def test_bad_input_is_invalid_argument_naming_the_field(client, kwargs, field):
    from pagedserve.client import InvalidArgument

    kwargs = dict(kwargs)
    prompt = kwargs.pop("prompt")
    with pytest.raises(InvalidArgument, match=re.escape(field)):
        client.generate(prompt, **kwargs)
    assert len(client.generate("still serving", max_tokens=3, ignore_eos=True).token_ids) == 3


def test_full_queue_is_resource_exhausted(app):
    from pagedserve.client import AsyncClient, ResourceExhausted

    async def run():
        async with AsyncClient(GRPC, application="bounded", timeout=120, max_retries=0) as c:
            async def one():
                try:
                    return await c.generate("x", max_tokens=60, ignore_eos=True)
                except ResourceExhausted as e:
                    return e
            return await asyncio.gather(*(one() for _ in range(6)))

    results = asyncio.run(run())
    rejected = [r for r in results if isinstance(r, ResourceExhausted)]
    assert rejected and "max_waiting_requests" in str(rejected[0])
    assert any(not isinstance(r, Exception) for r in results)
    wait_idle("bounded")


def test_openai_client_completions_and_chat(app, client):
    import openai

    oai = openai.OpenAI(base_url=f"{HTTP}/v1", api_key="unused", max_retries=0)
    model = oai.models.list().data[0].id
    prompt = "Once upon a time"
    ref = client.generate(prompt, **GREEDY)
    done = oai.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert done.choices[0].text == ref.text and done.choices[0].model_extra["token_ids"] == ref.token_ids
    streamed = oai.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == ref.text

    messages = [{"role": "user", "content": "Say hello."}]
    chat_ref = client.chat(messages, **GREEDY)
    chat = oai.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == chat_ref.text
    assert chat.choices[0].model_extra["token_ids"] == chat_ref.token_ids
    chunks = oai.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat_ref.text

    with pytest.raises(openai.BadRequestError, match="top_p"):
        oai.completions.create(model=model, prompt=prompt, top_p=5.0)
    with pytest.raises(openai.NotFoundError, match="model"):
        oai.completions.create(model="no-such-model", prompt=prompt)
    health = urllib.request.urlopen(f"{HTTP}/health", timeout=10).read()
    assert b"ok" in health


METRICS = ["pagedserve_requests_running", "pagedserve_requests_waiting", "pagedserve_kv_cache_usage",
           "pagedserve_prefix_cache_queries", "pagedserve_prefix_cache_hits", "pagedserve_preemptions",
           "pagedserve_prompt_tokens", "pagedserve_generation_tokens", "pagedserve_requests_finished",
           "pagedserve_time_to_first_token_seconds", "pagedserve_inter_token_latency_seconds",
           "pagedserve_e2e_request_latency_seconds", "pagedserve_request_queue_time_seconds",
           "pagedserve_step_time_seconds",
           "pagedserve_spec_decode_num_drafts", "pagedserve_spec_decode_num_draft_tokens",
           "pagedserve_spec_decode_num_accepted_tokens", "pagedserve_spec_decode_acceptance_rate",
           "pagedserve_spec_decode_mean_accepted_length", "pagedserve_kv_offload_hits",
           "pagedserve_kv_offload_saved_blocks", "pagedserve_kv_offload_restored_blocks", "pagedserve_kv_offload_usage"]
# Gauges can read 0 once traffic stops; the rest must have counted something.
MUST_BE_NONZERO = [m for m in METRICS if m not in ("pagedserve_requests_running", "pagedserve_requests_waiting",
                                                     "pagedserve_kv_cache_usage")]


def scrape() -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10).read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^ray_(pagedserve_\w+?)(_total|_count|_sum|_bucket)?(\{[^}]*\})? ([0-9.eE+-]+|NaN)$", line)
        if m and m.group(2) in (None, "_total", "_count"):
            values[m.group(1)] = max(values.get(m.group(1), 0.0), float(m.group(4)))
    return values


def test_metrics_endpoint_shows_every_metric(app, client):
    from pagedserve.client import AsyncClient

    long_prompt = ("one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
                   "seventeen eighteen nineteen twenty")  # > one 16-token block
    client.generate(long_prompt, **GREEDY)
    client.generate(long_prompt, **GREEDY)  # its first full block is a prefix-cache hit now

    async def crowd():  # more than the 24-block pool holds at once: preemptions
        async with AsyncClient(GRPC, application=app, timeout=300) as c:
            await asyncio.gather(*(c.generate(f"{i} {long_prompt}", max_tokens=40, ignore_eos=True)
                                   for i in range(12)))

    asyncio.run(crowd())
    client.generate(long_prompt, **GREEDY)  # the crowd evicted its blocks from the pool: the tier restores them
    deadline = time.monotonic() + 60  # metrics are exported on an interval
    while True:
        values = scrape()
        missing = [m for m in METRICS if m not in values]
        zero = [m for m in MUST_BE_NONZERO if values.get(m, 0) <= 0]
        if (not missing and not zero) or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert not missing, f"not exported: {missing}"
    assert not zero, f"zero despite traffic: {zero}"


def test_deadline_aborts_the_request_and_frees_blocks(client):
    from pagedserve.client import DeadlineExceeded

    with pytest.raises(DeadlineExceeded):
        client.generate("Tell me everything", max_tokens=300, ignore_eos=True, timeout=0.5)
    stats = wait_idle()
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]


def test_reflection_lists_the_service(app):
    import grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(GRPC) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                            timeout=10)
        names = {s.name for r in replies for s in r.list_services_response.service}
    assert "pagedserve.v1.PagedServe" in names


def test_the_ingress_replica_loads_no_engine_nor_torch(app):
    """The Ingress parses, routes and streams: its replicas (one per node, or more under load) start fast and stay
    small without the model's stack (torch, the engine), which only the model replicas load. (It reads the chat
    template parameters' names from transformers, which loads without torch.)"""
    names = replica_actor_names(app, "Ingress")
    assert names, "no Ingress replica"
    heavy = ("torch", "pagedserve.engine.async_engine", "pagedserve.workers")
    loaded = ray.get(ray.get_actor(names[0], namespace="serve").__ray_call__.remote(
        lambda _: sorted(m for m in heavy if m in sys.modules)))
    assert loaded == []


def test_engine_gone_is_unavailable(app):
    """Runs last: it kills the bounded app's engine replica under a live stream."""
    from pagedserve.client import Client, Unavailable

    with Client(GRPC, application="bounded", timeout=120, max_retries=0) as c:
        stream = c.stream("x", max_tokens=300, ignore_eos=True)
        assert next(iter(stream)).token_ids
        replicas = [a for a in ray.util.list_named_actors(all_namespaces=True)
                    if "bounded" in a["name"] and "ModelServer" in a["name"]]
        assert replicas, "no ModelServer replica of the bounded app"
        ray.kill(ray.get_actor(replicas[0]["name"], namespace=replicas[0]["namespace"]), no_restart=True)
        with pytest.raises(Unavailable, match="engine unavailable"):
            for _ in stream:
                pass
