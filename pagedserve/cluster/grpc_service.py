"""The PagedServe gRPC service (protos/pagedserve/v1). Ray Serve's gRPC proxy calls these methods by name
on the application's ingress deployment."""

from __future__ import annotations

from collections.abc import AsyncIterator

from pagedserve.cluster.deltas import Delta
from pagedserve.cluster.engine_server import EngineClient
from pagedserve.cluster.errors import classify
from pagedserve.protos import pagedserve_pb2 as pb
from pagedserve.protos.sampling import sampling_from_proto
from pagedserve.sampling_params import SamplingParams


class GrpcService(EngineClient):
    async def Generate(self, request: pb.GenerateRequest, grpc_context=None) -> AsyncIterator[pb.GenerateResponse]:
        try:
            which = request.WhichOneof("prompt")
            if which is None:
                raise ValueError("prompt is empty (set text or token_ids)")
            prompt = request.text if which == "text" else list(request.token_ids.ids)
            params = SamplingParams(**sampling_from_proto(request.sampling))  # ValueError names the field
            async for d in self.deltas(prompt, params, request.request_id or None):
                yield _delta_to_proto(d)
        except Exception as e:
            _abort_grpc(grpc_context, e)

    async def Chat(self, request: pb.ChatRequest, grpc_context=None) -> AsyncIterator[pb.GenerateResponse]:
        try:
            messages = [{"role": m.role, "content": m.content} for m in request.messages]
            params = SamplingParams(**sampling_from_proto(request.sampling))
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
    err = classify(e)
    if grpc_context is not None:
        grpc_context.set_code(err.code)
        grpc_context.set_details(err.message)
    raise err
