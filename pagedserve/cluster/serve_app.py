"""The Ray Serve application: `EngineServer` (one deployment replica per model replica) and `Ingress`
(the gRPC service and the OpenAI-compatible routes), separate deployments as in Ray Serve LLM.

    serve run deploy/config.yaml      # import_path: pagedserve.cluster.serve_app:build_app
"""

from __future__ import annotations

from typing import Any

from pagedserve.cluster.auth import ApiKeys
from pagedserve.cluster.engine_server import EngineServer
from pagedserve.cluster.openai_api import Ingress
from pagedserve.config import ray_hosted_config


def build_app(args: dict[str, Any] | None = None):
    """Serve application builder (deploy/config.yaml `args`): engine settings of EngineConfig plus
    `num_replicas` (model replicas), `max_waiting_requests` (queue bound before RESOURCE_EXHAUSTED) and
    `api_keys` (a key or a list; null: the PAGEDSERVE_API_KEY environment variable, else no key)."""
    args = dict(args or {})
    num_replicas = int(args.pop("num_replicas", 1))
    max_waiting = args.pop("max_waiting_requests", None)
    api_keys = ApiKeys.resolve(args.pop("api_keys", None))
    config = ray_hosted_config(args)  # fails at deploy time, naming the bad setting
    engine = EngineServer.options(num_replicas=num_replicas).bind(config, max_waiting)
    return Ingress.bind(engine, num_replicas, api_keys)
