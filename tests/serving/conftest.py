"""One Serve deployment of deploy/config.yaml (tiny random model by override) for every test of this
package, through real Ray Serve, real gRPC and real HTTP. Four applications: "pagedserve" (open, decoding
speculatively, with a KV offload tier), "bounded" (a queue of one, for RESOURCE_EXHAUSTED), "keyed" (API keys
required) and "smol" (the embedded SmolLM2 instead of the tiny random model); "routed" (two replicas behind the
prefix-aware router) for the modules that need two; modules add their own for their tests alone. Run inside
`make test`'s loopback-only network namespace: Serve's gRPC proxy binds every interface."""

from __future__ import annotations

import time
import warnings

import grpc  # noqa: F401
import pytest
import ray
import yaml

with warnings.catch_warnings():  # Ray Serve's own pydantic deprecation warnings, at its import: not ours
    warnings.simplefilter("ignore", DeprecationWarning)
    from ray import serve


from pagedserve import LLM
from pagedserve.serving.model_server import replica_stats
from tests.serving.app import (
    API_KEYS,
    BLOCK_BYTES,
    CONFIG,
    GRPC,
    MAX_MODEL_LEN,
    METRICS_PORT,
    POOL_BLOCKS,
    ROUTED,
    SPECULATIVE,
)


@pytest.fixture(scope="package")
def app(tiny_random, tmp_path_factory):
    from pagedserve.serving.serve_app import build_app

    config = yaml.safe_load(CONFIG.read_text())
    ray.init(num_cpus=16, include_dashboard=False, _metrics_export_port=METRICS_PORT,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
    serve.start(http_options=config["http_options"], grpc_options=config["grpc_options"])
    spec = config["applications"][0]
    args = dict(spec["args"], model=tiny_random, max_model_len=MAX_MODEL_LEN, kv_cache_memory=POOL_BLOCKS * BLOCK_BYTES)
    # The open application decodes speculatively and keeps evicted blocks in a disk tier: every test of it (greedy
    # tokens equal to the offline engine's without either, streams, cancellation, preemption, metrics) holds
    # through verification steps and restored blocks too.
    tier = dict(kv_offload_disk=4 * POOL_BLOCKS * BLOCK_BYTES, kv_offload_dir=str(tmp_path_factory.mktemp("tier")))
    # Deployed at once: their replicas start side by side, and one wait covers them all.
    serve.run_many([
        serve.RunTarget(build_app(dict(args, speculative_config=SPECULATIVE, **tier)), name=spec["name"],
                        route_prefix=spec["route_prefix"]),
        serve.RunTarget(build_app(dict(args, max_num_seqs=1, max_waiting_requests=1)), name="bounded",
                        route_prefix="/bounded"),
        serve.RunTarget(build_app(dict(args, api_keys=API_KEYS)), name="keyed", route_prefix="/keyed"),
        # The embedded SmolLM2, for answers that must make sense (structured outputs)
        serve.RunTarget(build_app(dict(spec["args"], max_model_len=2048, kv_cache_memory=256 << 20)), name="smol",
                        route_prefix="/smol"),
    ])
    yield spec["name"]
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="package")
def routed_app(app, tiny_random):
    """Two replicas of the tiny model behind the prefix-aware router: the application of the tests of routing
    (test_prefix_routing.py) and of replicas' placement (test_scale_out.py)."""
    from pagedserve.serving.serve_app import build_app

    serve.run(build_app({"model": tiny_random, "max_model_len": MAX_MODEL_LEN, "num_replicas": 2, "max_num_seqs": 4,
                         "kv_cache_memory": 160 * BLOCK_BYTES,
                         # every fetch a router names a holder for, whatever the cost model (the tiny model's
                         # prefill is cheaper than any transfer): the transfer is what is tested
                         "prefix_routing": {"imbalance_threshold": 2, "transfer": "always"}}),
              name=ROUTED, route_prefix=f"/{ROUTED}")
    yield ROUTED
    serve.delete(ROUTED)


@pytest.fixture
def routed(routed_app):
    """`routed_app` once both its replicas run (a test may have killed one, which Serve replaces)."""
    deadline = time.monotonic() + 120
    while True:
        status = serve.status().applications[routed_app]
        try:
            if status.status == "RUNNING" and len(replica_stats(routed_app)) == 2:
                return routed_app
        except ray.exceptions.RayError:  # a replica going away while asked
            pass
        assert time.monotonic() < deadline, f"{routed_app} is not running two replicas: {status}"
        time.sleep(0.5)


@pytest.fixture(scope="package")
def offline(tiny_random):
    llm = LLM(tiny_random, max_model_len=MAX_MODEL_LEN)
    yield llm
    llm.shutdown()


@pytest.fixture
def client(app):
    from pagedserve.client import Client

    with Client(GRPC, application=app, timeout=120) as c:
        yield c
