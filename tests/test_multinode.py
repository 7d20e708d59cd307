"""A Ray cluster of two nodes on this machine (`scripts/netns-cluster.sh`: each node in a network namespace and a PID
namespace of its own, joined by virtual links, with addresses that exist only inside them), and Serve across it: one
model replica per node, the prefix router choosing between them, KV blocks moved from one node to the other; the
Ray dashboard in a browser and Prometheus scraping both nodes; then the faults a cluster meets, each under load: the
Serve controller restarted, a link down and back, a worker actor killed, a forward pass that raises, a whole node
lost and back. Each test runs a scenario of `tests/cluster_driver.py` on the head node, in order, on one deployment;
each scenario ends with the application whole again."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.browser import chromium
from tests.processes import own_pid_namespace
from tests.serving.test_monitoring import prometheus_binary
from tests.test_cluster_external import _netns_available

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "netns-cluster.sh"
ENV = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", HF_HUB_OFFLINE="1",
           NODE_ARGS="--object-store-memory=300000000", DASHBOARD="true")

pytestmark = [
    pytest.mark.slow, pytest.mark.standalone,
    pytest.mark.skipif(not _netns_available(), reason="needs root and `ip netns` for the nodes' namespaces"),
    pytest.mark.skipif(not own_pid_namespace(), reason="needs util-linux's unshare for the nodes' PID namespaces"),
]


def _drive(cluster: str, model: str, scenario: str, **env: str) -> str:
    proc = subprocess.run([SCRIPT, "exec", cluster, "0", sys.executable, "-m", "tests.cluster_driver", cluster,
                           model, scenario], env=dict(ENV, **env), cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    print(proc.stdout)  # what each load's calls came to (pytest -s, or -rP)
    return proc.stdout


@pytest.fixture(scope="module")
def deployed(tiny_random):
    """The cluster up and the application deployed on it: (cluster name, model)."""
    name = f"pc{uuid.uuid4().hex[:6]}"
    try:
        up = subprocess.run([SCRIPT, "up", name, "2", "2"], env=ENV, timeout=420, capture_output=True, text=True)
        logs = sorted(Path("/run/pagedserve-netns-cluster", name).glob("node-*.log"))
        assert up.returncode == 0, up.stderr[-2000:] + "".join(f"\n{f}:\n{f.read_text()[-3000:]}" for f in logs)
        _drive(name, tiny_random, "deploy")
        yield name, tiny_random
        _drive(name, tiny_random, "shutdown")
    finally:
        subprocess.run([SCRIPT, "down", name], env=ENV, timeout=60)


def test_replicas_on_two_nodes_route_by_prefix_and_move_kv_between_them(deployed):
    assert "replicas on ['10.88.0.1', '10.88.0.2']" in _drive(*deployed, "routes_and_moves_kv")


@pytest.mark.skipif(chromium() is None, reason="no chromium: scripts/install-test-tools.sh installs Debian's")
def test_the_ray_dashboard_lists_the_application_and_its_replicas_in_a_browser(deployed, tmp_path):
    out = _drive(*deployed, "dashboard", SCREENSHOTS=str(tmp_path))
    assert "the dashboard lists spread and its replicas" in out
    assert (tmp_path / "ray-dashboard-serve.png").stat().st_size > 10_000


@pytest.mark.skipif(prometheus_binary() is None, reason="no Prometheus: scripts/install-test-tools.sh fetches Debian's")
def test_prometheus_with_rays_configuration_scrapes_every_node(deployed):
    assert "Prometheus scraped ['10.88.0.1', '10.88.0.2']" in _drive(*deployed, "prometheus")


def test_the_serve_controller_restarted_under_load_loses_no_request(deployed):
    _drive(*deployed, "controller_restarted")


def test_a_link_down_for_seconds_under_load_loses_no_request(deployed):
    _drive(*deployed, "link_down")


def test_a_worker_actor_killed_under_load_fails_only_what_it_was_computing(deployed):
    _drive(*deployed, "worker_killed")


def test_a_forward_pass_that_raises_fails_its_step_and_the_engine_serves_on(deployed):
    _drive(*deployed, "forward_raises")


def test_a_node_lost_under_load_and_back(deployed):
    _drive(*deployed, "node_killed")
