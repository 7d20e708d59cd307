"""The gRPC surface beyond generation: grpc's own health service, structured error details, the
FinishReason enum and stop reasons, logprob token text, prompt logprobs, Abort, a retried request id, EOS
ids in ModelInfo."""

from __future__ import annotations

import threading

import grpc
import pytest

from pagedserve import SamplingParams
from tests.serving.app import GRPC, wait_idle

PROMPT = "The quick brown fox"


def test_standard_health_service_answers_per_service(app):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    metadata = (("application", app),)
    with grpc.insecure_channel(GRPC) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "pagedserve.v1.PagedServe"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), metadata=metadata, timeout=30)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), metadata=metadata, timeout=30)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), metadata=metadata, timeout=30)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()


def test_bad_input_carries_a_bad_request_detail(client):
    from pagedserve.client import InvalidArgument

    for kwargs, field in [(dict(temperature=-1.0), "temperature"), (dict(logit_bias={10**7: 1.0}), "logit_bias"),
                          (dict(min_tokens=5, max_tokens=2), "min_tokens")]:
        with pytest.raises(InvalidArgument) as info:
            list(client.stream(PROMPT, **kwargs))
        assert [f for f, _ in info.value.field_violations] == [field], info.value
    with pytest.raises(InvalidArgument) as info:
        client.tokenize(messages=[{"role": "robot", "content": "hi"}])
    assert info.value.field_violations[0][0] == "messages[0].role"


def test_finish_and_stop_reasons_logprob_text_and_prompt_logprobs(client, offline):
    params = dict(temperature=0, max_tokens=6, ignore_eos=True)
    ref = offline.generate(PROMPT, SamplingParams(**params, logprobs=1, prompt_logprobs=1))[0]
    out = client.generate(PROMPT, **params, logprobs=1, prompt_logprobs=1)
    assert out.finish_reason == "length" and out.choices[0].stop_reason is None
    assert [lp.token for lp in out.logprobs] == [e.token for e in ref.outputs[0].logprobs]
    assert [lp.top_tokens for lp in out.logprobs] == [[t.token for t in e.top_logprobs]
                                                      for e in ref.outputs[0].logprobs]
    assert [lp.token_id for lp in out.prompt_logprobs] == ref.prompt_token_ids[1:]
    assert [lp.logprob for lp in out.prompt_logprobs] == pytest.approx([e.logprob for e in ref.prompt_logprobs[1:]],
                                                                      abs=1e-4)
    stop_id = ref.outputs[0].token_ids[2]
    out = client.generate(PROMPT, **params, stop_token_ids=[stop_id])
    assert out.finish_reason == "stop" and out.choices[0].stop_reason == stop_id
    word = ref.outputs[0].text[2:5]
    out = client.generate(PROMPT, **params, stop=[word], include_stop_str_in_output=True)
    assert out.choices[0].stop_reason == word and out.text.endswith(word)
    info = client.model_info()
    assert info["eos_token_ids"] == list(offline.llm_engine.eos_token_ids) and info["num_replicas"] == 1


def test_abort_by_request_id_ends_the_stream_and_frees_blocks(client):
    stream = client.stream(PROMPT, max_tokens=300, ignore_eos=True, request_id="to-abort")
    chunks = [next(stream)]
    assert client.abort("to-abort") is True
    chunks += list(stream)
    assert chunks[-1].finish_reason == "abort" and chunks[-1].usage is not None
    assert len([t for c in chunks for t in c.token_ids]) < 300
    assert client.abort("to-abort") is False and client.abort("never-was") is False
    stats = wait_idle()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_a_retried_request_id_replaces_the_earlier_attempt(client):
    """What the SDK does when a stream's first attempt was lost: the same id again. The earlier attempt
    ends (abort), the retry runs, and the engine never holds the request twice."""
    first = client.stream(PROMPT, max_tokens=300, ignore_eos=True, request_id="retried")
    head = next(first)
    assert head.token_ids
    rest: list = []
    drain = threading.Thread(target=lambda: rest.extend(first))
    drain.start()
    second = client.generate(PROMPT, max_tokens=5, ignore_eos=True, request_id="retried")
    drain.join(60)
    assert rest[-1].finish_reason == "abort"
    assert second.finish_reason == "length" and len(second.token_ids) == 5
    stats = wait_idle()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_a_field_this_server_does_not_know_is_refused_not_dropped(app):
    from pagedserve.protos import pagedserve_pb2 as pb

    # a newer client's request: GenerateRequest field 14, which this server's proto does not have
    raw = pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(max_tokens=2)).SerializeToString() + b"\x70\x01"
    with grpc.insecure_channel(GRPC) as channel:
        generate = channel.unary_stream("/pagedserve.v1.PagedServe/Generate", request_serializer=lambda b: b,
                                        response_deserializer=pb.GenerateResponse.FromString)
        with pytest.raises(grpc.RpcError) as info:
            list(generate(raw, metadata=(("application", app),), timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("GenerateRequest: field number(s) [14] are not known to this server")
