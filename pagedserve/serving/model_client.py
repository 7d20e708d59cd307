"""`ModelClient`: the ingress's side of the `ModelServer` deployment, through a Serve deployment handle (Serve
routes each call to one replica), with the model's description, the API keys, and the requests this ingress is
streaming, by id. The gRPC service and the OpenAI routes both stream through it."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import RequestCancelledError
from ray.serve.handle import DeploymentHandle

from pagedserve.chat.template import ChatPlan
from pagedserve.lora.lora_request import LoRARequest
from pagedserve.sampling_params import SamplingParams
from pagedserve.serving.auth import ApiKeys
from pagedserve.serving.deltas import Delta, merge_prompts, with_reasoning, with_tool_calls
from pagedserve.serving.error_status import ClientError

_RUNS_PER_REQUEST = 3  # a request whose replica died before its first output runs again, up to this often


class _Running:
    """A request this ingress is streaming: what `Abort` and a retried request id reach."""

    def __init__(self) -> None:
        self.stream: Any = None
        self.aborted = False
        self.done = asyncio.Event()

    def abort(self) -> None:
        self.aborted = True
        if self.stream is not None:
            self.stream.cancel()


class ModelClient:
    """What the front ends (gRPC, OpenAI HTTP) share: the `ModelServer` handle, the model's description, the
    API keys, and the requests this ingress is streaming, by id."""

    def __init__(self, server: DeploymentHandle, api_keys: ApiKeys | None = None,
                 routes_on_token_ids: bool = False, catalog: DeploymentHandle | None = None) -> None:
        """`catalog`: the application's `AdapterCatalog` (None: it serves no LoRA adapters)."""
        self.server = server
        self.catalog = catalog
        # the prefix-aware router hashes token ids: a text prompt is tokenized (once) before it is routed
        self.routes_on_token_ids = routes_on_token_ids
        self.api_keys = api_keys or ApiKeys()
        self.api_keys.log_state("pagedserve ingress")
        self._info: dict[str, Any] | None = None
        self._running: dict[str, _Running] = {}

    def authorize(self, credential: str | None, how: str) -> None:
        """UNAUTHENTICATED / 401 unless `credential` (an Authorization value) carries a configured key."""
        if not self.api_keys.allows(credential):
            raise ClientError(grpc.StatusCode.UNAUTHENTICATED, 401, f"a valid API key is required: send {how}")

    async def model_info_dict(self) -> dict[str, Any]:
        if self._info is None:
            self._info = await self.server.model_info.remote()
        return self._info

    async def resolve_model(self, asked: str | None, field: str = "model") -> LoRARequest | None:
        """The adapter a request's model name names (None: the base model, named or not); NOT_FOUND naming it
        when this application serves no such model."""
        base = (await self.model_info_dict())["model"]
        if asked in (None, "", base):
            return None
        adapter = None if self.catalog is None else await self.catalog.get.remote(asked)
        if adapter is None:
            served = [base] + [a.lora_name for a in await self.adapters()]
            raise ClientError(grpc.StatusCode.NOT_FOUND, 404, f"{field}={asked!r} is not served here (serving "
                              f"{', '.join(map(repr, served))})", field)
        return adapter

    async def adapters(self) -> list[LoRARequest]:
        """The LoRA adapters served now."""
        return [] if self.catalog is None else await self.catalog.list.remote()

    async def replicas_running(self) -> int:
        """The model replicas running now, as Serve counts them: autoscaling changes the count, and a replica
        being replaced is out of it until its successor runs."""
        deployment = self.server.deployment_id
        status = await asyncio.to_thread(serve.status)  # a call to Serve's controller: off the event loop
        return status.applications[deployment.app_name].deployments[deployment.name].replica_states.get(
            "RUNNING", 0)

    def abort(self, request_id: str) -> bool:
        """End a request this ingress is streaming: its stream ends with finish_reason "abort" and the engine
        frees its blocks. False if no such request is running here."""
        running = self._running.get(request_id)
        if running is None or running.aborted:
            return False
        running.abort()
        return True

    def chat_deltas(self, plan: ChatPlan, request_id: str | None, include_reasoning: bool = True,
                    prompt_ids: bool = False, lora: LoRARequest | None = None) -> AsyncIterator[Delta]:
        """A chat request's deltas: its reasoning parsed out with a reasoning parser (and left out without
        `include_reasoning`), and then its tool calls when tools are in play; `prompt_ids` and `lora` as
        `deltas`."""
        if plan.reasoning is None and not include_reasoning:
            raise ValueError("include_reasoning=false is not supported: this server parses no reasoning out "
                             "of the answer (the engine's reasoning_parser is not set), so it cannot be left out")
        deltas = self.deltas(plan.prompt_token_ids, plan.params, request_id, prompt_ids, lora)
        if plan.reasoning is not None:
            deltas = with_reasoning(deltas, plan.reasoning, include_reasoning)
        return deltas if plan.tool_parsing is None else with_tool_calls(deltas, plan.tool_parsing)

    def batch_deltas(self, prompts: list[str | list[int]], params: SamplingParams, request_id: str,
                     prompt_ids: bool = False, lora: LoRARequest | None = None) -> AsyncIterator[Delta]:
        """The deltas of a batch of prompts (a completions request may send several): one request each,
        `<request_id>-<i>`, run side by side, prompt i's samples numbered from i*n (`merge_prompts`)."""
        if len(prompts) == 1:
            return self.deltas(prompts[0], params, request_id, prompt_ids, lora)
        return merge_prompts([self.deltas(p, params, f"{request_id}-{i}", prompt_ids, lora)
                              for i, p in enumerate(prompts)], params.n, request_id)

    async def deltas(self, prompt: str | list[int], params: SamplingParams, request_id: str | None,
                     prompt_ids: bool = False, lora: LoRARequest | None = None) -> AsyncIterator[Delta]:
        """The request's deltas (see `stream_deltas`; `prompt_ids`: the first carries the prompt's token ids)
        from whichever engine replica the router picks, run with the LoRA adapter `lora` (None: the base model).

        A request id that is still streaming here is a retry of it (a client that lost the first attempt's
        connection): the earlier attempt is aborted first, so the request never runs twice. A request whose
        replica died before it produced anything runs again on another replica; one that had started ends
        with the replica's death (UNAVAILABLE)."""
        rid = request_id or uuid.uuid4().hex
        if self.routes_on_token_ids and isinstance(prompt, str):
            prompt = await self.server.encode_prompt.remote(prompt)
        earlier = self._running.get(rid)
        if earlier is not None:
            earlier.abort()
            try:  # bounded: should it not end, the engine refuses the id as in use rather than run it twice
                await asyncio.wait_for(earlier.done.wait(), timeout=30)
            except TimeoutError:
                pass
        running = self._running[rid] = _Running()
        finished: set[int] = set()
        usage_so_far: dict[str, int] = {}
        try:
            for attempt in range(_RUNS_PER_REQUEST):
                running.stream = self.server.options(stream=True).generate_deltas.remote(prompt, params, rid,
                                                                                         prompt_ids, lora)
                if running.aborted:  # aborted while the call was being made
                    running.stream.cancel()
                started = False
                try:
                    async for d in running.stream:
                        started = True
                        usage_so_far = d.usage
                        if d.finish_reason is not None:
                            finished.add(d.index)
                        yield d
                except (RequestCancelledError, asyncio.CancelledError):
                    if not running.aborted:
                        raise
                except RayActorError:
                    # The replica died, or Serve cannot reach it and calls it unavailable (as it may a replica
                    # just killed, before its death is known): nothing of the request reached the client, so
                    # it runs on a replica the router still trusts. Should an unreachable one still be running
                    # it, that run ends by its own limits, its output read by no one.
                    if started or running.aborted or attempt + 1 == _RUNS_PER_REQUEST:
                        raise
                    continue
                break
            if running.aborted:
                left = [i for i in range(params.n) if i not in finished]
                for i in left:
                    yield Delta(rid, i, "", [], finish_reason="abort", usage=usage_so_far, final=i == left[-1])
        finally:
            if running.stream is not None:
                running.stream.cancel()  # no-op once finished; otherwise the client left: abort, free the blocks
            running.done.set()
            if self._running.get(rid) is running:
                del self._running[rid]
