"""Python SDK for a pagedserve server (Ray Serve's gRPC proxy, protos/pagedserve/v1/pagedserve.proto).

    with Client("127.0.0.1:9000") as client:
        print(client.generate("The capital of France is", max_tokens=8).text)
        for chunk in client.stream("Once upon a time", max_tokens=64, temperature=0.8):
            print(chunk.text, end="", flush=True)

`AsyncClient` has the same methods as coroutines / async iterators. Sampling keywords map onto the proto's
`SamplingParams`; the ones not passed stay unset so the server applies its own defaults. Every call sends
the `("application", ...)` metadata the proxy routes by, the API key (`api_key=`, else the
PAGEDSERVE_API_KEY environment variable) as `("authorization", "Bearer ...")`, and the timeout as the gRPC
deadline (one budget for the whole call, retries included). UNAVAILABLE (server or engine not up yet,
replica restarting) is retried with exponential backoff, for streams only until their first message: after
that, the text already handed out cannot be taken back. A stream's retries keep its request id, so the
server never runs the request twice. Every other error is raised at once, as the typed exceptions of
`pagedserve.client.errors`.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio

from pagedserve.chat.tool_calls import ToolCall, ToolCallDelta, join_deltas
from pagedserve.client.errors import Cancelled, from_rpc_error
from pagedserve.protos import API_KEY_ENV
from pagedserve.protos import pagedserve_pb2 as pb
from pagedserve.protos import pagedserve_pb2_grpc as pb_grpc
from pagedserve.protos.chat_messages import (
    TEMPLATE_OPTIONS,
    chat_options_to_proto,
    messages_to_proto,
    tool_choice_to_proto,
    tools_to_proto,
)
from pagedserve.protos.sampling import sampling_to_proto

__all__ = ["Client", "AsyncClient", "Completion", "Choice", "StreamChunk", "TokenLogprob", "ToolCall",
           "ToolCallDelta", "ResponseStream", "AsyncResponseStream"]


class _Unset:
    def __repr__(self) -> str:
        return "<client default>"


# `timeout=None` means "no deadline", so "not passed" needs its own marker.
_CLIENT_DEFAULT: Any = _Unset()


@dataclass(frozen=True)
class TokenLogprob:
    """One token's logprob, its text, and the top-k alternatives (token id -> logprob, best first; their
    texts in `top_tokens`, same order)."""

    token_id: int
    logprob: float
    top_logprobs: dict[int, float] = field(default_factory=dict)
    token: str = ""
    top_tokens: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class StreamChunk:
    """One streamed message: the text / token ids new since sample `index`'s previous chunk.

    `finish_reason` is set on the sample's last chunk (stop | length | abort), with `stop_reason` the stop
    string or stop token id that ended it (None for EOS); `usage` on the request's last chunk. `logprobs`
    is None unless logprobs were asked for (then a list, possibly empty); `prompt_logprobs` is on the
    request's first chunk when asked for (one per prompt token after the first). A chat with tools puts the
    calls' new parts in `tool_calls` (and only the content in `text`); finish_reason is then "tool_calls"
    where the model called tools. Where the server has a reasoning parser, a chat's thinking comes in
    `reasoning` (and only the answer in `text`). `prompt_token_ids`, the prompt as the model ran it, is on
    the request's first chunk when asked for (`return_prompt_token_ids=True`).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    logprobs: list[TokenLogprob] | None = None
    request_id: str = ""
    stop_reason: str | int | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    reasoning: str = ""
    prompt_token_ids: list[int] | None = None


@dataclass
class Choice:
    """One of the n samples of a request, its chunks joined."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    stop_reason: str | int | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    reasoning: str = ""


@dataclass
class Completion:
    """A finished request. `text`, `token_ids`, `finish_reason`, `logprobs`, `tool_calls` and `reasoning` are
    choice 0's; `prompt_token_ids` is the prompt as the model ran it, when asked for."""

    choices: list[Choice]
    usage: dict[str, int] = field(default_factory=dict)
    request_id: str = ""
    prompt_logprobs: list[TokenLogprob] | None = None
    prompt_token_ids: list[int] | None = None

    @property
    def text(self) -> str:
        return self.choices[0].text if self.choices else ""

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids if self.choices else []

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason if self.choices else None

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.choices[0].logprobs if self.choices else None

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self.choices[0].tool_calls if self.choices else []

    @property
    def reasoning(self) -> str:
        return self.choices[0].reasoning if self.choices else ""


class _Accumulator:
    """Joins a request's chunks into a `Completion`, so `generate()` is exactly the joined `stream()`."""

    def __init__(self, request_id: str) -> None:
        self._request_id = request_id
        self._choices: dict[int, Choice] = {}
        self._usage: dict[str, int] = {}
        self._prompt_logprobs: list[TokenLogprob] | None = None
        self._prompt_token_ids: list[int] | None = None

    def add(self, chunk: StreamChunk) -> None:
        choice = self._choices.get(chunk.index)
        if choice is None:
            choice = self._choices[chunk.index] = Choice(chunk.index)
        choice.text += chunk.text
        choice.reasoning += chunk.reasoning
        choice.token_ids.extend(chunk.token_ids)
        join_deltas(choice.tool_calls, chunk.tool_calls)
        if chunk.logprobs is not None:
            choice.logprobs = (choice.logprobs or []) + chunk.logprobs
        if chunk.finish_reason:
            choice.finish_reason = chunk.finish_reason
            choice.stop_reason = chunk.stop_reason
        if chunk.prompt_logprobs is not None:
            self._prompt_logprobs = chunk.prompt_logprobs
        if chunk.prompt_token_ids is not None:
            self._prompt_token_ids = chunk.prompt_token_ids
        if chunk.usage is not None:
            self._usage = chunk.usage
        if chunk.request_id:
            self._request_id = chunk.request_id

    def result(self) -> Completion:
        return Completion([self._choices[i] for i in sorted(self._choices)], self._usage, self._request_id,
                          self._prompt_logprobs, self._prompt_token_ids)


def _usage_dict(usage: pb.Usage) -> dict[str, int]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens, "cached_tokens": usage.cached_tokens}


_FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                   pb.FINISH_REASON_TOOL_CALLS: "tool_calls",
                   pb.FINISH_REASON_ABORT: "abort"}


def _logprob(lp: pb.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(lp.token_id, lp.logprob, {t.token_id: t.logprob for t in lp.top_logprobs}, lp.token,
                        [t.token for t in lp.top_logprobs])


def _to_chunk(response: pb.GenerateResponse, sampling: pb.SamplingParams) -> StreamChunk:
    with_logprobs, with_prompt_logprobs = sampling.HasField("logprobs"), sampling.HasField("prompt_logprobs")
    which = response.WhichOneof("stop_reason")
    return StreamChunk(
        index=response.index,
        text=response.text,
        token_ids=list(response.token_ids),
        finish_reason=_FINISH_REASONS.get(response.finish_reason),
        usage=_usage_dict(response.usage) if response.HasField("usage") else None,
        logprobs=[_logprob(lp) for lp in response.logprobs] if with_logprobs else None,
        request_id=response.request_id,
        stop_reason=getattr(response, which) if which else None,
        prompt_logprobs=([_logprob(lp) for lp in response.prompt_logprobs]
                         if with_prompt_logprobs and response.prompt_logprobs else None),
        tool_calls=[ToolCallDelta(t.index, t.arguments, t.id or None, t.name or None) for t in response.tool_calls],
        reasoning=response.reasoning,
        prompt_token_ids=list(response.prompt_token_ids) if response.prompt_token_ids else None,
    )


def _prompt_request(prompt: str | Sequence[int], request_id: str, sampling: pb.SamplingParams,
                    return_prompt_token_ids: bool, adapter: str | None) -> pb.GenerateRequest:
    if isinstance(prompt, bytes):
        raise TypeError("prompt must be a str or a list of token ids, not bytes")
    given = {"text": prompt} if isinstance(prompt, str) else {"token_ids": pb.TokenIds(ids=list(prompt))}
    return pb.GenerateRequest(request_id=request_id, **given, sampling=sampling,
                              return_prompt_token_ids=return_prompt_token_ids, adapter=adapter or "")


def _template_options(keywords: dict[str, Any]) -> pb.ChatTemplateOptions:
    """The chat template options among a chat call's keywords, taken out of them (the rest is sampling)."""
    return chat_options_to_proto(**{name: keywords.pop(name) for name in TEMPLATE_OPTIONS if name in keywords})


def _chat_request(messages: Sequence[dict[str, Any]], request_id: str, sampling: pb.SamplingParams,
                  tools: Sequence[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
                  parallel_tool_calls: bool | None, template: pb.ChatTemplateOptions,
                  include_reasoning: bool | None, return_prompt_token_ids: bool,
                  adapter: str | None) -> pb.ChatRequest:
    return pb.ChatRequest(request_id=request_id, messages=messages_to_proto(messages), sampling=sampling,
                          tools=tools_to_proto(tools), tool_choice=tool_choice_to_proto(tool_choice),
                          parallel_tool_calls=parallel_tool_calls, template=template,
                          include_reasoning=include_reasoning, return_prompt_token_ids=return_prompt_token_ids,
                          adapter=adapter or "")


def _tokenize_request(text: str | None, messages: Sequence[dict[str, Any]] | None, add_special_tokens: bool | None,
                      tools: Sequence[dict[str, Any]] | None, template: pb.ChatTemplateOptions) -> pb.TokenizeRequest:
    if (text is None) == (messages is None):
        raise ValueError("tokenize needs exactly one of text= or messages=")
    # The server refuses tools and template options with text, naming them.
    prompt = {"text": text} if text is not None else {"messages": messages_to_proto(messages or [])}
    request = pb.TokenizeRequest(**prompt, tools=tools_to_proto(tools), template=template)
    if add_special_tokens is not None:  # unset: the server's default, true for text and false for messages
        request.add_special_tokens = add_special_tokens
    return request


def _model_info_dict(response: pb.ModelInfoResponse) -> dict[str, Any]:
    # Not MessageToDict: it renders int64 fields as strings and drops zero-valued ones.
    return {f.name: list(getattr(response, f.name)) if f.is_repeated else getattr(response, f.name)
            for f in response.DESCRIPTOR.fields}


class _Deadline:
    """One time budget for a whole call, retries and backoff sleeps included."""

    def __init__(self, timeout: float | None) -> None:
        self._end = None if timeout is None else time.monotonic() + timeout

    def remaining(self) -> float | None:
        return None if self._end is None else max(0.0, self._end - time.monotonic())


class _CallRef:
    """The stream's current gRPC call, shared by the stream object and its generator.

    Kept separate so the generator holds no reference to the stream object: a cycle between them would
    keep an abandoned stream (a `break` out of the loop) alive until the cycle collector runs, and its RPC
    running on the server until then.
    """

    call: Any = None
    cancelled = False

    def cancel(self) -> None:
        self.cancelled = True
        if self.call is not None:
            self.call.cancel()


class _Base:
    def __init__(self, target: str, application: str, timeout: float | None, max_retries: int,
                 backoff_s: float, api_key: str | None) -> None:
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        if backoff_s < 0:
            raise ValueError(f"backoff_s must be >= 0, got {backoff_s}")
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be > 0 or None, got {timeout}")
        self.target = target
        self.application = application
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        self._metadata = (("application", application),) + ((("authorization", f"Bearer {api_key}"),)
                                                             if api_key else ())

    def _deadline(self, timeout: Any) -> _Deadline:
        return _Deadline(self.timeout if timeout is _CLIENT_DEFAULT else timeout)

    def _retry_delay(self, error: grpc.RpcError, attempt: int, deadline: _Deadline) -> float | None:
        """Seconds to wait before retrying after `error` on attempt `attempt` (0-based); None: raise it."""
        code = error.code() if callable(getattr(error, "code", None)) else None
        if code != grpc.StatusCode.UNAVAILABLE or attempt >= self.max_retries:
            return None
        delay = self.backoff_s * 2 ** attempt
        remaining = deadline.remaining()
        if remaining is not None and delay >= remaining:
            # The retry could not finish in time: the UNAVAILABLE says more than a DEADLINE_EXCEEDED would.
            return None
        return delay

    @staticmethod
    def _split(sampling: dict[str, Any]) -> tuple[pb.SamplingParams, str, Any]:
        sampling = dict(sampling)
        # Made here when not given, so that every retry of a stream carries the same id.
        request_id = sampling.pop("request_id", None) or uuid.uuid4().hex
        timeout = sampling.pop("timeout", _CLIENT_DEFAULT)
        return sampling_to_proto(sampling), request_id, timeout

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.target!r}, application={self.application!r})"


class ResponseStream(Iterator[StreamChunk]):
    """The chunks of one streamed request. Closing it (`close()`, leaving its `with` block, or dropping
    it, e.g. by `break`ing out of the `for` loop) cancels the RPC, so the server aborts the request."""

    def __init__(self, client: Client, method: Callable[..., Any], request: Any, timeout: Any,
                 sampling: pb.SamplingParams) -> None:
        self._ref = _CallRef()
        self.request_id: str = request.request_id
        self._gen = _sync_chunks(client, self._ref, method, request, client._deadline(timeout), sampling)

    def __iter__(self) -> ResponseStream:
        return self

    def __next__(self) -> StreamChunk:
        chunk = next(self._gen)
        if chunk.request_id:
            self.request_id = chunk.request_id
        return chunk

    def cancel(self) -> None:
        """Cancel the RPC; safe from any thread (the iterating one then gets `Cancelled`)."""
        self._ref.cancel()

    def close(self) -> None:
        try:
            self._gen.close()
        except ValueError:  # being iterated in another thread right now
            self._ref.cancel()

    def __enter__(self) -> ResponseStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _sync_chunks(client: _Base, ref: _CallRef, method: Callable[..., Any], request: Any, deadline: _Deadline,
                 sampling: pb.SamplingParams) -> Iterator[StreamChunk]:
    attempt = 0
    while True:
        if ref.cancelled:
            raise Cancelled("cancelled by the client")
        call = ref.call = method(request, timeout=deadline.remaining(), metadata=client._metadata)
        received = False
        try:
            for response in call:
                if not response.request_id:  # the empty message that carries an error status
                    continue
                received = True
                yield _to_chunk(response, sampling)
            return
        except grpc.RpcError as e:
            delay = None if received else client._retry_delay(e, attempt, deadline)
            if delay is None:
                raise from_rpc_error(e) from None
        finally:
            call.cancel()  # no-op once the call has finished; aborts it on close / error / GeneratorExit
        time.sleep(delay)
        attempt += 1


class Client(_Base):
    """Synchronous client (one `grpc.insecure_channel`, safe to share between threads)."""

    def __init__(self, target: str = "127.0.0.1:9000", application: str = "pagedserve",
                 timeout: float | None = 120.0, max_retries: int = 4, backoff_s: float = 0.25,
                 api_key: str | None = None) -> None:
        super().__init__(target, application, timeout, max_retries, backoff_s, api_key)
        self._channel = grpc.insecure_channel(target)
        self._stub = pb_grpc.PagedServeStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _unary(self, method: Callable[..., Any], request: Any, timeout: Any) -> Any:
        deadline = self._deadline(timeout)
        attempt = 0
        while True:
            try:
                return method(request, timeout=deadline.remaining(), metadata=self._metadata)
            except grpc.RpcError as e:
                delay = self._retry_delay(e, attempt, deadline)
                if delay is None:
                    raise from_rpc_error(e) from None
            time.sleep(delay)
            attempt += 1

    def stream(self, prompt: str | Sequence[int], *, return_prompt_token_ids: bool = False,
               adapter: str | None = None, **sampling: Any) -> ResponseStream:
        """Stream a completion of `prompt` (text or token ids) chunk by chunk; `return_prompt_token_ids`: the
        prompt as the model ran it on the first chunk; `adapter`: the served LoRA adapter it runs with."""
        params, request_id, timeout = self._split(sampling)
        request = _prompt_request(prompt, request_id, params, return_prompt_token_ids, adapter)
        return ResponseStream(self, self._stub.Generate, request, timeout, params)

    def generate(self, prompt: str | Sequence[int], **sampling: Any) -> Completion:
        """Complete `prompt` (text or token ids); the whole `stream()`, joined."""
        return self._collect(self.stream(prompt, **sampling))

    def stream_chat(self, messages: Sequence[dict[str, Any]], *, tools: Sequence[dict[str, Any]] | None = None,
                    tool_choice: str | dict[str, Any] | None = None, parallel_tool_calls: bool | None = None,
                    include_reasoning: bool | None = None, return_prompt_token_ids: bool = False,
                    adapter: str | None = None, **sampling: Any) -> ResponseStream:
        """Stream the assistant's reply to `messages` ([{"role": ..., "content": ...}, ...]). `tools`,
        `tool_choice` and `parallel_tool_calls` and the messages take OpenAI's shapes; the chat template
        options (`add_generation_prompt`, default true, `continue_final_message`, `chat_template_kwargs`,
        `documents`, `add_special_tokens`) vLLM's; `include_reasoning=False` leaves the reasoning out (where
        the server parses it); `return_prompt_token_ids`: the template's prompt on the first chunk; `adapter`: the
        served LoRA adapter it runs with; the other keywords are sampling parameters."""
        template = _template_options(sampling)
        params, request_id, timeout = self._split(sampling)
        request = _chat_request(messages, request_id, params, tools, tool_choice, parallel_tool_calls, template,
                                include_reasoning, return_prompt_token_ids, adapter)
        return ResponseStream(self, self._stub.Chat, request, timeout, params)

    def chat(self, messages: Sequence[dict[str, Any]], **kwargs: Any) -> Completion:
        """The assistant's reply to `messages`; the whole `stream_chat()`, joined."""
        return self._collect(self.stream_chat(messages, **kwargs))

    @staticmethod
    def _collect(stream: ResponseStream) -> Completion:
        acc = _Accumulator(stream.request_id)
        with stream:
            for chunk in stream:
                acc.add(chunk)
        return acc.result()

    def tokenize(self, text: str | None = None, messages: Sequence[dict[str, Any]] | None = None, *,
                 add_special_tokens: bool | None = None, tools: Sequence[dict[str, Any]] | None = None,
                 timeout: float | None = _CLIENT_DEFAULT, **template_options: Any) -> list[int]:
        """Token ids of `text`, or of the chat-template prompt for `messages` (offering `tools`, rendered
        as `stream_chat`'s template options say). `add_special_tokens` unset: the tokenizer's special tokens
        (such as a BOS) are added to text, as to a prompt generated from text, and not to messages."""
        template = chat_options_to_proto(**template_options)
        request = _tokenize_request(text, messages, add_special_tokens, tools, template)
        return list(self._unary(self._stub.Tokenize, request, timeout).token_ids)

    def model_info(self, *, timeout: float | None = _CLIENT_DEFAULT) -> dict[str, Any]:
        return _model_info_dict(self._unary(self._stub.ModelInfo, pb.ModelInfoRequest(), timeout))

    def health(self, *, timeout: float | None = _CLIENT_DEFAULT) -> str:
        """The server's status string ("SERVING" when up)."""
        return self._unary(self._stub.Health, pb.HealthRequest(), timeout).status

    def abort(self, request_id: str, *, timeout: float | None = _CLIENT_DEFAULT) -> bool:
        """Abort a running request (its stream ends with finish_reason "abort"); False if none runs by that id."""
        return self._unary(self._stub.Abort, pb.AbortRequest(request_id=request_id), timeout).aborted


class AsyncResponseStream(AsyncIterator[StreamChunk]):
    """The chunks of one streamed request, for `async for`. `aclose()`, leaving its `async with` block,
    or cancelling the task iterating it cancels the RPC (as does dropping it, once the event loop
    finalizes the abandoned generator)."""

    def __init__(self, client: AsyncClient, method: Callable[..., Any], request: Any, timeout: Any,
                 sampling: pb.SamplingParams) -> None:
        self._ref = _CallRef()
        self.request_id: str = request.request_id
        self._gen = _async_chunks(client, self._ref, method, request, client._deadline(timeout), sampling)

    def __aiter__(self) -> AsyncResponseStream:
        return self

    async def __anext__(self) -> StreamChunk:
        chunk = await self._gen.__anext__()
        if chunk.request_id:
            self.request_id = chunk.request_id
        return chunk

    def cancel(self) -> None:
        """Cancel the RPC without awaiting; the task iterating the stream then gets `Cancelled`."""
        self._ref.cancel()

    async def aclose(self) -> None:
        try:
            await self._gen.aclose()
        except RuntimeError:  # being iterated by another task right now
            self._ref.cancel()

    async def __aenter__(self) -> AsyncResponseStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def _async_chunks(client: _Base, ref: _CallRef, method: Callable[..., Any], request: Any,
                        deadline: _Deadline, sampling: pb.SamplingParams) -> AsyncIterator[StreamChunk]:
    attempt = 0
    while True:
        if ref.cancelled:
            raise Cancelled("cancelled by the client")
        call = ref.call = method(request, timeout=deadline.remaining(), metadata=client._metadata)
        received = False
        try:
            async for response in call:
                if not response.request_id:  # the empty message that carries an error status
                    continue
                received = True
                yield _to_chunk(response, sampling)
            return
        except grpc.RpcError as e:
            delay = None if received else client._retry_delay(e, attempt, deadline)
            if delay is None:
                raise from_rpc_error(e) from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if ref.cancelled and task is not None and not task.cancelling():
                # grpc.aio reports a locally cancelled call as CancelledError; when it was our cancel()
                # rather than this task's cancellation, surface it like the sync client does.
                raise Cancelled("cancelled by the client") from None
            raise
        finally:
            call.cancel()
        await asyncio.sleep(delay)
        attempt += 1


class AsyncClient(_Base):
    """asyncio client on `grpc.aio`. The channel is opened on first use, in the running event loop, so
    construct it anywhere but use it from one event loop only."""

    def __init__(self, target: str = "127.0.0.1:9000", application: str = "pagedserve",
                 timeout: float | None = 120.0, max_retries: int = 4, backoff_s: float = 0.25,
                 api_key: str | None = None) -> None:
        super().__init__(target, application, timeout, max_retries, backoff_s, api_key)
        self._channel: grpc.aio.Channel | None = None
        self._stub_: pb_grpc.PagedServeStub | None = None

    @property
    def _stub(self) -> pb_grpc.PagedServeStub:
        if self._stub_ is None:
            self._channel = grpc.aio.insecure_channel(self.target)
            self._stub_ = pb_grpc.PagedServeStub(self._channel)
        return self._stub_

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub_ = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _unary(self, method: Callable[..., Any], request: Any, timeout: Any) -> Any:
        deadline = self._deadline(timeout)
        attempt = 0
        while True:
            try:
                return await method(request, timeout=deadline.remaining(), metadata=self._metadata)
            except grpc.RpcError as e:
                delay = self._retry_delay(e, attempt, deadline)
                if delay is None:
                    raise from_rpc_error(e) from None
            await asyncio.sleep(delay)
            attempt += 1

    def stream(self, prompt: str | Sequence[int], *, return_prompt_token_ids: bool = False,
               adapter: str | None = None, **sampling: Any) -> AsyncResponseStream:
        """Stream a completion of `prompt` (text or token ids): `async for chunk in client.stream(...)`."""
        params, request_id, timeout = self._split(sampling)
        request = _prompt_request(prompt, request_id, params, return_prompt_token_ids, adapter)
        return AsyncResponseStream(self, self._stub.Generate, request, timeout, params)

    async def generate(self, prompt: str | Sequence[int], **sampling: Any) -> Completion:
        return await self._collect(self.stream(prompt, **sampling))

    def stream_chat(self, messages: Sequence[dict[str, Any]], *, tools: Sequence[dict[str, Any]] | None = None,
                    tool_choice: str | dict[str, Any] | None = None, parallel_tool_calls: bool | None = None,
                    include_reasoning: bool | None = None, return_prompt_token_ids: bool = False,
                    adapter: str | None = None, **sampling: Any) -> AsyncResponseStream:
        template = _template_options(sampling)
        params, request_id, timeout = self._split(sampling)
        request = _chat_request(messages, request_id, params, tools, tool_choice, parallel_tool_calls, template,
                                include_reasoning, return_prompt_token_ids, adapter)
        return AsyncResponseStream(self, self._stub.Chat, request, timeout, params)

    async def chat(self, messages: Sequence[dict[str, Any]], **kwargs: Any) -> Completion:
        return await self._collect(self.stream_chat(messages, **kwargs))

    @staticmethod
    async def _collect(stream: AsyncResponseStream) -> Completion:
        acc = _Accumulator(stream.request_id)
        async with stream:
            async for chunk in stream:
                acc.add(chunk)
        return acc.result()

    async def tokenize(self, text: str | None = None, messages: Sequence[dict[str, Any]] | None = None, *,
                       add_special_tokens: bool | None = None, tools: Sequence[dict[str, Any]] | None = None,
                       timeout: float | None = _CLIENT_DEFAULT, **template_options: Any) -> list[int]:
        template = chat_options_to_proto(**template_options)
        request = _tokenize_request(text, messages, add_special_tokens, tools, template)
        return list((await self._unary(self._stub.Tokenize, request, timeout)).token_ids)

    async def model_info(self, *, timeout: float | None = _CLIENT_DEFAULT) -> dict[str, Any]:
        return _model_info_dict(await self._unary(self._stub.ModelInfo, pb.ModelInfoRequest(), timeout))

    async def health(self, *, timeout: float | None = _CLIENT_DEFAULT) -> str:
        return (await self._unary(self._stub.Health, pb.HealthRequest(), timeout)).status

    async def abort(self, request_id: str, *, timeout: float | None = _CLIENT_DEFAULT) -> bool:
        return (await self._unary(self._stub.Abort, pb.AbortRequest(request_id=request_id), timeout)).aborted
