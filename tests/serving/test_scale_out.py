"""Replicas Serve can place and heal: each ModelServer replica declares its placement group (the engine's
bundle and one per worker, packed) so Serve places it whole and the workers live in it; a replica that no
node could hold is refused at deploy time by name; `check_health` fails once a worker is gone, and Serve
replaces the replica."""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray
from ray import serve

from tests.serving.app import BLOCK_BYTES, MAX_MODEL_LEN, POOL_BLOCKS


def test_settings_that_cannot_work_are_refused_at_deploy_time(app):
    from pagedserve.serving.serve_app import build_app

    with pytest.raises(ValueError, match=r"tensor_parallel_size=64: one replica needs \{'CPU': 65"):
        build_app({"tensor_parallel_size": 64})  # no node of this 16-CPU cluster holds 65 CPUs
    with pytest.raises(ValueError, match="num_replicas and autoscaling_config: give one"):
        build_app({"num_replicas": 2, "autoscaling_config": {"max_replicas": 2}})
    with pytest.raises(ValueError, match="num_replicas=0"):
        build_app({"num_replicas": 0})
    with pytest.raises(ValueError, match=r"ray_actor_options has unsupported keys \['max_restarts'\]"):
        build_app({"ray_actor_options": {"max_restarts": 3}})
    with pytest.raises(ValueError, match="ray_actor_options.num_cpus=0"):
        build_app({"ray_actor_options": {"num_cpus": 0}})
    build_app({"autoscaling_config": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 8}})


def test_each_replica_is_one_packed_placement_group_holding_its_workers(routed):
    groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
    # One group per ModelServer replica, created by Serve: the engine's bundle, then the worker's. The
    # replicas make none of their own (they used to: one single-bundle group each).
    replica_groups = [g for g in groups if list(g["bundles"].values()) == [{"CPU": 1.0}, {"CPU": 1.0}]]
    assert all(g["strategy"] == "STRICT_PACK" for g in replica_groups)
    assert not [g for g in groups if len(g["bundles"]) == 1], groups
    engine_servers = [a for a in ray.util.list_named_actors(all_namespaces=True) if "ModelServer" in a["name"]]
    assert len(replica_groups) == len(engine_servers) >= 2
    # and each replica's engine and worker run in them: both bundles' CPUs are in use
    total, free = ray.cluster_resources(), ray.available_resources()
    for g in replica_groups:
        for index in (0, 1):
            key = f"CPU_group_{index}_{g['placement_group_id']}"
            assert total[key] == 1.0 and free.get(key, 0.0) == 0.0, key



def test_model_info_counts_the_replicas_running(routed):
    from pagedserve.client import Client
    from tests.serving.app import GRPC

    with Client(GRPC, application=routed, timeout=60) as client:
        assert client.model_info()["num_replicas"] == 2


def test_check_health_fails_when_a_worker_is_gone_and_serve_replaces_the_replica(app, tiny_random):
    from pagedserve.client import Client
    from pagedserve.config import ray_hosted_config
    from pagedserve.serving.ingress import Ingress
    from pagedserve.serving.model_server import ModelServer, model_server_options
    from tests.serving.app import GRPC

    config = ray_hosted_config({"model": tiny_random, "max_model_len": MAX_MODEL_LEN,
                                "kv_cache_memory": POOL_BLOCKS * BLOCK_BYTES})
    # build_app's deployments, Serve checking the replica every second (not every 10): it finds it unhealthy sooner
    server = ModelServer.options(**model_server_options(config), health_check_period_s=1).bind(config)
    serve.run(Ingress.bind(server), name="healing", route_prefix="/healing")
    try:
        handle = serve.get_deployment_handle("ModelServer", "healing")
        handle.check_health.remote().result()
        (pid,) = handle.worker_pids.remote().result()
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while True:  # the worker's death takes a moment to reach its actor handle
            try:
                handle.check_health.remote().result()
            except Exception as e:
                assert "a worker actor is gone" in str(e)
                break
            assert time.monotonic() < deadline, "check_health kept passing with the worker dead"
            time.sleep(0.5)
        deadline = time.monotonic() + 120
        while True:  # Serve's own checks find it unhealthy and start a new replica, with new workers
            try:
                pids = handle.worker_pids.remote().result(timeout_s=10)
                if pids != [pid]:
                    handle.check_health.remote().result(timeout_s=10)
                    break
            except Exception:
                pass
            assert time.monotonic() < deadline, "the replica was not replaced"
            time.sleep(1)
        with Client(GRPC, application="healing", timeout=60) as c:
            assert len(c.generate("still here", max_tokens=4, ignore_eos=True).token_ids) == 4
    finally:
        serve.delete("healing")
