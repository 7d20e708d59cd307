"""The Ray Serve application: `ModelServer` (one deployment replica per model replica) and `Ingress`
(the gRPC service and the OpenAI-compatible routes), separate deployments as in Ray Serve LLM; with `prefill`, a
second deployment of `ModelServer`, `PrefillServer`, whose replicas prefill the prompts the others decode.

    serve run deploy/config.yaml      # import_path: pagedserve.serving.serve_app:build_app
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pagedserve.config import EngineConfig, ray_hosted_config
from pagedserve.engine.async_engine import stream_interval_seconds
from pagedserve.serving.adapter_catalog import AdapterCatalog, LoRAModule
from pagedserve.serving.auth import ApiKeys
from pagedserve.serving.ingress import Ingress
from pagedserve.serving.model_server import ModelServer, model_server_options
from pagedserve.serving.prefill_split import PrefillSplit
from pagedserve.serving.prefix_router import PrefixRouting

# A served stream sends at most one message per this many milliseconds (see AsyncEngine).
DEFAULT_STREAM_INTERVAL_MS = 100
PREFILL_DEPLOYMENT = "PrefillServer"  # the prefill replicas' deployment (`prefill`), beside ModelServer's decode ones


def build_app(args: dict[str, Any] | None = None):
    """Serve application builder (deploy/config.yaml `args`): engine settings of EngineConfig plus
    `num_replicas` (model replicas) or `autoscaling_config` (Serve's, on ongoing requests per replica),
    `ray_actor_options` (the engine actor's), `prefix_routing` (true, false for Serve's default router, or
    `PrefixRouting`'s settings; used with more than one replica or autoscaling), `prefill` (`PrefillSplit`'s
    settings: prompts prefilled on replicas of their own, the replicas above decoding), `max_waiting_requests`
    (queue bound before RESOURCE_EXHAUSTED), `stream_interval_ms` (a stream's outputs merged into at most
    one message per interval: `AsyncEngine`) and `api_keys` (a key or a list; null: the PAGEDSERVE_API_KEY
    environment variable, else no key) and `lora_modules` (the LoRA adapters served from the start, each
    `{name: ..., path: ...}`, with `enable_lora`). Bad settings fail here, at deploy time, by name."""
    args = dict(args or {})
    num_replicas = args.pop("num_replicas", None)
    autoscaling = args.pop("autoscaling_config", None)
    actor_options = args.pop("ray_actor_options", None)
    routing_settings = PrefixRouting.parse(args.pop("prefix_routing", None))
    # one replica: no choice to make, and a text prompt then needs no tokenizing call first
    routing = routing_settings if _several(num_replicas, autoscaling) else None
    split = PrefillSplit.parse(args.pop("prefill", None))
    max_waiting = args.pop("max_waiting_requests", None)
    stream_interval_ms = args.pop("stream_interval_ms", DEFAULT_STREAM_INTERVAL_MS)
    stream_interval_seconds(stream_interval_ms)  # a bad value fails the deployment now, not in each replica
    api_keys = ApiKeys.resolve(args.pop("api_keys", None))
    lora_modules = args.pop("lora_modules", None)
    config = ray_hosted_config(args)
    lora_modules = tuple(LoRAModule.parse_all(lora_modules, config.enable_lora))
    kv_transfer = routing.transfer if routing is not None else False
    prefill: dict[str, Any] = {}  # the decode replicas' handle to the prefill deployment, and how long they wait
    if split is not None:
        if kv_transfer:
            raise ValueError(f"prefix_routing.transfer={kv_transfer!r} with prefill: decode replicas take their "
                             "prompts' blocks from the prefill replicas (leave transfer out)")
        kv_transfer = False
        prefill = _prefill_deployment(split, config, actor_options, routing_settings, max_waiting, lora_modules)
    server = ModelServer.options(**model_server_options(config, num_replicas, autoscaling, actor_options,
                                                         routing))
    catalog = AdapterCatalog.bind(list(lora_modules)) if config.enable_lora else None
    return Ingress.bind(server.bind(config, max_waiting, routing is not None, stream_interval_ms, lora_modules,
                                    kv_transfer, **prefill),
                        api_keys, routing is not None, catalog)


def _prefill_deployment(split: PrefillSplit, config: EngineConfig, actor_options: dict[str, Any] | None,
                        routing: PrefixRouting | None, max_waiting: int | None,
                        lora_modules: tuple[LoRAModule, ...]) -> dict[str, Any]:
    """The decode replicas' arguments that reach the prefill deployment: its bound deployment (the decode replicas'
    model and settings, with the engine settings `split` sets apart; routed by prefix when it has several replicas)
    and the wait's bound. ValueError naming the `prefill` setting that is wrong."""
    routing = replace(routing, transfer=False) if routing is not None and _several(
        split.num_replicas, split.autoscaling_config) else None
    try:
        prefill_config = replace(config, **split.engine)
        options = model_server_options(prefill_config, split.num_replicas, split.autoscaling_config,
                                       split.ray_actor_options or actor_options, routing)
    except ValueError as e:
        raise ValueError(f"prefill: {e}") from None
    servers = ModelServer.options(name=PREFILL_DEPLOYMENT, **options).bind(
        prefill_config, max_waiting, routing is not None, 0, lora_modules, serves_prefills=True)
    return {"prefill_servers": servers, "prefill_timeout_s": split.timeout_s}


def _several(num_replicas: int | None, autoscaling: dict[str, Any] | None) -> bool:
    """Whether a deployment may run more than one replica (a router then has a choice to make)."""
    return autoscaling is not None or (num_replicas or 1) > 1
