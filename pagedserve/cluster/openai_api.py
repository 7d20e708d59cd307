"""OpenAI-compatible HTTP: `/v1/completions`, `/v1/chat/completions` (streamed as server-sent events with
`"stream": true`), `/v1/models`, `/health`, on `Ingress`, the application's ingress deployment.

No `from __future__ import annotations` here: FastAPI must see real types (Request) on the route methods.
"""

import json
import time
import uuid
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

from pagedserve.cluster.errors import ClientError, classify
from pagedserve.cluster.grpc_service import GrpcService
from pagedserve.sampling_params import SamplingParams

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
    """The application's ingress deployment: the gRPC methods (`GrpcService`) and these HTTP routes.

    The routes are methods of the decorated class itself, not of a base class: the module-level name is
    then the deployment, so the methods travel to the replicas by value, with the signature
    `serve.ingress` gives them (by reference, a replica would import them without it)."""

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
