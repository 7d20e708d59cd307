"""A Ray cluster of two nodes on this machine (`scripts/netns-cluster.sh`: each node in a network namespace and a PID
namespace of its own, joined by virtual links, with addresses that exist only inside them), and Serve across it: one
model replica per node, the prefix router choosing between them, KV blocks moved from one node to the other
(`tests/cluster_driver.py`, run on the head node)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.processes import own_pid_namespace
from tests.test_cluster_external import _netns_available

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "netns-cluster.sh"
ENV = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", HF_HUB_OFFLINE="1",
           NODE_ARGS="--object-store-memory=300000000")


@pytest.fixture(scope="module")
def cluster():
    name = f"pc{uuid.uuid4().hex[:6]}"
    try:
        subprocess.run([SCRIPT, "up", name, "2", "2"], check=True, env=ENV, timeout=300, capture_output=True)
        yield name
    finally:
        subprocess.run([SCRIPT, "down", name], env=ENV, timeout=60)


@pytest.mark.slow
@pytest.mark.standalone
@pytest.mark.skipif(not _netns_available(), reason="needs root and `ip netns` for the nodes' namespaces")
@pytest.mark.skipif(not own_pid_namespace(), reason="needs util-linux's unshare for the nodes' PID namespaces")
def test_replicas_on_two_nodes_route_by_prefix_and_move_kv_between_them(cluster, tiny_random):
    proc = subprocess.run([SCRIPT, "exec", cluster, "0", sys.executable, "-m", "tests.cluster_driver", tiny_random],
                          env=ENV, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "replicas on ['10.88.0.1', '10.88.0.2']" in proc.stdout
