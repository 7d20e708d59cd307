"""`ray start --head` then the CLI with RAY_ADDRESS, as the README says, in a network namespace that has
only loopback (so nothing Ray binds is reachable from outside, and the node's address is 127.0.0.1)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import ray  # noqa: F401

from tests.processes import own_pid_namespace

BIN = Path(sys.executable).parent


def _netns_available() -> bool:
    if shutil.which("ip") is None or os.geteuid() != 0:
        return False
    probe = f"pagedserve-probe-{uuid.uuid4().hex[:6]}"
    ok = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    if ok:
        subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return ok


@pytest.mark.slow
@pytest.mark.standalone
@pytest.mark.skipif(not _netns_available(), reason="needs root and `ip netns` for a loopback-only namespace")
@pytest.mark.skipif(not own_pid_namespace(), reason="needs util-linux's unshare for a PID namespace")
def test_cli_on_an_existing_ray_cluster(tiny_random):
    ns = f"pagedserve-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"], check=True)
        # `ray stop` in a PID namespace of its own sees only this cluster (it stops every Ray it can see), and
        # its temp dir is its own: `ray start` records the cluster there, where a `ray.init()` would find it.
        script = f"""
set -e
export RAY_TMPDIR=$(mktemp -d)
trap '{BIN}/ray stop --force >/dev/null 2>&1; rm -rf "$RAY_TMPDIR"' EXIT
{BIN}/ray start --head --port=6391 --num-cpus=4 --include-dashboard=false --disable-usage-stats >/dev/null
RAY_AUTH_MODE=token RAY_ADDRESS=127.0.0.1:6391 {sys.executable} -m pagedserve.cli generate "Hello there" \\
    --model '{tiny_random}' --executor ray --tp 2 --max-tokens 5 --stats
"""
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        proc = subprocess.run(["ip", "netns", "exec", ns, *own_pid_namespace(), "bash", "-c", script],
                              capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "'tensor_parallel_size': 2" in proc.stderr
        assert "'num_free_blocks'" in proc.stderr
    finally:
        subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
