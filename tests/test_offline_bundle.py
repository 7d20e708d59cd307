"""scripts/offline_bundle.py for real: the bundle built from PyPI for Python 3.12, installed with no index into a
fresh 3.12 environment that holds a GPU image's usual packages (older grpcio and protobuf among them), then Ray
started by `serve run` there, answering over Serve's HTTP proxy and, with the bundled grpcio, its gRPC proxy.
torch is not in that environment (the node's image has it), so pagedserve's own app is not served here: the
GPU check runs deploy/gpu.yaml from such a bundle (benchmarks/gpu_check.sh serve)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def find_python312() -> str | None:
    """A Python 3.12 that runs: on PATH (a pyenv shim may name one it will not run), else one of pyenv's."""
    pyenv = sorted(map(str, Path.home().glob(".pyenv/versions/3.12*/bin/python3.12")))
    candidates = [shutil.which("python3.12"), *pyenv]
    for python in filter(None, candidates):
        if subprocess.run([python, "-c", "pass"], capture_output=True).returncode == 0:
            return python
    return None


PYTHON312 = find_python312()
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]  # also run as a script (--prepare)
from offline_bundle import IMAGE_HAS  # noqa: E402

from tests.processes import stop_process_group  # noqa: E402

# The image's packages that the bundle leaves to it, less the large ones serving without a model never imports,
# at versions older than the bundle's where it matters.
TOO_LARGE = {"torch", "triton", "transformers", "tokenizers", "huggingface-hub", "hf-xet", "safetensors", "sympy",
             "networkx", "mpmath", "sentencepiece"}
IMAGE = sorted(IMAGE_HAS - TOO_LARGE) + ["protobuf==5.29.3", "grpcio==1.70.0"]

APP = '''
from fastapi import FastAPI
from ray import serve

api = FastAPI()


@serve.deployment
@serve.ingress(api)
class Echo:
    @api.get("/hello")
    def hello(self) -> dict:
        return {"hello": "world"}


app = Echo.bind()
'''
CONFIG = '''
http_options: {host: 127.0.0.1, port: 8000}
grpc_options:
  port: 9000
  grpc_servicer_functions: [grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server]
applications:
  - {name: echo, route_prefix: /, import_path: "app:app"}
'''


CACHE = Path.home() / ".cache" / "pagedserve"
BUNDLE_DOWNLOADS = CACHE / "bundle-downloads"
IMAGE_WHEELS = CACHE / "image-wheels-py312"


def prepare() -> None:
    """Download what the test needs while there is network (`make test` does, before the tests enter their
    loopback-only namespace): the bundle's wheels and the image's, for Python 3.12."""
    if PYTHON312 is None:
        print("no python3.12: the offline bundle test will skip")
        return
    try:
        subprocess.run([sys.executable, str(ROOT / "scripts" / "offline_bundle.py"), str(CACHE / "unused"),
                        "--python", "3.12", "--download-only", "--cache", str(BUNDLE_DOWNLOADS)], check=True)
        subprocess.run([PYTHON312, "-m", "pip", "download", "-q", "--only-binary=:all:", "-d", str(IMAGE_WHEELS),
                        *IMAGE], check=True)
    except subprocess.CalledProcessError as e:  # no network: the test says so when it skips
        shutil.rmtree(IMAGE_WHEELS, ignore_errors=True)
        print(f"offline bundle test downloads failed ({e}): it will skip")


@pytest.mark.slow
@pytest.mark.standalone
@pytest.mark.skipif(PYTHON312 is None, reason="no python3.12 to build the bundle for and install it into")
def test_offline_bundle_installs_and_serves_without_an_index(tmp_path):
    if not IMAGE_WHEELS.is_dir():
        pytest.skip("no downloads: run `python tests/test_offline_bundle.py --prepare` where there is network")
    bundle = tmp_path / "bundle"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "offline_bundle.py"), str(bundle), "--python", "3.12",
                    "--xz-preset", "0", "--cache", str(BUNDLE_DOWNLOADS)], check=True, timeout=900)
    assert len(list((bundle / "wheels").glob("*.whl"))) > 20 and list(bundle.glob("ray-*-serve.tar.xz"))
    env_dir = tmp_path / "image"
    subprocess.run([PYTHON312, "-m", "venv", str(env_dir)], check=True)
    python = env_dir / "bin" / "python"
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(IMAGE_WHEELS), *IMAGE],
                   check=True, timeout=600)
    site = tmp_path / "site"
    subprocess.run(["bash", str(bundle / "install.sh"), str(site)], check=True, env=dict(os.environ, PYTHON=python))
    assert not (site / "ray" / "rllib").exists() and (site / "ray" / "serve").is_dir()
    env = dict(os.environ, PYTHONPATH=f"{site}:{tmp_path}")
    versions = subprocess.run([python, "-c", "import grpc, google.protobuf, ray; print(grpc.__version__, "
                               "google.protobuf.__version__, ray.__version__)"],
                              env=env, capture_output=True, text=True, check=True).stdout.split()
    assert versions[0] != "1.70.0" and not versions[1].startswith("5."), "the bundled grpcio and protobuf win"
    # What serving imports, all from the bundle or the image, and pagedserve's committed stubs and SDK on the bundled
    # grpcio and protobuf (the stubs refuse older ones). xgrammar imports torch, which the node's image has and this
    # environment leaves out: its import has to get as far as torch.
    imports = ("import fastapi, gguf, grpc_health.v1.health_pb2_grpc, grpc_status.rpc_status, pydantic, starlette, "
               "uvicorn, ray.serve\nfrom grpc_reflection.v1alpha import reflection\n"
               "from pagedserve.protos import pagedserve_pb2_grpc\nfrom pagedserve.client.sdk import Client\n"
               "try:\n    import xgrammar\nexcept ModuleNotFoundError as e:\n    print('missing', e.name)\n")
    out = subprocess.run([python, "-c", imports], env=dict(env, PYTHONPATH=f"{ROOT}:{site}"), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["missing", "torch"], out.stdout + out.stderr
    (tmp_path / "app.py").write_text(APP)
    (tmp_path / "config.yaml").write_text(CONFIG)
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([site / "bin" / "serve", "run", "config.yaml"], cwd=tmp_path, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        reply = ""
        for _ in range(90):
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen("http://127.0.0.1:8000/hello", timeout=5) as r:
                    reply = r.read().decode()
                break
            except OSError:  # the proxy not up, or the app not yet deployed (404)
                time.sleep(2)
        assert reply == '{"hello":"world"}', (tmp_path / "serve.log").read_text()[-3000:]
        # Serve's gRPC proxy, on the bundled grpcio, routes a call to the app (which has no such method)
        grpc_call = ("import grpc\nfrom grpc_health.v1 import health_pb2, health_pb2_grpc\n"
                     "stub = health_pb2_grpc.HealthStub(grpc.insecure_channel('127.0.0.1:9000'))\n"
                     "try:\n    stub.Check(health_pb2.HealthCheckRequest(), metadata=(('application', 'echo'),), "
                     "timeout=30)\nexcept grpc.RpcError as e:\n    print(e.details())\n")
        out = subprocess.run([python, "-c", grpc_call], env=env, capture_output=True, text=True, timeout=60)
        assert "'Check' that does not exist" in out.stdout, out.stdout + out.stderr
    finally:
        stop_process_group(proc)


if __name__ == "__main__" and sys.argv[1:] == ["--prepare"]:
    prepare()
