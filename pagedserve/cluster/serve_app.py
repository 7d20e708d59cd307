"""The Ray Serve application: `EngineServer` (one deployment replica per model replica: scheduler, block
manager and step loop, with its own worker actors) and `Ingress` (the gRPC service of
protos/pagedserve/v1 and OpenAI-compatible HTTP), separate deployments as in Ray Serve LLM.

    serve run deploy/config.yaml      # import_path: pagedserve.cluster.serve_app:build_app

No `from __future__ import annotations` here: FastAPI must see real types (Request) on the ingress methods.
"""


import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from pagedserve.cluster.engine_actor import EngineCore, QueueFull, RequestFailed
from pagedserve.config import EngineConfig
from pagedserve.outputs import RequestOutput
from pagedserve.protos import pagedserve_pb2 as pb
from pagedserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)

CHAT_ROLES = ("system", "user", "assistant", "tool")


# ---- what a stream carries: per-sample deltas ------------------------------------------------------


@dataclass
class Delta:
    request_id: str
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, int] | None = None


async def stream_deltas(outputs: AsyncIterator[RequestOutput], params: SamplingParams) -> AsyncIterator[Delta]:
    """Per-sample text and token deltas of a request's cumulative outputs. Text that could still turn out
    to be the start of a stop string is held back until it cannot, so streamed text is never taken back."""
    hold = max((len(s) for s in params.stop), default=1) - 1
    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    done: set[int] = set()
    async for out in outputs:
        batch = []
        for c in out.outputs:
            if c.index in done:
                continue
            finished = c.finish_reason is not None
            t0, k0 = sent_text.get(c.index, 0), sent_tokens.get(c.index, 0)
            t1 = len(c.text) if finished else max(t0, len(c.text) - hold)
            if t1 == t0 and len(c.token_ids) == k0 and not finished:
                continue
            batch.append(Delta(out.request_id, c.index, c.text[t0:t1], c.token_ids[k0:],
                               (c.logprobs or [])[k0:], c.finish_reason if finished else None))
            sent_text[c.index], sent_tokens[c.index] = t1, len(c.token_ids)
            if finished:
                done.add(c.index)
        if out.finished and batch:
            completion = sum(len(c.token_ids) for c in out.outputs)
            prompt_tokens = len(out.prompt_token_ids)
            batch[-1].usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                               "total_tokens": prompt_tokens + completion}
        for d in batch:
            yield d


# ---- the engine: one per model replica ------------------------------------------------------------


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096, health_check_period_s=10)
class EngineServer:
    def __init__(self, engine_args: dict[str, Any], max_waiting_requests: int | None = None) -> None:
        from pagedserve.cluster.metrics import EngineMetrics

        config = EngineConfig(**{**engine_args, "executor": "ray"})
        self.core = EngineCore(config, max_waiting_requests)
        self.core.metrics = EngineMetrics(self.core.engine.source.name)

    async def generate_deltas(self, prompt: str | list[int], params: SamplingParams,
                              request_id: str | None = None) -> AsyncIterator[Delta]:
        async for d in stream_deltas(self.core.generate(prompt, params, request_id), params):
            yield d

    async def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """The chat template's prompt as token ids; ValueError for malformed messages."""
        tokenizer = self.core.engine.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("messages: this model has no chat template")
        if not messages:
            raise ValueError("messages is empty")
        for i, m in enumerate(messages):
            if m.get("role") not in CHAT_ROLES:
                raise ValueError(f"messages[{i}].role={m.get('role')!r} must be one of {CHAT_ROLES}")
            if not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}].content must be a string")
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    async def tokenize(self, text: str | None, messages: list[dict[str, str]] | None,
                       add_special_tokens: bool) -> tuple[list[int], list[str]]:
        tokenizer = self.core.engine.tokenizer
        if tokenizer is None:
            raise ValueError("this model has no tokenizer")
        if messages:
            ids = await self.chat_prompt(messages)
        elif text:
            ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
        else:
            raise ValueError("text is empty (give text or messages)")
        return ids, tokenizer.convert_ids_to_tokens(ids)

    async def model_info(self) -> dict[str, Any]:
        return self.core.model_info()

    async def stats(self) -> dict[str, Any]:
        return self.core.stats()

    def __del__(self) -> None:
        core = getattr(self, "core", None)
        if core is not None:
            core.shutdown()  # the worker actors and their placement group go with the replica


# ---- errors and parameters ----------------------------------------------------------------------------


class ClientError(Exception):
    """A request the server will not run, with the gRPC and HTTP status that says why."""

    def __init__(self, code: grpc.StatusCode, http_status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.http_status, self.message, self.param = code, http_status, message, param

    def __reduce__(self):  # Ray pickles exceptions between processes
        return ClientError, (self.code, self.http_status, self.message, self.param)


def classify(e: BaseException) -> ClientError:
    """Map an exception (possibly wrapped by Ray) to a status; nothing escapes as UNKNOWN."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    if isinstance(e, ClientError):
        return e
    root = e
    while getattr(root, "cause", None) is not None and root.cause is not root:
        root = root.cause
    message = str(root).strip() or type(root).__name__
    if isinstance(root, ValueError):
        return ClientError(grpc.StatusCode.INVALID_ARGUMENT, 400, message, message.split("=", 1)[0].split()[0])
    if isinstance(root, QueueFull | BackPressureError):
        return ClientError(grpc.StatusCode.RESOURCE_EXHAUSTED, 429, message)
    if isinstance(root, RequestFailed | RayActorError | DeploymentUnavailableError):
        return ClientError(grpc.StatusCode.UNAVAILABLE, 503, f"engine unavailable: {message}")
    log.exception("unexpected error", exc_info=e)
    return ClientError(grpc.StatusCode.INTERNAL, 500, f"internal error: {type(root).__name__}: {message}")


SAMPLING_FIELDS = ("n", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "seed", "max_tokens", "ignore_eos", "logprobs", "skip_special_tokens")


def params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    kwargs: dict[str, Any] = {name: getattr(msg, name) for name in SAMPLING_FIELDS if msg.HasField(name)}
    if msg.stop:
        kwargs["stop"] = list(msg.stop)
    if msg.stop_token_ids:
        kwargs["stop_token_ids"] = list(msg.stop_token_ids)
    return SamplingParams(**kwargs)  # ValueError names the field


class GrpcService:
    """The PagedServe gRPC methods over one `EngineServer` handle (Serve routes across its replicas).
    Serve's gRPC proxy calls them by name on the application's ingress deployment, `Ingress`."""

    def __init__(self, engine: DeploymentHandle, num_replicas: int = 1) -> None:
        self.engine = engine
        self.num_replicas = num_replicas
        self._info: dict[str, Any] | None = None

    async def model_info_dict(self) -> dict[str, Any]:
        if self._info is None:
            self._info = await self.engine.model_info.remote()
        return self._info

    async def deltas(self, prompt: str | list[int], params: SamplingParams,
                     request_id: str | None) -> AsyncIterator[Delta]:
        """The request's deltas (see `stream_deltas`) from whichever engine replica Serve picks."""
        # Deltas are cut on the engine side: only what is new crosses between processes each step.
        stream = self.engine.options(stream=True).generate_deltas.remote(prompt, params,
                                                                         request_id or uuid.uuid4().hex)
        try:
            async for d in stream:
                yield d
        finally:
            stream.cancel()  # no-op once finished; otherwise the client left: abort and free the blocks

    # ---- gRPC (Serve's proxy calls these by name) -------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, grpc_context=None) -> AsyncIterator[pb.GenerateResponse]:
        try:
            which = request.WhichOneof("prompt")
            if which is None:
                raise ValueError("prompt is empty (set text or token_ids)")
            prompt = request.text if which == "text" else list(request.token_ids.ids)
            params = params_from_proto(request.sampling)
            async for d in self.deltas(prompt, params, request.request_id or None):
                yield _delta_to_proto(d)
        except Exception as e:
            _abort_grpc(grpc_context, e)

    async def Chat(self, request: pb.ChatRequest, grpc_context=None) -> AsyncIterator[pb.GenerateResponse]:
        try:
            messages = [{"role": m.role, "content": m.content} for m in request.messages]
            params = params_from_proto(request.sampling)
            prompt = await self.engine.chat_prompt.remote(messages)
            async for d in self.deltas(prompt, params, request.request_id or None):
                yield _delta_to_proto(d)
        except Exception as e:
            _abort_grpc(grpc_context, e)

    async def Tokenize(self, request: pb.TokenizeRequest, grpc_context=None) -> pb.TokenizeResponse:
        try:
            messages = [{"role": m.role, "content": m.content} for m in request.messages]
            ids, tokens = await self.engine.tokenize.remote(request.text, messages, request.add_special_tokens)
            return pb.TokenizeResponse(token_ids=ids, tokens=tokens)
        except Exception as e:
            _abort_grpc(grpc_context, e)

    async def ModelInfo(self, request: pb.ModelInfoRequest, grpc_context=None) -> pb.ModelInfoResponse:
        try:
            info = await self.model_info_dict()
            return pb.ModelInfoResponse(
                model=info["model"], max_model_len=info["max_model_len"], block_size=info["block_size"],
                tensor_parallel_size=info["tensor_parallel_size"], num_kv_blocks=info["num_kv_blocks"],
                kv_capacity_tokens=info["num_kv_blocks"] * info["block_size"], vocab_size=info["vocab_size"],
                num_replicas=self.num_replicas)
        except Exception as e:
            _abort_grpc(grpc_context, e)

    async def Health(self, request: pb.HealthRequest, grpc_context=None) -> pb.HealthResponse:
        try:
            await self.engine.stats.remote()
            return pb.HealthResponse(status="SERVING")
        except Exception as e:
            _abort_grpc(grpc_context, e)


def _delta_to_proto(d: Delta) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(request_id=d.request_id, index=d.index, text=d.text, token_ids=d.token_ids,
                              finish_reason=d.finish_reason or "")
    for lp in d.logprobs:
        msg.logprobs.append(pb.TokenLogprob(token_id=lp["token_id"], logprob=lp["logprob"], top_logprobs=[
            pb.TopLogprob(token_id=t, logprob=v) for t, v in lp["top_logprobs"]]))
    if d.usage:
        msg.usage.CopyFrom(pb.Usage(**d.usage))
    return msg


def _abort_grpc(grpc_context, e: Exception) -> None:
    """Set the status on the call, then raise: Serve's proxy returns the code we set with our message."""
    import asyncio

    if isinstance(e, asyncio.CancelledError):
        raise e
    err = classify(e)
    if grpc_context is not None:
        grpc_context.set_code(err.code)
        grpc_context.set_details(err.message)
    raise err


# ---- OpenAI-compatible HTTP -------------------------------------------------------------------------

api = FastAPI(title="pagedserve", description="OpenAI-compatible completions and chat over pagedserve")

_EXTRA_FIELDS = ("top_k", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids", "skip_special_tokens")


def _openai_params(body: dict[str, Any], chat: bool) -> tuple[SamplingParams, bool]:
    def number(name: str, default: Any = None) -> Any:
        value = body.get(name, default)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ValueError(f"{name}={value!r} must be a number")
        return value

    kwargs: dict[str, Any] = {}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens")) if chat else body.get("max_tokens", 16)
    if max_tokens is not None:
        kwargs["max_tokens"] = max_tokens
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        if number(name) is not None:
            kwargs[name] = float(body[name])
    for name in ("n", "seed"):
        if number(name) is not None:
            kwargs[name] = body[name]
    for name in _EXTRA_FIELDS:
        if body.get(name) is not None:
            kwargs[name] = body[name]
    stop = body.get("stop")
    if stop is not None:
        kwargs["stop"] = [stop] if isinstance(stop, str) else list(stop)
    if chat:
        if body.get("logprobs"):
            kwargs["logprobs"] = int(body.get("top_logprobs") or 0)
    elif body.get("logprobs") is not None:
        kwargs["logprobs"] = body["logprobs"]
    return SamplingParams(**kwargs), bool(body.get("stream", False))


def _error_response(e: Exception) -> JSONResponse:
    err = classify(e)
    kind = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error",
            503: "service_unavailable"}.get(err.http_status, "server_error")
    return JSONResponse({"error": {"message": err.message, "type": kind, "param": err.param, "code": None}},
                        status_code=err.http_status)


# Defined before Ingress: @serve.ingress pickles the routes (and what they reference) right away.
def _content_text(content: Any) -> Any:
    """OpenAI content may be a list of parts; the text parts are joined."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content


def _completion_logprobs(entries: list[dict]) -> dict[str, Any]:
    return {"token_logprobs": [e["logprob"] for e in entries], "tokens": [str(e["token_id"]) for e in entries],
            "top_logprobs": [{str(t): v for t, v in e["top_logprobs"]} for e in entries], "text_offset": []}


def _chat_logprobs(entries: list[dict]) -> list[dict[str, Any]]:
    return [{"token": str(e["token_id"]), "logprob": e["logprob"], "bytes": None,
             "top_logprobs": [{"token": str(t), "logprob": v, "bytes": None} for t, v in e["top_logprobs"]]}
            for e in entries]



@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)
@serve.ingress(api)
class Ingress(GrpcService):
    """The application's ingress: the gRPC service, and OpenAI-compatible HTTP routes."""

    async def _check_model(self, body: dict[str, Any]) -> str:
        name = (await self.model_info_dict())["model"]
        asked = body.get("model")
        if asked not in (None, "", name):
            raise ClientError(grpc.StatusCode.NOT_FOUND, 404, f"model={asked!r} is not served here (serving {name!r})",
                              "model")
        return name

    @api.get("/health")
    async def health(self) -> JSONResponse:
        try:
            await self.engine.stats.remote()
        except Exception as e:
            return _error_response(e)
        return JSONResponse({"status": "ok"})

    @api.get("/v1/models")
    async def models(self) -> JSONResponse:
        info = await self.model_info_dict()
        return JSONResponse({"object": "list", "data": [{
            "id": info["model"], "object": "model", "created": 0, "owned_by": "pagedserve",
            "max_model_len": info["max_model_len"]}]})

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        try:
            body = await request.json()
            model = await self._check_model(body)
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
                prompt = prompt[0]
            if not isinstance(prompt, str | list):
                raise ValueError("prompt must be a string or a list of token ids")
            params, stream = _openai_params(body, chat=False)
            return await self._respond(prompt, params, stream, model, chat=False)
        except Exception as e:
            return _error_response(e)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        try:
            body = await request.json()
            model = await self._check_model(body)
            messages = body.get("messages")
            if not isinstance(messages, list):
                raise ValueError("messages must be a list of {role, content}")
            messages = [{"role": m.get("role"), "content": _content_text(m.get("content"))} for m in messages]
            params, stream = _openai_params(body, chat=True)
            prompt = await self.engine.chat_prompt.remote(messages)
            return await self._respond(prompt, params, stream, model, chat=True)
        except Exception as e:
            return _error_response(e)

    async def _respond(self, prompt, params: SamplingParams, stream: bool, model: str, chat: bool):
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        deltas = self.deltas(prompt, params, rid)
        first = await anext(deltas, None)  # errors in validation surface here, as a JSON error
        if stream:
            return StreamingResponse(self._sse(first, deltas, rid, created, model, chat),
                                     media_type="text/event-stream")
        choices: dict[int, dict[str, Any]] = {}
        usage = None
        d = first
        while d is not None:
            c = choices.setdefault(d.index, {"text": "", "token_ids": [], "finish_reason": None, "logprobs": []})
            c["text"] += d.text
            c["token_ids"] += d.token_ids
            c["logprobs"] += d.logprobs
            c["finish_reason"] = d.finish_reason or c["finish_reason"]
            usage = d.usage or usage
            d = await anext(deltas, None)
        out = []
        for i in sorted(choices):
            c = choices[i]
            choice: dict[str, Any] = {"index": i, "finish_reason": c["finish_reason"], "token_ids": c["token_ids"]}
            if chat:
                choice["message"] = {"role": "assistant", "content": c["text"]}
                choice["logprobs"] = {"content": _chat_logprobs(c["logprobs"])} if params.logprobs is not None else None
            else:
                choice["text"] = c["text"]
                choice["logprobs"] = _completion_logprobs(c["logprobs"]) if params.logprobs is not None else None
            out.append(choice)
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "created": created, "model": model, "choices": out, "usage": usage})

    async def _sse(self, first, deltas, rid: str, created: int, model: str, chat: bool):
        obj = "chat.completion.chunk" if chat else "text_completion"
        started: set[int] = set()
        d = first
        try:
            while d is not None:
                if chat:
                    delta: dict[str, Any] = {"content": d.text}
                    if d.index not in started:
                        delta["role"] = "assistant"
                        started.add(d.index)
                    choice = {"index": d.index, "delta": delta, "finish_reason": d.finish_reason,
                              "token_ids": d.token_ids}
                else:
                    choice = {"index": d.index, "text": d.text, "finish_reason": d.finish_reason,
                              "token_ids": d.token_ids}
                chunk = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
                if d.usage:
                    chunk["usage"] = d.usage
                yield f"data: {json.dumps(chunk)}\n\n"
                d = await anext(deltas, None)
        except Exception as e:  # mid-stream: the status line is gone, report in-band as OpenAI does
            err = classify(e)
            yield f"data: {json.dumps({'error': {'message': err.message, 'code': err.http_status}})}\n\n"
        yield "data: [DONE]\n\n"


# ---- the application ----------------------------------------------------------------------------------


def build_app(args: dict[str, Any] | None = None):
    """Serve application builder (deploy/config.yaml `args`): engine settings of EngineConfig plus
    `num_replicas` (model replicas) and `max_waiting_requests` (queue bound before RESOURCE_EXHAUSTED)."""
    args = dict(args or {})
    num_replicas = int(args.pop("num_replicas", 1))
    max_waiting = args.pop("max_waiting_requests", None)
    args.pop("executor", None)
    EngineConfig(**args)  # fail at deploy time, naming the bad setting
    engine = EngineServer.options(num_replicas=num_replicas).bind(args, max_waiting)
    return Ingress.bind(engine, num_replicas)
