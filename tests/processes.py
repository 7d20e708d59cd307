"""Stopping what a test started, and only that: the suite's parts run side by side, each with a Ray of its own."""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess

import psutil


@functools.cache
def own_pid_namespace() -> list[str]:
    """The prefix that runs a command as the first process of a PID namespace of its own where we can (root and
    util-linux's unshare), else none. When that process exits the kernel ends everything it left behind, and a
    `ray stop` inside sees only the Ray started there (outside, it stops every Ray on the machine)."""
    prefix = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return []
    return prefix if subprocess.run([*prefix, "true"], capture_output=True).returncode == 0 else []


def stop_process_group(proc: subprocess.Popen, timeout: float = 60) -> None:
    """Ctrl-C to `proc`'s process group, as a user stops `serve run` (Serve and the local Ray it started shut down),
    SIGKILL to the group after `timeout`; then to every process it had started that is still there."""
    try:
        started = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        started = []
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for child in started:
        try:
            child.kill()  # psutil checks the pid still names the process it listed
        except psutil.NoSuchProcess:
            pass
