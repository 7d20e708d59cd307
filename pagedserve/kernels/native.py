"""The CPU kernel in csrc/, built with the system C compiler on first use and cached per machine.

Built for the machine it runs on (-march=native): the cache key covers the source, the flags, the
compiler and the CPU's feature flags, so a home directory shared by different CPUs gets one build each.
Plain C loaded through ctypes rather than a torch extension: it builds in about a second, with no torch
headers, and runs on whatever torch version is installed.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from pagedserve.cache_dir import cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
# -ffast-math lets the reductions and expf vectorize; -fopenmp links libgomp.so.1, which resolves to the
# copy torch has already loaded, so the kernel shares torch's threads.
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-shared", "-std=gnu11"]

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


def compiler() -> str:
    return os.environ.get("CC", "cc")


@functools.cache
def paged_decode_library() -> ctypes.CDLL | None:
    """The built kernel, or None (logged) where it cannot be built here."""
    cc = shutil.which(compiler())
    if cc is None:
        log.warning("no C compiler (%s) on PATH: the CPU attention uses the slower torch reference", compiler())
        return None
    try:
        path = _build(cc)
    except (OSError, subprocess.CalledProcessError) as e:
        detail = e.stderr.strip() if isinstance(e, subprocess.CalledProcessError) else str(e)
        log.warning("building the CPU attention kernel failed, using the slower torch reference: %s", detail)
        return None
    lib = ctypes.CDLL(str(path))
    lib.paged_decode_supports.argtypes = [_i64, _i64, _i64, _i64]
    lib.paged_decode_supports.restype = ctypes.c_int
    lib.paged_decode_attention.argtypes = [_ptr, _ptr, ctypes.c_int, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64,
                                           _i64, _i64, _i64, _i64, _i64, ctypes.c_float, ctypes.c_int]
    lib.paged_decode_attention.restype = ctypes.c_int
    return lib


def _build(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    key = "\n".join([SOURCE.read_text(), " ".join(FLAGS), cc, version, platform.machine(), _cpu_flags()])
    target = cache_root() / "kernels" / f"{SOURCE.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: concurrent processes never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True, check=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built the CPU attention kernel: %s", target)
    return target


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()
