"""OpenAI-compatible HTTP on `Ingress`, the application's ingress deployment: `/v1/completions`,
`/v1/chat/completions`, `/v1/responses` (each streamed as server-sent events with `"stream": true`),
`/v1/models`, `/v1/models/{id}`, `/tokenize`, `/detokenize`, `/health`, and vLLM's `/v1/load_lora_adapter` and
`/v1/unload_lora_adapter`. A request's `model` names the base model or a LoRA adapter served beside it. Bodies are
parsed by `openai_protocol`'s typed models; with API keys configured every route but `/health` needs
`Authorization: Bearer <key>`.

No `from __future__ import annotations` here: FastAPI must see real types (Request) on the route methods.
"""

import asyncio
import functools
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import anyio
import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from grpc_health.v1 import health_pb2
from ray import serve
from ray.serve.handle import DeploymentHandle

from pagedserve.chat.template import ChatPlan
from pagedserve.lora.lora_request import LoRARequest
from pagedserve.protos import pagedserve_pb2 as pb
from pagedserve.sampling_params import SamplingParams
from pagedserve.serving.auth import ApiKeys
from pagedserve.serving.deltas import prompt_only
from pagedserve.serving.error_status import ClientError, classify
from pagedserve.serving.grpc_service import GrpcService
from pagedserve.serving.model_client import ModelClient
from pagedserve.serving.openai_api.completions import ResponseFormatter, error_response
from pagedserve.serving.openai_api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    as_sent,
    parse,
)
from pagedserve.serving.openai_api.responses import ResponseBuilder, ResponsesRequest

BodyT = TypeVar("BodyT", CompletionRequest, ChatCompletionRequest, ResponsesRequest, TokenizeRequest,
                DetokenizeRequest)

api = FastAPI(title="pagedserve", description="OpenAI-compatible completions, chat and responses over pagedserve")


def _answers_errors(route):
    """The route's exceptions as OpenAI error bodies, with the status and field `error_response` gives them."""
    @functools.wraps(route)  # FastAPI reads the route's parameters through the wrapper
    async def answered(*args, **kwargs):
        try:
            return await route(*args, **kwargs)
        except Exception as e:
            return error_response(e)
    return answered


class _EventStream(StreamingResponse):
    """Server-sent events from `body`, which reads `deltas`: both are closed as soon as the stream ends, a
    client that left included. Starlette leaves a body it stopped reading to the garbage collector, and the
    requests behind it would run on until that came round."""

    def __init__(self, body, deltas) -> None:
        super().__init__(body, media_type="text/event-stream")
        self._deltas = deltas

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):  # a cancelled request still closes them
                await self.body_iterator.aclose()
                await self._deltas.aclose()


async def _first(deltas, names: dict[str, str]):
    """A request's first delta: errors in validation surface here, as a JSON error, in the client's field names
    (`names`: the engine's name -> the body's)."""
    try:
        return await anext(deltas, None)
    except Exception as e:
        raise _as_sent(e, names) from None


def _as_sent(e: Exception, names: dict[str, str]) -> ClientError:
    """The status of an error from the engine's side, its message and field in the client's names."""
    err = classify(e)
    if err.param is None or not names:
        return err
    message = as_sent(err.message, names)
    return ClientError(err.code, err.http_status, message, as_sent(err.param, names))


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)
@serve.ingress(api)
class Ingress:
    """The application's ingress deployment: the OpenAI-compatible HTTP routes, and the gRPC methods of
    `GrpcService` under their own names; both stream through one `ModelClient`.

    The routes are methods of the decorated class itself, not of a base class: the module-level name is
    then the deployment, so the methods travel to the replicas by value, with the signature
    `serve.ingress` gives them (by reference, a replica would import them without it). Serve's gRPC proxy calls
    the ingress's methods by name, so each gRPC method is one here, handing the call to the service."""

    def __init__(self, server: DeploymentHandle, api_keys: ApiKeys | None = None,
                 routes_on_token_ids: bool = False, catalog: DeploymentHandle | None = None) -> None:
        """`catalog`: the application's `AdapterCatalog`, where it serves LoRA adapters."""
        self.client = ModelClient(server, api_keys, routes_on_token_ids, catalog)
        self.server = server
        self.grpc = GrpcService(self.client)

    # ---- gRPC: pagedserve.v1.PagedServe and grpc.health.v1.Health ----

    async def Generate(self, request: pb.GenerateRequest, grpc_context=None) -> AsyncIterator[pb.GenerateResponse]:
        async for response in self.grpc.Generate(request, grpc_context):
            yield response

    async def Chat(self, request: pb.ChatRequest, grpc_context=None) -> AsyncIterator[pb.GenerateResponse]:
        async for response in self.grpc.Chat(request, grpc_context):
            yield response

    async def Tokenize(self, request: pb.TokenizeRequest, grpc_context=None) -> pb.TokenizeResponse:
        return await self.grpc.Tokenize(request, grpc_context)

    async def ModelInfo(self, request: pb.ModelInfoRequest, grpc_context=None) -> pb.ModelInfoResponse:
        return await self.grpc.ModelInfo(request, grpc_context)

    async def Abort(self, request: pb.AbortRequest, grpc_context=None) -> pb.AbortResponse:
        return await self.grpc.Abort(request, grpc_context)

    async def Health(self, request: pb.HealthRequest, grpc_context=None) -> pb.HealthResponse:
        return await self.grpc.Health(request, grpc_context)

    async def Check(self, request: health_pb2.HealthCheckRequest,
                    grpc_context=None) -> health_pb2.HealthCheckResponse:
        return await self.grpc.Check(request, grpc_context)

    async def Watch(self, request: health_pb2.HealthCheckRequest,
                    grpc_context=None) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        async for response in self.grpc.Watch(request, grpc_context):
            yield response

    # ---- HTTP: the OpenAI-compatible routes ----

    def _authorize_request(self, request: Request) -> None:
        self.client.authorize(request.headers.get("authorization"), "the header 'Authorization: Bearer <key>'")

    async def _read(self, request: Request, body_type: type[BodyT]) -> tuple[BodyT, str, LoRARequest | None]:
        """The request's body as `body_type`, the name of the model it runs on and the LoRA adapter that is (None:
        the base model): the key checked first, then the body, then the model it names."""
        self._authorize_request(request)
        body = parse(body_type, await request.body())
        adapter = await self.client.resolve_model(body.model)
        return body, adapter.lora_name if adapter else (await self.client.model_info_dict())["model"], adapter

    async def _model_card(self, adapter: LoRARequest | None = None) -> dict[str, Any]:
        """The base model's card, or an adapter's (vLLM's: root its directory, parent the base model)."""
        info = await self.client.model_info_dict()
        card = {"id": info["model"], "object": "model", "created": 0, "owned_by": "pagedserve",
                "root": info["model"], "parent": None, "max_model_len": info["max_model_len"]}
        if adapter is not None:
            card.update(id=adapter.lora_name, root=adapter.lora_path, parent=info["model"])
        return card

    @api.get("/health")
    @_answers_errors
    async def health(self) -> JSONResponse:
        await self.server.stats.remote()
        return JSONResponse({"status": "ok"})

    @api.get("/v1/models")
    @_answers_errors
    async def models(self, request: Request) -> JSONResponse:
        self._authorize_request(request)
        cards = [await self._model_card()] + [await self._model_card(a) for a in await self.client.adapters()]
        return JSONResponse({"object": "list", "data": cards})

    @api.get("/v1/models/{model_id:path}")
    @_answers_errors
    async def model(self, model_id: str, request: Request) -> JSONResponse:
        self._authorize_request(request)
        return JSONResponse(await self._model_card(await self.client.resolve_model(model_id)))

    @api.post("/v1/load_lora_adapter")
    @_answers_errors
    async def load_lora_adapter(self, request: Request) -> PlainTextResponse:
        """vLLM's: serve the adapter at `lora_path` as `lora_name`, checked against the model first (400 naming
        the problem)."""
        self._authorize_request(request)
        body = parse(LoadLoRAAdapterRequest, await request.body())
        catalog = self._catalog()
        if await catalog.get.remote(body.lora_name) is not None:
            raise ValueError(f"lora_name={body.lora_name!r}: an adapter of that name is already loaded")
        await self.server.check_adapter.remote(body.lora_path)
        await catalog.add.remote(body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @api.post("/v1/unload_lora_adapter")
    @_answers_errors
    async def unload_lora_adapter(self, request: Request) -> PlainTextResponse:
        """vLLM's: stop serving adapter `lora_name` (requests running with it finish)."""
        self._authorize_request(request)
        body = parse(UnloadLoRAAdapterRequest, await request.body())
        if await self._catalog().remove.remote(body.lora_name) is None:
            raise ClientError(grpc.StatusCode.NOT_FOUND, 404,
                              f"lora_name={body.lora_name!r}: no adapter of that name is loaded", "lora_name")
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    def _catalog(self) -> DeploymentHandle:
        if self.client.catalog is None:
            raise ValueError("lora_name: this server runs no LoRA adapters (start it with enable_lora: true)")
        return self.client.catalog

    @api.post("/tokenize")
    @_answers_errors
    async def tokenize_route(self, request: Request) -> JSONResponse:
        body, _, _ = await self._read(request, TokenizeRequest)
        if (body.prompt is None) == (body.messages is None):
            raise ValueError("prompt: give exactly one of prompt and messages")
        messages = [m.as_dict() for m in body.messages] if body.messages is not None else None
        ids, tokens = await self.server.tokenize.remote(body.prompt, messages, body.add_special_tokens, body.tools,
                                                        body.chat_options())
        info = await self.client.model_info_dict()
        return JSONResponse({"count": len(ids), "max_model_len": info["max_model_len"], "tokens": ids,
                             "token_strs": tokens if body.return_token_strs else None})

    @api.post("/detokenize")
    @_answers_errors
    async def detokenize_route(self, request: Request) -> JSONResponse:
        body, _, _ = await self._read(request, DetokenizeRequest)
        return JSONResponse({"prompt": await self.server.detokenize.remote(body.tokens)})

    @api.post("/v1/completions")
    @_answers_errors
    async def completions(self, request: Request):
        body, model, adapter = await self._read(request, CompletionRequest)
        prompts = body.prompts()
        params = body.to_sampling_params()
        echoed = None
        if body.echo:
            async def text(prompt: str | list[int]) -> str:
                return prompt if isinstance(prompt, str) else await self.server.detokenize.remote(prompt)
            echoed = list(await asyncio.gather(*(text(p) for p in prompts)))
        if not body.add_special_tokens:  # the batch's texts tokenized side by side
            texts = [i for i, p in enumerate(prompts) if isinstance(p, str)]
            encoded = await asyncio.gather(*(self.server.tokenize.remote(prompts[i], None, False) for i in texts))
            for i, (ids, _) in zip(texts, encoded, strict=True):
                prompts[i] = ids
        return await self._respond(prompts, params, body, model, adapter, chat=False, echoed=echoed)

    @api.post("/v1/chat/completions")
    @_answers_errors
    async def chat_completions(self, request: Request):
        body, model, adapter = await self._read(request, ChatCompletionRequest)
        plan = await self._chat_plan(body, [m.as_dict() for m in body.messages], body.to_sampling_params(),
                                     body.tools, body.tool_choice)
        echoed = body.echoed()
        return await self._respond(plan, plan.params, body, model, adapter, chat=True,
                                   echoed=None if echoed is None else [echoed])

    @api.post("/v1/responses")
    @_answers_errors
    async def responses(self, request: Request):
        body, model, adapter = await self._read(request, ResponsesRequest)
        plan = await self._chat_plan(body, body.messages(), body.sampling_params(), body.chat_tools(),
                                     body.chat_tool_choice())
        rid = body.request_id or "resp_" + uuid.uuid4().hex
        deltas = self.client.chat_deltas(plan, rid, lora=adapter)
        first = await _first(deltas, body.engine_names())
        build = ResponseBuilder(rid, int(time.time()), model, body, plan.reasoning, plan.reasoning_end_id)
        if body.stream:
            return _EventStream(build.sse(first, deltas), deltas)
        return JSONResponse(await build.whole(first, deltas))

    async def _chat_plan(self, body: ChatCompletionRequest | ResponsesRequest, messages: list[dict[str, Any]],
                         params: SamplingParams, tools: list[dict[str, Any]] | None,
                         tool_choice: str | dict[str, Any] | None) -> ChatPlan:
        """The engine's plan of a chat (`LLMEngine.chat_plan`); its errors in the body's field names."""
        try:
            return await self.server.chat_plan.remote(messages, params, tools, tool_choice,
                                                      body.parallel_tool_calls, body.chat_options())
        except Exception as e:
            raise _as_sent(e, body.engine_names()) from None

    async def _respond(self, prompt, params, body, model: str, adapter: LoRARequest | None, chat: bool,
                       echoed: list[str] | None = None):
        """`prompt`: a completion's prompts (texts or ids), or a chat's `ChatPlan`; `adapter`: the LoRA adapter
        they run with; `echoed`: the text each prompt's choices start with."""
        rid = body.request_id or (("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex)
        created = int(time.time())
        prompt_ids = bool(body.return_token_ids)
        deltas = self.client.chat_deltas(prompt, rid, body.include_reasoning, prompt_ids, adapter) if chat else \
            self.client.batch_deltas(prompt, params, rid, prompt_ids, adapter)
        if not chat and body.scores_only():
            deltas = prompt_only(deltas)
        first = await _first(deltas, body.engine_names())
        form = ResponseFormatter(rid, created, model, chat, params, body, echoed,
                                 reasoning=chat and prompt.reasoning is not None)
        if body.stream:
            return _EventStream(form.sse(first, deltas), deltas)
        return JSONResponse(await form.whole(first, deltas))
