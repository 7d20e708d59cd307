"""Benchmark peers run beside pagedserve in the same script: llama.cpp's llama-server, and the guidellm load
generator. Both are built or installed by benchmarks/setup_peers.sh into their own directories."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PEERS_DIR = Path(os.environ.get("PAGEDSERVE_PEERS_DIR", Path(__file__).resolve().parent / ".peers"))


def peer_binary(name: str) -> Path:
    """llama-server, llama-quantize or guidellm, from setup_peers.sh's directories (or $LLAMA_SERVER,
    $LLAMA_QUANTIZE, $GUIDELLM)."""
    env = {"llama-server": "LLAMA_SERVER", "llama-quantize": "LLAMA_QUANTIZE", "guidellm": "GUIDELLM"}[name]
    default = {"llama-server": PEERS_DIR / "llama.cpp" / "build" / "bin" / "llama-server",
               "llama-quantize": PEERS_DIR / "llama.cpp" / "build" / "bin" / "llama-quantize",
               "guidellm": PEERS_DIR / "guidellm" / "bin" / "guidellm"}[name]
    path = Path(os.environ.get(env, default))
    if not path.is_file():
        target = "guidellm" if name == "guidellm" else "llama-server"  # llama-quantize comes with llama-server
        raise FileNotFoundError(f"{name} not found at {path}: run `bash benchmarks/setup_peers.sh {target}` "
                                f"(or set ${env})")
    return path


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    """Poll `url` until it answers 200; fail early if `proc` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout_s:.0f}s")


def stop(proc: subprocess.Popen) -> None:
    """SIGINT, then SIGKILL: the whole process group (servers start helpers of their own)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


@contextmanager
def server_process(cmd: list[str], ready_url: str, log_path: Path | None, timeout_s: float = 120,
                   **popen_kwargs) -> Iterator[subprocess.Popen]:
    """Start a server in its own session, wait until `ready_url` answers, stop it (and its helpers) after."""
    log = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, **popen_kwargs)
    try:
        wait_http(ready_url, timeout_s, proc)
        yield proc
    finally:
        stop(proc)
        if log_path:
            log.close()


@contextmanager
def llama_server(gguf: Path, *, parallel: int, context_per_slot: int, port: int = 8090,
                 threads: int | None = None, log_path: Path | None = None) -> Iterator[str]:
    """llama-server on 127.0.0.1:`port` with `parallel` slots (continuous batching); yields its base URL."""
    threads = threads or os.cpu_count() or 1
    cmd = [str(peer_binary("llama-server")), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "-np", str(parallel), "-c", str(parallel * context_per_slot), "-t", str(threads), "-tb", str(threads),
           "--no-webui"]
    url = f"http://127.0.0.1:{port}"
    with server_process(cmd, url + "/health", log_path):
        yield url


def post_json(url: str, body: dict, timeout_s: float = 3600) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())
