"""`ModelServer`, the engine side of the Serve application: one deployment replica per model replica, each an
`AsyncEngine` (scheduler, block manager, step loop) with its own worker actors; the options that place it."""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from pagedserve.chat.template import ChatOptions, ChatPlan
from pagedserve.config import EngineConfig, ray_hosted_config
from pagedserve.engine.async_engine import AsyncEngine
from pagedserve.engine.transfer_cost import measure as measure_transfer_cost
from pagedserve.lora.lora_request import LoRARequest
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler.prefix_transfer import PrefixExport
from pagedserve.serving.adapter_catalog import LoRAModule
from pagedserve.serving.deltas import Delta, stream_deltas
from pagedserve.serving.prefill_split import RemotePrefill, prefill_export
from pagedserve.serving.prefix_fetch import PrefixFetcher
from pagedserve.serving.prefix_router import KVSource, PrefixAwareRouter, PrefixRouting, summarize

log = logging.getLogger(__name__)


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096, health_check_period_s=10)
class ModelServer:
    def __init__(self, config: EngineConfig, max_waiting_requests: int | None = None,
                 publish_cached_blocks: bool = False, stream_interval_ms: float = 0,
                 lora_modules: tuple[LoRAModule, ...] = (), kv_transfer: bool | str | None = False,
                 prefill_servers: DeploymentHandle | None = None, prefill_timeout_s: float = 60.0,
                 serves_prefills: bool = False) -> None:
        """`lora_modules`: the adapters the application serves from the start, checked here against the model (a
        broken one fails the deployment, by name). `kv_transfer`: fetch a prefix another replica holds
        (`PrefixRouting.transfer`). `prefill_servers`: a handle to the prefill deployment, where prompts are
        prefilled (this replica decodes), waited for up to `prefill_timeout_s`; `serves_prefills`: this replica is one
        of that deployment (`prefill_split.py`)."""
        from pagedserve.serving.metrics import ServerMetrics

        self.engine = AsyncEngine(ray_hosted_config(config), max_waiting_requests,
                                  stream_interval_ms=stream_interval_ms)
        try:
            for module in lora_modules:
                self.engine.llm_engine.adapters.read(module.path)
        except ValueError as e:
            self.engine.shutdown()
            raise ValueError(f"lora_modules {module.name!r}: {e}") from None
        try:
            self.fetcher = self._fetcher(kv_transfer)
            self.remote_prefill = self._remote_prefill(prefill_servers, prefill_timeout_s, serves_prefills)
        except ValueError:
            self.engine.shutdown()
            raise
        self.engine.metrics = ServerMetrics(self.engine.model_info()["model"])
        self.engine.metrics.on_state(self.engine.stats())  # the gauges exported from the start, not the first request
        self.inputs = self.engine.llm_engine.inputs  # tokenizing, chat templates: run by `AsyncEngine.prepare`
        self.publish_cached_blocks = publish_cached_blocks

    def _fetcher(self, setting: bool | str | None) -> PrefixFetcher | None:
        """The fetcher of other replicas' prefixes, its costs measured now, before the replica serves; None where
        transfers are off, or cannot be and were not asked for."""
        if setting is False:
            return None
        engine = self.engine.llm_engine
        reason = engine.transfer_unsupported()
        if reason is None:
            try:
                return PrefixFetcher(self.engine, measure_transfer_cost(engine), always=setting == "always")
            except Exception as e:
                reason = f"measuring a transfer failed: {e!r}"
        if setting:
            raise ValueError(f"prefix_routing.transfer={setting!r}: K/V cannot move between replicas: {reason}")
        log.info("K/V transfers between replicas are off: %s", reason)
        return None

    def _remote_prefill(self, prefill_servers: DeploymentHandle | None, timeout_s: float,
                        serves_prefills: bool) -> RemotePrefill | None:
        """The prefill deployment's side of this (decode) replica; None where this replica prefills its own prompts.
        ValueError where K/V cannot move between this replica and the others."""
        if prefill_servers is None and not serves_prefills:
            return None
        reason = self.engine.llm_engine.transfer_unsupported()
        if reason is not None:
            raise ValueError(f"prefill: prompts cannot be prefilled on other replicas: {reason}")
        return None if prefill_servers is None else RemotePrefill(self.engine, prefill_servers, timeout_s)

    async def generate_deltas(self, prompt: str | list[int], params: SamplingParams,
                              request_id: str | None = None, prompt_ids: bool = False,
                              lora: LoRARequest | None = None,
                              kv_source: KVSource | None = None) -> AsyncIterator[Delta]:
        """`lora`: the LoRA adapter the request runs with (None: the base model). `kv_source`: the replica that
        holds more of the prompt's prefix (set by the prefix-aware router), from which it may be fetched."""
        fetch_prefix = None
        if self.remote_prefill is not None:
            fetch_prefix = self.remote_prefill.prefill
        elif kv_source is not None and self.fetcher is not None:
            fetch_prefix = functools.partial(self.fetcher.fetch, source=kv_source)
        # Deltas are cut here, on the engine side: only what is new crosses between processes each step.
        async for d in stream_deltas(self.engine.generate(prompt, params, request_id, lora, fetch_prefix), params,
                                     prompt_ids):
            yield d

    async def prefill_export(self, prompt: list[int], params: SamplingParams, request_id: str, first_block: int,
                             lora: LoRARequest | None = None) -> PrefixExport:
        """On a prefill replica: the prompt computed and its full blocks from `first_block` on exported, for the decode
        replica running request `request_id` (`prefill_split.py`; routed as `generate_deltas` is, by the prompt)."""
        return await prefill_export(self.engine, prompt, params, request_id, first_block, lora)

    async def export_prefix(self, replica: str, token_ids: list[int], cache_salt: str | None, lora_id: int | None,
                            first_block: int, num_blocks: int) -> PrefixExport:
        """The prompt's cached blocks [first_block, first_block + num_blocks) as far as this replica holds them, for
        another replica (`prefix_fetch.py`). `replica`: this one's id, which the router sends the call by."""
        return await self.engine.export_prefix(token_ids, cache_salt, lora_id, first_block, num_blocks)

    async def check_adapter(self, path: str) -> None:
        """ValueError naming the problem where the adapter at `path` cannot run on this model."""
        await self.engine.prepare(self.engine.llm_engine.adapters.read, path)

    async def chat_plan(self, messages: list[dict[str, Any]], params: SamplingParams,
                        tools: list[dict[str, Any]] | None = None, tool_choice: str | dict[str, Any] | None = None,
                        parallel_tool_calls: bool | None = None, options: ChatOptions | None = None) -> ChatPlan:
        return await self.engine.prepare(self.inputs.chat_plan, messages, params, tools, tool_choice,
                                         parallel_tool_calls, options)

    async def tokenize(self, text: str | None, messages: list[dict[str, Any]] | None, add_special_tokens: bool | None,
                       tools: list[dict[str, Any]] | None = None,
                       options: ChatOptions | None = None) -> tuple[list[int], list[str]]:
        return await self.engine.prepare(self.inputs.tokenize, text, messages, add_special_tokens, tools, options)

    async def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        return await self.engine.prepare(self.inputs.encode_prompt, prompt)

    async def detokenize(self, token_ids: list[int]) -> str:
        return await self.engine.prepare(self.inputs.detokenize, token_ids)

    async def model_info(self) -> dict[str, Any]:
        return self.engine.model_info()

    async def check_health(self) -> None:
        """Serve's health check: raising marks the replica unhealthy, and Serve replaces it."""
        await self.engine.check_health()

    async def worker_pids(self) -> list[int]:
        return await self.engine.worker_pids()

    async def record_routing_stats(self) -> dict[str, Any]:
        """What Serve hands the request router every `request_routing_stats_period_s`: the engine's stats
        (a few numbers: load, KV blocks, prefix-cache counters) and, for the prefix-aware router, the
        blocks its prefix cache holds (`prefix_router.summarize`)."""
        stats = self.engine.stats()
        if self.publish_cached_blocks:
            stats["cached_blocks"] = summarize(self.engine.cached_block_hashes())
        return stats

    async def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()  # the worker actors and their placement group go with the replica


def replica_actor_names(app_name: str, deployment: str = "ModelServer") -> list[str]:
    """The names of the replica actors of `deployment` in the Serve application `app_name` (in Serve's namespace,
    "serve"), for operators, benchmarks and tests that reach each replica rather than one through a handle."""
    import ray

    prefix = f"SERVE_REPLICA::{app_name}#{deployment}#"
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]


def replica_stats(app_name: str, names: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Each ModelServer replica's stats in the Serve application `app_name` (or those of the replica actors
    `names`), by replica actor name: what each publishes to the router, asked of every replica directly.
    For operators and benchmarks; a deployment handle would reach one replica, not each."""
    import ray

    if names is None:
        names = replica_actor_names(app_name)
    refs = [ray.get_actor(name, namespace="serve").record_routing_stats.remote() for name in names]
    return dict(zip(names, ray.get(refs, timeout=30), strict=True))


def model_server_options(config: EngineConfig, num_replicas: int | None = None,
                   autoscaling_config: dict[str, Any] | None = None,
                   ray_actor_options: dict[str, Any] | None = None,
                   prefix_routing: PrefixRouting | None = None) -> dict[str, Any]:
    """`ModelServer.options(...)` for a model replica: its placement group (one bundle for the engine, one
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
                                   "memory_s": prefix_routing.memory_s,
                                   "transfer": prefix_routing.transfer is not False},
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
