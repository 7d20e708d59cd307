"""The committed gRPC stubs are exactly what the generator makes from the .proto files."""

from __future__ import annotations

import grpc_tools  # noqa: F401
import pytest


def test_stubs_are_fresh(tmp_path):
    from pagedserve.protos.generate import OUT_DIR, generate

    fresh = generate(tmp_path)
    assert fresh, "no stubs generated"
    for path in fresh:
        committed = OUT_DIR / path.name
        assert committed.is_file(), f"{committed.name} is not committed: run python -m pagedserve.protos.generate"
        assert committed.read_text() == path.read_text(), (
            f"{committed.name} is stale: run python -m pagedserve.protos.generate")


def test_stubs_import_and_describe_the_service():
    from pagedserve.protos import SERVICE_NAME, pagedserve_pb2, pagedserve_pb2_grpc

    service = pagedserve_pb2.DESCRIPTOR.services_by_name["PagedServe"]
    assert service.full_name == SERVICE_NAME
    assert {m.name for m in service.methods} == {"Generate", "Chat", "Tokenize", "ModelInfo", "Abort",
                                                   "Health"}
    assert hasattr(pagedserve_pb2_grpc, "add_PagedServeServicer_to_server")


def test_sampling_fields_come_from_the_proto_and_map_onto_sampling_params():
    import dataclasses

    from pagedserve.protos import pagedserve_pb2
    from pagedserve.protos.sampling import SAMPLING_FIELDS, sampling_from_proto, sampling_to_proto
    from pagedserve.sampling_params import SamplingParams

    assert SAMPLING_FIELDS == tuple(f.name for f in pagedserve_pb2.SamplingParams.DESCRIPTOR.fields)
    # gRPC and the offline API take the same sampling fields
    assert set(SAMPLING_FIELDS) == {f.name for f in dataclasses.fields(SamplingParams)}
    sampling = {"n": 2, "temperature": 0.5, "top_k": 7, "seed": 3, "max_tokens": 9, "stop": ["x", "yz"],
                "stop_token_ids": [4, 5], "ignore_eos": True, "logprobs": 0, "min_tokens": 0,
                "logit_bias": {5: -1.5, 7: 100.0}, "prompt_logprobs": 1}
    assert sampling_from_proto(sampling_to_proto(sampling)) == sampling  # set to 0 / False still counts as set
    assert sampling_from_proto(sampling_to_proto({"stop": "x", "seed": None})) == {"stop": ["x"]}
    SamplingParams(**sampling_from_proto(sampling_to_proto(sampling)))
    with pytest.raises(TypeError, match="unknown sampling parameter 'beam_width'"):
        sampling_to_proto({"beam_width": 4})
    with pytest.raises(TypeError, match="sampling parameter top_k='many'"):
        sampling_to_proto({"top_k": "many"})


def test_chat_messages_cross_the_wire_whole():
    from pagedserve.chat.template import MESSAGE_FIELDS
    from pagedserve.protos.chat_messages import messages_from_proto, messages_to_proto

    history = [{"role": "developer", "content": "Be brief.", "name": "ops"},
               {"role": "user", "content": "Time?", "name": "alice"},
               {"role": "assistant", "content": "", "reasoning": "Ask the clock.", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
               {"role": "tool", "content": "12:00", "tool_call_id": "c1", "name": "now"}]
    assert messages_from_proto(messages_to_proto(history)) == history
    # every field the engine knows has a place on the wire (one that did not would be dropped unseen)
    from pagedserve.protos import pagedserve_pb2

    wire = {f.name for f in pagedserve_pb2.ChatMessage.DESCRIPTOR.fields}
    assert set(MESSAGE_FIELDS) - {"reasoning_content"} == wire
    with pytest.raises(ValueError, match=r"messages\[0\]: unsupported keys \['nick'\]"):
        messages_to_proto([{"role": "user", "content": "hi", "nick": "al"}])


def test_fields_this_server_does_not_know_are_refused_by_number():
    from pagedserve.protos import pagedserve_pb2 as pb
    from pagedserve.serving.grpc_service import check_known

    def newer(message, extra: bytes):  # as a newer client would send it: with a field this proto lacks
        return type(message).FromString(message.SerializeToString() + extra)

    known = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="hi")],
                           sampling=pb.SamplingParams(temperature=0.5, logit_bias={1: 2.0}),
                           template=pb.ChatTemplateOptions(documents=[pb.Document(fields={"title": "t"})]))
    check_known(known)
    with pytest.raises(ValueError, match=r"^GenerateRequest: field number\(s\) \[14\] are not known"):
        check_known(newer(pb.GenerateRequest(text="hi"), b"\x70\x01"))  # field 14, a varint
    with pytest.raises(ValueError, match=r"^sampling: field number\(s\) \[40\]"):
        check_known(pb.GenerateRequest(text="hi", sampling=newer(pb.SamplingParams(), b"\xc0\x02\x01")))
    with pytest.raises(ValueError, match=r"^messages\[1\]: field number\(s\) \[9\]"):
        check_known(pb.ChatRequest(messages=[pb.ChatMessage(role="user"),
                                             newer(pb.ChatMessage(role="user"), b"\x48\x01")]))
