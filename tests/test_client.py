"""The client SDK and `pagedserve client` CLI against a real gRPC server on 127.0.0.1 with a scripted servicer.

The servicer stands in for Ray Serve's proxy plus the engine: it records what reached it (request,
metadata, deadline, cancellation) and answers per test with a script of messages and status codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
import pytest

from pagedserve.client import (
    AsyncClient,
    Client,
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    PagedServeError,
    ResourceExhausted,
    StreamChunk,
    Unavailable,
)
from pagedserve.client.errors import from_rpc_error
from pagedserve.protos import pagedserve_pb2 as pb
from pagedserve.protos import pagedserve_pb2_grpc as pb_grpc

PIECES = ["Hello", " world", ",", " sample"]  # one message each; sample i ends with f" {i}"


def scripted_stream(request: pb.GenerateRequest | pb.ChatRequest, context: grpc.ServicerContext,
                    ) -> Iterator[pb.GenerateResponse]:
    """n samples interleaved, one piece per message, finish_reason per sample, usage on the last message."""
    n = request.sampling.n if request.sampling.HasField("n") else 1
    request_id = request.request_id or "srv-1"
    token = 100
    for step in range(len(PIECES) + 1):
        for i in range(n):
            text = PIECES[step] if step < len(PIECES) else f" {i}"
            ids = [token, token + 1]
            token += 2
            msg = pb.GenerateResponse(request_id=request_id, index=i, text=text, token_ids=ids)
            if request.sampling.HasField("logprobs"):
                for t in ids:
                    msg.logprobs.add(token_id=t, logprob=-0.5,
                                     top_logprobs=[pb.TopLogprob(token_id=t, logprob=-0.5),
                                                   pb.TopLogprob(token_id=1, logprob=-2.0)])
            if step == len(PIECES):
                msg.finish_reason = pb.FINISH_REASON_LENGTH
                if i == n - 1:
                    msg.usage.CopyFrom(pb.Usage(prompt_tokens=3, completion_tokens=token - 100,
                                                total_tokens=3 + token - 100))
            yield msg


def expected_text(i: int) -> str:
    return "".join(PIECES) + f" {i}"


class ScriptedServicer(pb_grpc.PagedServeServicer):
    def __init__(self) -> None:
        self.script: Callable[..., Iterator[pb.GenerateResponse]] = scripted_stream
        self.unary_fail: list[grpc.StatusCode] = []  # codes the next unary calls abort with, in order
        self.calls = 0
        self.requests: list[object] = []
        self.metadata: list[dict[str, str]] = []
        self.time_remaining: list[float | None] = []
        self.cancelled = threading.Event()  # set when a handler saw its RPC cancelled by the client

    def _record(self, request: object, context: grpc.ServicerContext) -> None:
        self.calls += 1
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        self.time_remaining.append(context.time_remaining())

    def Generate(self, request, context):  # noqa: N802
        self._record(request, context)
        yield from self.script(request, context)

    Chat = Generate

    def _unary(self, request, context):
        self._record(request, context)
        if self.unary_fail:
            context.abort(self.unary_fail.pop(0), "scripted failure")

    def Tokenize(self, request, context):  # noqa: N802
        self._unary(request, context)
        if request.messages:
            return pb.TokenizeResponse(token_ids=[len(m.content) for m in request.messages])
        return pb.TokenizeResponse(token_ids=[ord(c) for c in request.text])

    def ModelInfo(self, request, context):  # noqa: N802
        self._unary(request, context)
        return pb.ModelInfoResponse(model="tiny", max_model_len=2048, block_size=16, num_kv_blocks=2**40,
                                    kv_capacity_tokens=2**44, vocab_size=49152, num_replicas=1)

    def Health(self, request, context):  # noqa: N802
        self._unary(request, context)
        return pb.HealthResponse(status="SERVING")


def hold(context: grpc.ServicerContext, limit_s: float) -> bool:
    """Keep the handler busy until the RPC ends (True) or limit_s passes (False)."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        if not context.is_active():
            return True
        time.sleep(0.01)
    return False


def endless(servicer: ScriptedServicer) -> Callable[..., Iterator[pb.GenerateResponse]]:
    """One message, then nothing until the client cancels; sets servicer.cancelled when it does."""

    def script(request, context):
        timed_out = threading.Event()
        # A termination callback, not the loop in hold(): when the client's cancel beats the server's
        # pending send, the server never resumes this generator at all.
        context.add_callback(lambda: None if timed_out.is_set() else servicer.cancelled.set())
        yield pb.GenerateResponse(request_id="r", index=0, text="a", token_ids=[1])
        if not hold(context, limit_s=10):
            timed_out.set()

    return script


@contextlib.contextmanager
def socket_port() -> Iterator[int]:
    """A 127.0.0.1 port with nothing listening (bound but never listening, so no one else takes it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@pytest.fixture
def server() -> Iterator[tuple[ScriptedServicer, str]]:
    servicer = ScriptedServicer()
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_PagedServeServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        srv.stop(grace=None).wait(10)


def client_for(target: str, **kw) -> Client:
    kw.setdefault("backoff_s", 0.01)
    kw.setdefault("timeout", 10.0)
    return Client(target, **kw)


def async_client_for(target: str, **kw) -> AsyncClient:
    kw.setdefault("backoff_s", 0.01)
    kw.setdefault("timeout", 10.0)
    return AsyncClient(target, **kw)


# ---- sync client ----------------------------------------------------------------------------------


def test_stream_deltas_join_to_generate(server):
    servicer, target = server
    with client_for(target) as client:
        chunks = list(client.stream("hi", max_tokens=8))
        completion = client.generate("hi", max_tokens=8)
    assert all(isinstance(c, StreamChunk) for c in chunks)
    assert "".join(c.text for c in chunks) == completion.text == expected_text(0)
    assert [t for c in chunks for t in c.token_ids] == completion.token_ids
    assert completion.token_ids == list(range(100, 100 + len(completion.token_ids)))
    assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert [c.usage is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert completion.usage == {"prompt_tokens": 3, "completion_tokens": 10, "total_tokens": 13, "cached_tokens": 0}
    assert completion.finish_reason == "length"
    # the SDK names every request, so a retried stream keeps its id
    assert completion.request_id == servicer.requests[1].request_id and len(completion.request_id) == 32
    assert completion.logprobs is None and chunks[0].logprobs is None
    assert servicer.requests[0].text == "hi"


def test_n2_choices_and_usage_on_last_message(server):
    _, target = server
    with client_for(target) as client:
        chunks = list(client.stream([1, 2, 3], n=2))
        completion = client.generate([1, 2, 3], n=2, request_id="mine")
    assert [c.usage is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert {c.index for c in chunks} == {0, 1}
    assert [ch.index for ch in completion.choices] == [0, 1]
    for i, choice in enumerate(completion.choices):
        assert choice.text == expected_text(i) == "".join(c.text for c in chunks if c.index == i)
        assert choice.token_ids == [t for c in chunks if c.index == i for t in c.token_ids]
        assert choice.finish_reason == "length"
    assert completion.text == completion.choices[0].text
    assert completion.usage["completion_tokens"] == 20
    assert completion.request_id == "mine"


def test_sampling_fields_set_and_unset(server):
    servicer, target = server
    with client_for(target) as client:
        completion = client.generate([5, 6], temperature=0, top_k=-1, seed=2**40, stop="END", logprobs=2,
                                     stop_token_ids=[2], ignore_eos=True, top_p=None)
        client.chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                    stop=["a", "b"])
    gen, chat = servicer.requests
    assert list(gen.token_ids.ids) == [5, 6] and gen.WhichOneof("prompt") == "token_ids"
    s = gen.sampling
    assert s.HasField("temperature") and s.temperature == 0  # 0 (greedy) is sent, not mistaken for unset
    assert s.top_k == -1 and s.seed == 2**40 and list(s.stop) == ["END"] and list(s.stop_token_ids) == [2]
    assert s.ignore_eos and s.logprobs == 2
    for name in ("n", "top_p", "min_p", "max_tokens", "repetition_penalty", "skip_special_tokens"):
        assert not s.HasField(name), name  # left to the server's defaults
    assert [(m.role, m.content) for m in chat.messages] == [("system", "be brief"), ("user", "hi")]
    assert list(chat.sampling.stop) == ["a", "b"]
    lp = completion.logprobs
    assert lp is not None and [t.token_id for t in lp] == completion.token_ids
    assert lp[0].logprob == -0.5 and lp[0].top_logprobs == {lp[0].token_id: -0.5, 1: -2.0}


def test_unknown_sampling_keyword_is_a_type_error(server):
    servicer, target = server
    with client_for(target) as client:
        with pytest.raises(TypeError, match="temprature"):
            client.generate("hi", temprature=0.5)
        with pytest.raises(TypeError, match="bogus"):
            client.stream("hi", bogus=1)
        with pytest.raises(TypeError, match="top_k"):
            client.generate("hi", top_k=0.5)
    assert servicer.calls == 0


def test_application_metadata_and_deadline_reach_the_server(server):
    servicer, target = server
    with client_for(target, application="myapp", timeout=30.0) as client:
        client.generate("hi")
        client.generate("hi", timeout=5)
        assert client.health() == "SERVING"
        client.generate("hi", timeout=None)
    assert all(m.get("application") == "myapp" for m in servicer.metadata)
    first, per_call, unary, none = servicer.time_remaining
    # grpc-timeout travels with limited precision (rounded up), hence the slack.
    assert 20 < first <= 31 and 0 < per_call <= 5.5 and 20 < unary <= 31
    assert none is None or none > 1e6  # no deadline


def test_invalid_argument_is_raised_with_the_server_message_and_not_retried(server):
    servicer, target = server

    def reject(request, context):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "temperature must be >= 0, got -1.0")
        yield  # pragma: no cover

    servicer.script = reject
    with client_for(target) as client, pytest.raises(InvalidArgument) as info:
        client.generate("hi", temperature=-1)
    e = info.value
    assert isinstance(e, PagedServeError)
    assert e.code == grpc.StatusCode.INVALID_ARGUMENT
    assert e.details == "temperature must be >= 0, got -1.0"
    assert str(e) == "INVALID_ARGUMENT: temperature must be >= 0, got -1.0"
    assert servicer.calls == 1


def test_other_codes_map_to_their_exceptions(server):
    servicer, target = server
    servicer.unary_fail = [grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND]
    with client_for(target) as client:
        with pytest.raises(ResourceExhausted, match="scripted failure"):
            client.tokenize("x")
        with pytest.raises(NotFound):
            client.model_info()
    assert servicer.calls == 2  # neither is retried


def test_unavailable_twice_then_success_is_retried(server):
    servicer, target = server

    def flaky(request, context):
        if servicer.calls <= 2:
            context.abort(grpc.StatusCode.UNAVAILABLE, "engine not up yet")
        yield from scripted_stream(request, context)

    servicer.script = flaky
    with client_for(target, max_retries=2) as client:
        assert client.generate("hi").text == expected_text(0)
    assert servicer.calls == 3
    assert all(m.get("application") == "pagedserve" for m in servicer.metadata)
    # every attempt carries the same request id: the server treats a retry as the same request
    assert len({r.request_id for r in servicer.requests}) == 1 and servicer.requests[0].request_id


def test_status_details_name_the_field_and_the_carrier_message_is_skipped(server):
    """The server's error shape behind Ray Serve's proxy: one empty message, then the status with a
    google.rpc.BadRequest in its details."""
    from google.protobuf import any_pb2
    from google.rpc import code_pb2, error_details_pb2, status_pb2
    from grpc_status import rpc_status

    servicer, target = server

    def reject(request, context):
        detail = any_pb2.Any()
        detail.Pack(error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field="temperature", description="must be >= 0")]))
        status = rpc_status.to_status(status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message="temperature=-1",
                                                        details=[detail]))
        context.set_code(status.code)
        context.set_details(status.details)
        context.set_trailing_metadata(status.trailing_metadata)
        yield pb.GenerateResponse()

    servicer.script = reject
    with client_for(target) as client, pytest.raises(InvalidArgument) as info:
        list(client.stream("hi"))
    assert info.value.field_violations == [("temperature", "must be >= 0")]
    assert servicer.calls == 1


def test_api_key_from_argument_or_environment(server, monkeypatch):
    servicer, target = server
    with client_for(target, api_key="k1") as client:
        client.generate("hi")
        client.health()
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "k2")
    with client_for(target) as client:
        client.generate("hi")
    monkeypatch.delenv("PAGEDSERVE_API_KEY")
    with client_for(target) as client:
        client.generate("hi")
    assert [m.get("authorization") for m in servicer.metadata] == ["Bearer k1", "Bearer k1", "Bearer k2", None]


def test_unary_unavailable_is_retried(server):
    servicer, target = server
    servicer.unary_fail = [grpc.StatusCode.UNAVAILABLE] * 2
    with client_for(target) as client:
        assert client.tokenize("ab") == [97, 98]
        assert client.tokenize(messages=[{"role": "user", "content": "abc"}]) == [3]
        info = client.model_info()
    assert servicer.calls == 3 + 1 + 1
    assert info["model"] == "tiny" and info["num_kv_blocks"] == 2**40 and info["tensor_parallel_size"] == 0


def test_tokenize_leaves_special_tokens_to_the_server_unless_told(server):
    """Unset, the server adds a tokenizer's special tokens to text (as to a prompt generated from text) and
    not to messages; false or true is sent as such."""
    servicer, target = server
    with client_for(target) as client:
        client.tokenize("ab")
        client.tokenize("ab", add_special_tokens=False)
        client.tokenize(messages=[{"role": "user", "content": "abc"}], add_special_tokens=True)
    unset, off, on = servicer.requests
    assert not unset.HasField("add_special_tokens")
    assert off.HasField("add_special_tokens") and off.add_special_tokens is False
    assert on.HasField("add_special_tokens") and on.add_special_tokens is True and on.messages


def test_unavailable_after_first_message_is_raised_not_retried(server):
    servicer, target = server

    def dies(request, context):
        yield pb.GenerateResponse(request_id="r", index=0, text="Hel", token_ids=[1])
        context.abort(grpc.StatusCode.UNAVAILABLE, "replica died")

    servicer.script = dies
    with client_for(target) as client:
        got = []
        with pytest.raises(Unavailable, match="replica died"):
            for chunk in client.stream("hi"):
                got.append(chunk.text)
        assert got == ["Hel"]
        with pytest.raises(Unavailable):
            client.generate("hi")
    assert servicer.calls == 2


def test_retries_exhausted_raise_unavailable(server):
    servicer, target = server

    def down(request, context):
        context.abort(grpc.StatusCode.UNAVAILABLE, "no replicas")
        yield  # pragma: no cover

    servicer.script = down
    with client_for(target, max_retries=2) as client, pytest.raises(Unavailable, match="no replicas"):
        client.generate("hi")
    assert servicer.calls == 3


def test_nothing_listening_is_unavailable_after_retries():
    with socket_port() as port, client_for(f"127.0.0.1:{port}", max_retries=1) as client:
        with pytest.raises(Unavailable):
            client.health()


def test_short_timeout_on_slow_server_is_deadline_exceeded(server):
    servicer, target = server

    def slow(request, context):
        hold(context, limit_s=5)
        yield pb.GenerateResponse(request_id="r", text="late")

    servicer.script = slow
    with client_for(target) as client:
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            client.generate("hi", timeout=0.3)
        assert time.monotonic() - t0 < 3
    assert servicer.calls == 1


def test_breaking_out_of_a_stream_cancels_the_rpc(server):
    servicer, target = server

    servicer.script = endless(servicer)
    with client_for(target) as client:
        for _ in client.stream("hi"):
            break
        # Checked before the channel closes: closing it would cancel the RPC anyway.
        assert servicer.cancelled.wait(5), "the server never saw the cancellation"

        servicer.cancelled.clear()
        stream = client.stream("hi")
        next(stream)
        stream.close()
        assert servicer.cancelled.wait(5)


# ---- async client ---------------------------------------------------------------------------------


def test_async_stream_generate_n2_and_metadata(server):
    servicer, target = server

    async def main():
        async with async_client_for(target, application="myapp") as client:
            chunks = [c async for c in client.stream("hi", n=2, timeout=5)]
            completion = await client.generate("hi", n=2)
            chat = await client.chat([{"role": "user", "content": "hi"}])
            return chunks, completion, chat, await client.health(), await client.tokenize("a")

    chunks, completion, chat, health, ids = asyncio.run(main())
    for i in range(2):
        assert completion.choices[i].text == expected_text(i) == "".join(c.text for c in chunks if c.index == i)
    assert [t for c in chunks if c.index == 0 for t in c.token_ids] == completion.token_ids
    assert chunks[-1].usage == completion.usage and completion.usage["completion_tokens"] == 20
    assert chat.text == expected_text(0) and health == "SERVING" and ids == [97]
    assert all(m.get("application") == "myapp" for m in servicer.metadata)
    assert 0 < servicer.time_remaining[0] <= 5.5 and 5.5 < servicer.time_remaining[1] <= 10.5


def test_async_errors_and_retries(server):
    servicer, target = server
    mode = {}

    def script(request, context):
        if mode["kind"] == "invalid":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "top_p must be in (0, 1]")
        if mode["kind"] == "flaky" and mode.setdefault("fails", 0) < 2:
            mode["fails"] += 1
            context.abort(grpc.StatusCode.UNAVAILABLE, "warming up")
        if mode["kind"] == "dies":
            yield pb.GenerateResponse(request_id="r", text="x")
            context.abort(grpc.StatusCode.UNAVAILABLE, "replica died")
        if mode["kind"] == "slow":
            hold(context, limit_s=5)
        yield from scripted_stream(request, context)

    servicer.script = script

    async def main():
        async with async_client_for(target, max_retries=2) as client:
            mode["kind"] = "invalid"
            with pytest.raises(InvalidArgument, match=r"top_p must be in \(0, 1\]") as info:
                await client.generate("hi", top_p=2.0)
            assert info.value.details == "top_p must be in (0, 1]"
            with pytest.raises(TypeError, match="nope"):
                client.stream("hi", nope=1)
            mode["kind"] = "flaky"
            assert (await client.generate("hi")).text == expected_text(0)
            mode["kind"] = "dies"
            with pytest.raises(Unavailable, match="replica died"):
                await client.generate("hi")
            mode["kind"] = "slow"
            with pytest.raises(DeadlineExceeded):
                await client.generate("hi", timeout=0.3)

    asyncio.run(main())
    assert servicer.calls == 1 + 3 + 1 + 1


def test_async_retries_exhausted(server):
    servicer, target = server
    servicer.unary_fail = [grpc.StatusCode.UNAVAILABLE] * 10

    async def main():
        async with async_client_for(target, max_retries=3) as client:
            with pytest.raises(Unavailable):
                await client.model_info()

    asyncio.run(main())
    assert servicer.calls == 4


def test_async_aclose_and_task_cancellation_cancel_the_rpc(server):
    servicer, target = server

    servicer.script = endless(servicer)

    async def main():
        async with async_client_for(target) as client:
            stream = client.stream("hi")
            await stream.__anext__()
            await stream.aclose()
            assert await asyncio.to_thread(servicer.cancelled.wait, 5), "aclose did not cancel"

            servicer.cancelled.clear()
            first = asyncio.Event()

            async def consume():
                async for _ in client.stream("hi"):
                    first.set()

            task = asyncio.create_task(consume())
            await first.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await asyncio.to_thread(servicer.cancelled.wait, 5), "task cancellation did not cancel"

            servicer.cancelled.clear()
            async for _ in client.stream("hi"):
                break  # the abandoned generator is finalized by the event loop
            assert await asyncio.to_thread(servicer.cancelled.wait, 5), "break did not cancel"

    asyncio.run(main())


# ---- errors module --------------------------------------------------------------------------------


def test_error_classes():
    e = from_rpc_error(grpc.RpcError())  # a bare RpcError has no code()
    assert isinstance(e, PagedServeError) and e.code == grpc.StatusCode.UNKNOWN
    assert str(Unavailable("engine restarting")) == "UNAVAILABLE: engine restarting"
    assert Unavailable().code == grpc.StatusCode.UNAVAILABLE


# ---- CLI ------------------------------------------------------------------------------------------


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "pagedserve.cli", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def test_cli_generate_prints_text_and_invalid_argument_exits_1(server):
    servicer, target = server
    proc = run_cli("client", "generate", "hi", "--target", target, "--max-tokens", "8", "--temperature", "0",
                   "--adapter", "sql", "--stop", "x", "y", "--application", "myapp")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected_text(0) + "\n"
    assert servicer.requests[0].adapter == "sql"
    s = servicer.requests[0].sampling
    assert s.max_tokens == 8 and s.HasField("temperature") and list(s.stop) == ["x", "y"]
    assert not s.HasField("top_p") and not s.HasField("seed")
    assert servicer.metadata[0]["application"] == "myapp"

    def reject(request, context):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be >= 1, got 0")
        yield  # pragma: no cover

    servicer.script = reject
    proc = run_cli("client", "generate", "hi", "--target", target, "--max-tokens", "0")
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.strip() == "error: INVALID_ARGUMENT: max_tokens must be >= 1, got 0"


def cli_main(*args: str) -> int:
    from pagedserve.cli import main

    return main(list(args))


def test_cli_stream_chat_loop_and_info(server, capsys, monkeypatch):
    servicer, target = server
    assert cli_main("client", "generate", "hi", "--stream", "--target", target) == 0
    assert capsys.readouterr().out == expected_text(0) + "\n"

    assert cli_main("client", "chat", "hello", "--system", "be brief", "--target", target) == 0
    assert capsys.readouterr().out == expected_text(0) + "\n"
    assert [m.role for m in servicer.requests[-1].messages] == ["system", "user"]

    monkeypatch.setattr(sys, "stdin", io.StringIO("first\n\nsecond\n"))
    assert cli_main("client", "chat", "--stream", "--target", target) == 0
    assert capsys.readouterr().out == (expected_text(0) + "\n") * 2
    history = [(m.role, m.content) for m in servicer.requests[-1].messages]
    assert history == [("user", "first"), ("assistant", expected_text(0)), ("user", "second")]

    assert cli_main("client", "info", "--target", target) == 0
    assert json.loads(capsys.readouterr().out)["max_model_len"] == 2048

    servicer.unary_fail = [grpc.StatusCode.NOT_FOUND]
    assert cli_main("client", "info", "--target", target) == 1
    assert capsys.readouterr().err == "error: NOT_FOUND: scripted failure\n"


def test_cli_chat_prints_the_reasoning_to_stderr(server, capsys):
    servicer, target = server

    def thinks(request, context):
        yield pb.GenerateResponse(request_id="r", reasoning="Two and two.")
        yield pb.GenerateResponse(request_id="r", reasoning=" Four.", text="4",
                                  finish_reason=pb.FINISH_REASON_STOP)

    servicer.script = thinks
    for stream in ([], ["--stream"]):
        assert cli_main("client", "chat", "2 + 2?", *stream, "--target", target) == 0
        out = capsys.readouterr()
        assert out.out == "4\n" and out.err == "Two and two. Four.\n"


def test_offline_cli_does_not_import_grpc():
    code = ("import sys, pagedserve.cli as c; c._parser().parse_args(['generate', 'hi']); "
            "c._parser().parse_args(['client', 'info']); assert 'grpc' not in sys.modules, 'grpc imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
