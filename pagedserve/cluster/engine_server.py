"""The engine side of the Serve application: `EngineServer`, one deployment replica per model replica (an
`AsyncEngine`: scheduler, block manager, step loop, and its own worker actors), and `EngineClient`, the
ingress's view of it through a deployment handle."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import RequestCancelledError
from ray.serve.handle import DeploymentHandle

from pagedserve.async_engine import AsyncEngine
from pagedserve.chat import ChatOptions, ChatPlan
from pagedserve.cluster.auth import ApiKeys
from pagedserve.cluster.deltas import Delta, merge_prompts, stream_deltas, with_reasoning, with_tool_calls
from pagedserve.cluster.errors import ClientError
from pagedserve.cluster.prefix_router import PrefixAwareRouter, PrefixRouting, summarize
from pagedserve.config import EngineConfig, ray_hosted_config
from pagedserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096, health_check_period_s=10)
class EngineServer:
    def __init__(self, config: EngineConfig, max_waiting_requests: int | None = None,
                 publish_cached_blocks: bool = False, stream_interval_ms: float = 0) -> None:
        from pagedserve.cluster.metrics import EngineMetrics

        self.core = AsyncEngine(ray_hosted_config(config), max_waiting_requests,
                                stream_interval_ms=stream_interval_ms)
        self.core.metrics = EngineMetrics(self.core.model_info()["model"])
        self.publish_cached_blocks = publish_cached_blocks

    async def generate_deltas(self, prompt: str | list[int], params: SamplingParams,
                              request_id: str | None = None, prompt_ids: bool = False) -> AsyncIterator[Delta]:
        # Deltas are cut here, on the engine side: only what is new crosses between processes each step.
        async for d in stream_deltas(self.core.generate(prompt, params, request_id), params, prompt_ids):
            yield d

    async def chat_plan(self, messages: list[dict[str, Any]], params: SamplingParams,
                        tools: list[dict[str, Any]] | None = None, tool_choice: str | dict[str, Any] | None = None,
                        parallel_tool_calls: bool | None = None, options: ChatOptions | None = None) -> ChatPlan:
        return await self.core.prepare(self.core.engine.chat_plan, messages, params, tools, tool_choice,
                                       parallel_tool_calls, options)

    async def tokenize(self, text: str | None, messages: list[dict[str, Any]] | None, add_special_tokens: bool | None,
                       tools: list[dict[str, Any]] | None = None,
                       options: ChatOptions | None = None) -> tuple[list[int], list[str]]:
        return await self.core.prepare(self.core.engine.tokenize, text, messages, add_special_tokens, tools, options)

    async def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        return await self.core.prepare(self.core.engine.encode_prompt, prompt)

    async def detokenize(self, token_ids: list[int]) -> str:
        return await self.core.prepare(self.core.engine.detokenize, token_ids)

    async def model_info(self) -> dict[str, Any]:
        return self.core.model_info()

    async def check_health(self) -> None:
        """Serve's health check: raising marks the replica unhealthy, and Serve replaces it."""
        await self.core.check_health()

    async def worker_pids(self) -> list[int]:
        return await self.core.worker_pids()

    async def record_routing_stats(self) -> dict[str, Any]:
        """What Serve hands the request router every `request_routing_stats_period_s`: the engine's stats
        (a few numbers: load, KV blocks, prefix-cache counters) and, for the prefix-aware router, the
        blocks its prefix cache holds (`prefix_router.summarize`)."""
        stats = self.core.stats()
        if self.publish_cached_blocks:
            stats["cached_blocks"] = summarize(self.core.engine.block_manager.pool.cached_hashes())
        return stats

    async def stats(self) -> dict[str, Any]:
        return self.core.stats()

    def __del__(self) -> None:
        core = getattr(self, "core", None)
        if core is not None:
            core.shutdown()  # the worker actors and their placement group go with the replica


def replica_stats(app_name: str, names: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Each EngineServer replica's stats in the Serve application `app_name` (or those of the replica actors
    `names`), by replica actor name: what each publishes to the router, asked of every replica directly.
    For operators and benchmarks; a deployment handle would reach one replica, not each."""
    import ray

    if names is None:
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["name"].startswith(f"SERVE_REPLICA::{app_name}#EngineServer#")]
    refs = [ray.get_actor(name, namespace="serve").record_routing_stats.remote() for name in names]
    return dict(zip(names, ray.get(refs, timeout=30), strict=True))


def engine_options(config: EngineConfig, num_replicas: int | None = None,
                   autoscaling_config: dict[str, Any] | None = None,
                   ray_actor_options: dict[str, Any] | None = None,
                   prefix_routing: PrefixRouting | None = None) -> dict[str, Any]:
    """`EngineServer.options(...)` for a model replica: its placement group (one bundle for the engine, one
    per worker, packed on one node) declared to Serve, so that Serve places a replica as a unit, or reports
    that it cannot; the replica count or autoscaling; the engine actor's options; the request router
    (`prefix_routing`, or Serve's default when None). ValueError naming the setting that is wrong, or
    saying that no node of the cluster could hold a replica."""
    from ray.serve.config import RequestRouterConfig

    from pagedserve.executors.ray_executor import worker_bundle

    if autoscaling_config is not None and num_replicas is not None:
        raise ValueError("num_replicas and autoscaling_config: give one (autoscaling sets the count itself)")
    if num_replicas is not None and (not isinstance(num_replicas, int) or num_replicas < 1):
        raise ValueError(f"num_replicas={num_replicas!r} must be an integer >= 1")
    actor = {"num_cpus": 1, **(ray_actor_options or {})}
    unknown = set(actor) - {"num_cpus", "num_gpus", "memory", "resources", "runtime_env", "accelerator_type"}
    if unknown:
        raise ValueError(f"ray_actor_options has unsupported keys {sorted(unknown)}")
    if not isinstance(actor["num_cpus"], int | float) or actor["num_cpus"] <= 0:
        raise ValueError(f"ray_actor_options.num_cpus={actor['num_cpus']!r} must be > 0 (the engine's own bundle)")
    engine_bundle = {"CPU": actor["num_cpus"], "GPU": actor.get("num_gpus", 0), "memory": actor.get("memory", 0),
                     **actor.get("resources", {})}
    engine_bundle = {k: v for k, v in engine_bundle.items() if v}
    bundles = [engine_bundle] + [worker_bundle(config) for _ in range(config.tensor_parallel_size)]
    _check_fits(bundles, config.tensor_parallel_size)
    if "GPU" not in bundles[1] and config.worker_cpus is None and (autoscaling_config is not None
                                                                   or (num_replicas or 1) > 1):
        log.warning("several model replicas on CPUs without worker_cpus: the workers of replicas that share a "
                    "node each compute on all its cores, and slow one another down; give each worker "
                    "worker_cpus so that they add up to a node's cores")
    options: dict[str, Any] = {"ray_actor_options": actor, "placement_group_bundles": bundles,
                               "placement_group_strategy": "STRICT_PACK"}
    if prefix_routing is not None:
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=PrefixAwareRouter,
            request_router_kwargs={"block_size": config.block_size,
                                   "imbalance_threshold": prefix_routing.imbalance_threshold,
                                   "memory_s": prefix_routing.memory_s},
            request_routing_stats_period_s=prefix_routing.stats_period_s)
    if autoscaling_config is not None:
        options["autoscaling_config"] = autoscaling_config
    else:
        options["num_replicas"] = num_replicas or 1
    return options


def _check_fits(bundles: list[dict[str, float]], tp: int) -> None:
    """ValueError if no alive node of the cluster (when connected to one) has what one replica needs."""
    import ray

    if not ray.is_initialized():
        return  # `serve run` connects before it builds; a builder called alone cannot know the cluster
    need: dict[str, float] = {}
    for bundle in bundles:
        for key, value in bundle.items():
            need[key] = need.get(key, 0) + value
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    if not any(all(node.get(k, 0) >= v for k, v in need.items()) for node in nodes):
        largest = max(nodes, key=lambda r: (r.get("GPU", 0), r.get("CPU", 0)), default={})
        raise ValueError(f"tensor_parallel_size={tp}: one replica needs {need} on one node (its engine and "
                         f"{tp} worker(s), packed), and no node of this Ray cluster has that (the largest has "
                         f"CPU={largest.get('CPU', 0)}, GPU={largest.get('GPU', 0)})")


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


class EngineClient:
    """What the front ends (gRPC, OpenAI HTTP) share: the `EngineServer` handle (Serve routes each call
    to one of its replicas), the model's description, the API keys, and the requests this ingress is
    streaming, by id."""

    def __init__(self, engine: DeploymentHandle, api_keys: ApiKeys | None = None,
                 routes_on_token_ids: bool = False) -> None:
        self.engine = engine
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
            self._info = await self.engine.model_info.remote()
        return self._info

    async def replicas_running(self) -> int:
        """The model replicas running now, as Serve counts them: autoscaling changes the count, and a replica
        being replaced is out of it until its successor runs."""
        deployment = self.engine.deployment_id
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
                    prompt_ids: bool = False) -> AsyncIterator[Delta]:
        """A chat request's deltas: its reasoning parsed out with a reasoning parser (and left out without
        `include_reasoning`), and then its tool calls when tools are in play; `prompt_ids` as `deltas`."""
        if plan.reasoning is None and not include_reasoning:
            raise ValueError("include_reasoning=false is not supported: this server parses no reasoning out "
                             "of the answer (the engine's reasoning_parser is not set), so it cannot be left out")
        deltas = self.deltas(plan.prompt_token_ids, plan.params, request_id, prompt_ids)
        if plan.reasoning is not None:
            deltas = with_reasoning(deltas, plan.reasoning, include_reasoning)
        return deltas if plan.tool_parsing is None else with_tool_calls(deltas, plan.tool_parsing)

    def batch_deltas(self, prompts: list[str | list[int]], params: SamplingParams, request_id: str,
                     prompt_ids: bool = False) -> AsyncIterator[Delta]:
        """The deltas of a batch of prompts (a completions request may send several): one request each,
        `<request_id>-<i>`, run side by side, prompt i's samples numbered from i*n (`merge_prompts`)."""
        if len(prompts) == 1:
            return self.deltas(prompts[0], params, request_id, prompt_ids)
        return merge_prompts([self.deltas(p, params, f"{request_id}-{i}", prompt_ids)
                              for i, p in enumerate(prompts)], params.n, request_id)

    async def deltas(self, prompt: str | list[int], params: SamplingParams, request_id: str | None,
                     prompt_ids: bool = False) -> AsyncIterator[Delta]:
        """The request's deltas (see `stream_deltas`; `prompt_ids`: the first carries the prompt's token ids)
        from whichever engine replica the router picks.

        A request id that is still streaming here is a retry of it (a client that lost the first attempt's
        connection): the earlier attempt is aborted first, so the request never runs twice. A request whose
        replica died before it produced anything runs again on another replica; one that had started ends
        with the replica's death (UNAVAILABLE)."""
        rid = request_id or uuid.uuid4().hex
        if self.routes_on_token_ids and isinstance(prompt, str):
            prompt = await self.engine.encode_prompt.remote(prompt)
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
                running.stream = self.engine.options(stream=True).generate_deltas.remote(prompt, params, rid,
                                                                                         prompt_ids)
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
