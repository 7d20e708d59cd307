"""The PagedServe gRPC service (protos/pagedserve/v1) and the standard `grpc.health.v1.Health` service. Ray
Serve's gRPC proxy calls these methods by name on the application's ingress deployment.

Errors set the status code, a message naming the field, and (for bad input) a `google.rpc.BadRequest` in
the status details. Serve's proxy forwards a status's trailing metadata only along with a response
message, so an error is answered with one empty message: for a unary call gRPC drops it (the client sees
the status), a stream shows it before its status (clients skip a message without a request_id)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from google.protobuf import any_pb2, unknown_fields
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2
from grpc_status import rpc_status

from pagedserve.outputs import Logprob
from pagedserve.protos import SERVICE_NAME
from pagedserve.protos import pagedserve_pb2 as pb
from pagedserve.protos.chat_messages import (
    chat_options_from_proto,
    messages_from_proto,
    tool_choice_from_proto,
    tools_from_proto,
)
from pagedserve.protos.sampling import sampling_from_proto
from pagedserve.sampling_params import SamplingParams
from pagedserve.serving.deltas import Delta, cached_of
from pagedserve.serving.error_status import ClientError, classify
from pagedserve.serving.model_client import ModelClient

_FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT,
                   "tool_calls": pb.FINISH_REASON_TOOL_CALLS}
_HEALTH_SERVICES = ("", SERVICE_NAME)  # "": the server as a whole


class GrpcService:
    """The methods of `pagedserve.v1.PagedServe` and of `grpc.health.v1.Health`, over the ingress's `ModelClient`.
    The ingress deployment exposes them under the same names (Serve's gRPC proxy calls its methods by name)."""

    def __init__(self, client: ModelClient) -> None:
        self.client = client
        self.server = client.server  # the ModelServer deployment's handle

    def _accept(self, request, grpc_context) -> None:
        """The key checked, then the request's fields: each one this server's proto has (`check_known`)."""
        metadata = dict(grpc_context.invocation_metadata()) if grpc_context is not None else {}
        self.client.authorize(metadata.get("authorization"), "the metadata ('authorization', 'Bearer <key>')")
        check_known(request)

    async def Generate(self, request: pb.GenerateRequest, grpc_context=None) -> AsyncIterator[pb.GenerateResponse]:
        try:
            self._accept(request, grpc_context)
            which = request.WhichOneof("prompt")
            if which is None:
                raise ValueError("prompt is empty (set text or token_ids)")
            prompt = request.text if which == "text" else list(request.token_ids.ids)
            params = SamplingParams(**sampling_from_proto(request.sampling))  # ValueError names the field
            adapter = await self.client.resolve_model(request.adapter, "adapter")
            async for d in self.client.deltas(prompt, params, request.request_id or None,
                                              request.return_prompt_token_ids, adapter):
                yield _delta_to_proto(d)
        except Exception as e:
            yield _error(grpc_context, e, pb.GenerateResponse())

    async def Chat(self, request: pb.ChatRequest, grpc_context=None) -> AsyncIterator[pb.GenerateResponse]:
        try:
            self._accept(request, grpc_context)
            adapter = await self.client.resolve_model(request.adapter, "adapter")
            messages = messages_from_proto(request.messages)
            # A chat answer runs until the model stops or the context is full, unless max_tokens says otherwise.
            params = SamplingParams(**{"max_tokens": None, **sampling_from_proto(request.sampling)})
            parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else None
            plan = await self.server.chat_plan.remote(messages, params, tools_from_proto(request.tools),
                                                      tool_choice_from_proto(request), parallel,
                                                      chat_options_from_proto(request.template))
            include = request.include_reasoning if request.HasField("include_reasoning") else True
            async for d in self.client.chat_deltas(plan, request.request_id or None, include,
                                                   request.return_prompt_token_ids, adapter):
                yield _delta_to_proto(d)
        except Exception as e:
            yield _error(grpc_context, e, pb.GenerateResponse())

    async def Tokenize(self, request: pb.TokenizeRequest, grpc_context=None) -> pb.TokenizeResponse:
        try:
            self._accept(request, grpc_context)
            messages = messages_from_proto(request.messages)
            special = request.add_special_tokens if request.HasField("add_special_tokens") else None
            ids, tokens = await self.server.tokenize.remote(request.text, messages, special,
                                                            tools_from_proto(request.tools),
                                                            chat_options_from_proto(request.template))
            return pb.TokenizeResponse(token_ids=ids, tokens=tokens)
        except Exception as e:
            return _error(grpc_context, e, pb.TokenizeResponse())

    async def ModelInfo(self, request: pb.ModelInfoRequest, grpc_context=None) -> pb.ModelInfoResponse:
        try:
            self._accept(request, grpc_context)
            info = await self.client.model_info_dict()
            return pb.ModelInfoResponse(
                model=info["model"], max_model_len=info["max_model_len"], block_size=info["block_size"],
                tensor_parallel_size=info["tensor_parallel_size"], num_kv_blocks=info["num_kv_blocks"],
                kv_capacity_tokens=info["num_kv_blocks"] * info["block_size"], vocab_size=info["vocab_size"],
                num_replicas=await self.client.replicas_running(), eos_token_ids=info["eos_token_ids"],
                adapters=[a.lora_name for a in await self.client.adapters()])
        except Exception as e:
            return _error(grpc_context, e, pb.ModelInfoResponse())

    async def Abort(self, request: pb.AbortRequest, grpc_context=None) -> pb.AbortResponse:
        try:
            self._accept(request, grpc_context)
            if not request.request_id:
                raise ValueError("request_id is empty")
            return pb.AbortResponse(aborted=self.client.abort(request.request_id))
        except Exception as e:
            return _error(grpc_context, e, pb.AbortResponse())

    async def Health(self, request: pb.HealthRequest, grpc_context=None) -> pb.HealthResponse:
        try:
            await self.server.stats.remote()
            return pb.HealthResponse(status="SERVING")
        except Exception as e:
            return _error(grpc_context, e, pb.HealthResponse())

    # ---- grpc.health.v1.Health: open to all, as load balancers and orchestrators probe it without keys ----

    async def Check(self, request: health_pb2.HealthCheckRequest,
                    grpc_context=None) -> health_pb2.HealthCheckResponse:
        if request.service not in _HEALTH_SERVICES:
            return _error(grpc_context, ClientError(grpc.StatusCode.NOT_FOUND, 404,
                                                    f"service={request.service!r} is not served here"),
                          health_pb2.HealthCheckResponse())
        return health_pb2.HealthCheckResponse(status=await self._serving_status())

    async def Watch(self, request: health_pb2.HealthCheckRequest,
                    grpc_context=None) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        """The status now, then each time it changes (checked every few seconds)."""
        if request.service not in _HEALTH_SERVICES:
            yield health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
            return
        last = None
        while True:
            status = await self._serving_status()
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            await asyncio.sleep(2.0)

    async def _serving_status(self) -> int:
        try:
            await self.server.stats.remote()
            return health_pb2.HealthCheckResponse.SERVING
        except Exception:
            return health_pb2.HealthCheckResponse.NOT_SERVING


def check_known(message, where: str = "") -> None:
    """ValueError naming a field of `message` (or of a message in it) that this server's proto does not
    have, such as one a newer client sends: protobuf keeps such fields aside, unread, and the request would
    run as if it had not been asked for."""
    numbers = sorted({f.field_number for f in unknown_fields.UnknownFieldSet(message)})
    if numbers:
        raise ValueError(f"{where or message.DESCRIPTOR.name}: field number(s) {numbers} are not known to this "
                         "server (a newer client's?): upgrade the server, or leave them unset")
    for field, value in message.ListFields():
        if field.message_type is None or field.message_type.GetOptions().map_entry:
            continue  # scalars, and this proto's maps, whose values are scalars
        name = f"{where}.{field.name}" if where else field.name
        if field.is_repeated:
            for i, item in enumerate(value):
                check_known(item, f"{name}[{i}]")
        else:
            check_known(value, name)


def _logprob_to_proto(lp: Logprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, token=lp.token or "", top_logprobs=[
        pb.TopLogprob(token_id=t.token_id, logprob=t.logprob, token=t.token or "") for t in lp.top_logprobs])


def _delta_to_proto(d: Delta) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(request_id=d.request_id, index=d.index, text=d.text, token_ids=d.token_ids,
                              finish_reason=_FINISH_REASONS.get(d.finish_reason, pb.FINISH_REASON_UNSPECIFIED),
                              logprobs=[_logprob_to_proto(lp) for lp in d.logprobs],
                              tool_calls=[pb.ToolCallDelta(index=t.index, id=t.id or "", name=t.name or "",
                                                           arguments=t.arguments) for t in d.tool_calls],
                              reasoning=d.reasoning)
    if isinstance(d.stop_reason, str):
        msg.stop_str = d.stop_reason
    elif isinstance(d.stop_reason, int):
        msg.stop_token_id = d.stop_reason
    if d.prompt_logprobs:
        msg.prompt_logprobs.extend(_logprob_to_proto(lp) for lp in d.prompt_logprobs[1:])
    if d.prompt_token_ids:
        msg.prompt_token_ids.extend(d.prompt_token_ids)
    if d.final and d.usage:
        u = d.usage
        msg.usage.CopyFrom(pb.Usage(prompt_tokens=u["prompt_tokens"], completion_tokens=u["completion_tokens"],
                                    total_tokens=u["total_tokens"],
                                    cached_tokens=cached_of(u)))
    return msg


def _error(grpc_context, e: Exception, empty):
    """Set the status (code, message, and a BadRequest naming the field for bad input) on the call and
    return the empty message that carries it through Serve's proxy."""
    err = classify(e)
    if grpc_context is None:
        raise err
    status = status_pb2.Status(code=getattr(code_pb2, err.code.name), message=err.message)
    if err.code == grpc.StatusCode.INVALID_ARGUMENT and err.param:
        detail = any_pb2.Any()
        detail.Pack(error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=err.param, description=err.message)]))
        status.details.append(detail)
    grpc_status = rpc_status.to_status(status)
    grpc_context.set_code(grpc_status.code)
    grpc_context.set_details(grpc_status.details)
    grpc_context.set_trailing_metadata(list(grpc_status.trailing_metadata))
    return empty
