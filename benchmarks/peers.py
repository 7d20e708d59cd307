"""Benchmark peers run beside pagedserve in the same script: llama.cpp's llama-server (two builds of it), and the
guidellm load generator. All are built or installed by benchmarks/setup_peers.sh into their own directories."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PEERS_DIR = Path(os.environ.get("PAGEDSERVE_PEERS_DIR", Path(__file__).resolve().parent / ".peers"))
# setup_peers.sh's two llama.cpp builds, by the build directory each lives in: a portable one (AVX2, FMA, F16C), and
# one for the CPU it was built on, as pagedserve's kernels are, less AMX: a native build with AMX died at model
# load in ggml's AMX kernel on an AMX-capable Xeon VM (and before on AMD EPYC machines).
LLAMA_BUILDS = {"portable": "build", "native": "build-native-noamx"}
LLAMA_BUILD_TITLES = {"portable": "portable AVX2 build",
                      "native": "native build without AMX, -DGGML_NATIVE=ON -mno-amx-*"}


def peer_binary(name: str, build: str = "portable") -> Path:
    """llama-server (of llama.cpp `build`, a key of LLAMA_BUILDS), llama-quantize (portable build) or guidellm,
    from setup_peers.sh's directories (or $LLAMA_SERVER / $LLAMA_SERVER_NATIVE, $LLAMA_QUANTIZE, $GUIDELLM)."""
    if name == "guidellm":
        env, default, target = "GUIDELLM", PEERS_DIR / "guidellm" / "bin" / "guidellm", "guidellm"
    else:
        if name == "llama-quantize":
            build = "portable"  # built with the portable llama-server only: its output does not depend on the CPU
        env = name.upper().replace("-", "_") + ("_NATIVE" if build == "native" else "")
        default = PEERS_DIR / "llama.cpp" / LLAMA_BUILDS[build] / "bin" / name
        target = f"llama-server-{build}"
    path = Path(os.environ.get(env, default))
    if not path.is_file():
        raise FileNotFoundError(f"{name} not found at {path}: run `bash benchmarks/setup_peers.sh {target}` "
                                f"(or set ${env})")
    return path


def system_info_features(text: str) -> str | None:
    """The CPU features in a llama.cpp log's system_info line ("SSE3 AVX AVX2 ... AMX_INT8"), those that are on."""
    for line in text.splitlines():
        if "system_info:" in line and "CPU :" in line:
            cpu = line.split("CPU :", 1)[1]
            return " ".join(part.split("=")[0].strip() for part in cpu.split("|") if part.strip().endswith("= 1"))
    return None


def llama_cpu_features(build: str = "portable") -> str:
    """The CPU features llama.cpp `build` was built with and runs with here: what tells the builds apart on a given
    CPU. Read from its system_info, which llama-server logs only at a verbosity that would also log every request:
    so from a start of its own on a model that does not exist, which stops right after that line."""
    binary = peer_binary("llama-server", build)
    with tempfile.TemporaryDirectory() as d:
        run = subprocess.run([str(binary), "-lv", "4", "-m", str(Path(d) / "none.gguf")], capture_output=True,
                             text=True, timeout=60, stdin=subprocess.DEVNULL)
    features = system_info_features(run.stdout + run.stderr)
    if features is None:
        raise RuntimeError(f"{binary} gave no system_info (exit code {run.returncode})")
    return features


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    """Poll `url` until it answers 200; fail early if `proc` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            code = proc.returncode
            how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"
            raise RuntimeError(f"server {how} before {url} answered")
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


def llama_server_cmd(gguf: Path, *, parallel: int, context_per_slot: int, port: int = 8090,
                     threads: int | None = None, build: str = "portable") -> tuple[list[str], str]:
    """The command of llama-server of llama.cpp `build` (a key of LLAMA_BUILDS) on 127.0.0.1:`port` with
    `parallel` slots (continuous batching), and its base URL."""
    threads = threads or os.cpu_count() or 1
    cmd = [str(peer_binary("llama-server", build)), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "-np", str(parallel), "-c", str(parallel * context_per_slot), "-t", str(threads), "-tb", str(threads),
           "--no-webui"]
    return cmd, f"http://127.0.0.1:{port}"


@contextmanager
def llama_server(gguf: Path, *, parallel: int, context_per_slot: int, port: int = 8090,
                 threads: int | None = None, log_path: Path | None = None, build: str = "portable") -> Iterator[str]:
    """`llama_server_cmd`'s server, running; yields its base URL."""
    cmd, url = llama_server_cmd(gguf, parallel=parallel, context_per_slot=context_per_slot, port=port,
                                threads=threads, build=build)
    with server_process(cmd, url + "/health", log_path):
        yield url


def timed_completions(url: str, prompts: list[list[int]], outputs: list[int], sampling: dict) -> tuple[list[dict],
                                                                                                   float]:
    """All `prompts` (token ids) at once through llama-server's /completion at `url`, each for its `outputs` tokens
    (ignore_eos, no prompt cache) with `sampling`'s fields, after a short warm-up request: the replies, in order,
    and the seconds they took together."""
    from concurrent.futures import ThreadPoolExecutor

    def run(prompt: list[int], n: int) -> dict:
        body = {"prompt": prompt, "n_predict": n, "ignore_eos": True, "cache_prompt": False, **sampling}
        return post_json(url + "/completion", body)

    run(prompts[0][:8], 4)  # warm-up
    with ThreadPoolExecutor(len(prompts)) as pool:
        start = time.perf_counter()
        replies = list(pool.map(run, prompts, outputs))
        return replies, time.perf_counter() - start


def post_json(url: str, body: dict, timeout_s: float = 3600) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def peer_versions() -> dict[str, str]:
    """What setup_peers.sh installed, for a benchmark's description of its run: the llama.cpp tree's source and
    ggml version, each llama-server build present, and guidellm's version."""
    found: dict[str, str] = {}
    tree = PEERS_DIR / "llama.cpp"
    ggml_cmake = tree / "ggml" / "CMakeLists.txt"
    if ggml_cmake.is_file():
        parts = re.findall(r"set\(GGML_VERSION_(?:MAJOR|MINOR|PATCH) (\d+)\)", ggml_cmake.read_text())
        source = (tree / "SOURCE").read_text().strip() if (tree / "SOURCE").is_file() else "source unrecorded"
        found["llama.cpp"] = f"ggml {'.'.join(parts)} ({source})"
        for build, title in LLAMA_BUILD_TITLES.items():
            with contextlib.suppress(FileNotFoundError):
                found[f"llama-server {build}"] = f"{peer_binary('llama-server', build)} ({title})"
    for info in sorted(PEERS_DIR.glob("guidellm/lib/python*/site-packages/guidellm-*.dist-info")):
        found["guidellm"] = info.name.removeprefix("guidellm-").removesuffix(".dist-info")
    return found
