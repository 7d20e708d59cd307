"""The C kernels in csrc/, built with the system C compiler on first use and cached per machine.

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

CSRC = Path(__file__).with_name("csrc")
# -fopenmp links libgomp.so.1, which resolves to the copy torch has already loaded, so the kernels share
# torch's threads.
_COMMON_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11"]
# The attention kernel: -ffast-math lets its reductions and expf vectorize.
PAGED_ATTENTION_FLAGS = [*_COMMON_FLAGS, "-ffast-math"]
# The linear kernel rounds where it is written (the same order on every build and in every tile): no
# fast-math, no contraction of a product and a sum into one fused multiply-add.
QUANT_LINEAR_FLAGS = [*_COMMON_FLAGS, "-ffp-contract=off"]
# The layer's small ops round each product and sum as torch does (the norm in an order of its own): the same
# flags.
LAYER_OPS_FLAGS = QUANT_LINEAR_FLAGS
# The decoder's driver only calls the other kernels (no arithmetic of its own): the same flags.
DECODER_FLAGS = QUANT_LINEAR_FLAGS

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_PAGED_ATTENTION_ARGS = [_ptr, _ptr, ctypes.c_int, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64,
                         ctypes.c_float, ctypes.c_int]


def compiler() -> str:
    return os.environ.get("CC", "cc")


@functools.cache
def paged_attention_library() -> ctypes.CDLL | None:
    """The built attention kernel, or None (logged) where it cannot be built here."""
    return _library("paged_attention.c", PAGED_ATTENTION_FLAGS, "the CPU attention uses the slower torch reference", {
        "paged_attention_supports": ([_i64, _i64, _i64, _i64], ctypes.c_int),
        "paged_attention": (_PAGED_ATTENTION_ARGS, ctypes.c_int),
        # the same, then a sliding window (0: none), a soft cap (0: none) and attention sinks (NULL: none);
        # paged_attention keeps its signature for the one-call decoder
        "paged_attention_sinks": ([*_PAGED_ATTENTION_ARGS, _i64, ctypes.c_float, _ptr], ctypes.c_int)})



@functools.cache
def quant_linear_library() -> ctypes.CDLL | None:
    """The built linear kernel on GGUF blocks, or None (logged) where it cannot be built or run here."""
    lib = _library("quant_linear.c", QUANT_LINEAR_FLAGS, "linear layers use fp32 weights", {
        "quant_linear_supported": ([], ctypes.c_int),
        "quant_linear_panel_rows": ([], ctypes.c_int),
        "quant_linear_panel_block_bytes": ([ctypes.c_int], _i64),
        "quant_linear_panel_bytes": ([ctypes.c_int, _i64], _i64),
        "quant_linear": ([_ptr, _i64, _i64, _i64, _ptr, ctypes.c_int, _i64, _ptr, _ptr, _i64, ctypes.c_int],
                         ctypes.c_int),
        "quant_linear_rows": ([_ptr, ctypes.c_int, _i64, _i64, _ptr, _i64, _ptr], ctypes.c_int)})
    if lib is not None and not lib.quant_linear_supported():
        log.info("this CPU lacks AVX2/FMA/F16C: linear layers use fp32 weights")
        return None
    return lib


@functools.cache
def layer_ops_library() -> ctypes.CDLL | None:
    """The built RMSNorm, rotary embedding, K/V write and SiLU gate, or None (logged) where they cannot be built
    here."""
    return _library("layer_ops.c", LAYER_OPS_FLAGS, "the layers' small ops use torch's", {
        "rms_norm_f32": ([_ptr, _i64, _ptr, _i64, _ptr, ctypes.c_float, _ptr, _i64, _i64, _i64, ctypes.c_int], None),
        "rms_norm_heads_f32": ([_ptr, _i64, _i64, _ptr, ctypes.c_float, _ptr, _i64, _i64, _i64, _i64, _i64], None),
        "silu_mul_f32": ([_ptr, _i64, _ptr, _i64, _i64, _i64, ctypes.c_int], None),
        "rotate_qk_f32": ([_ptr, _i64, _i64, _i64, _ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _i64, _i64, _i64], None),
        "write_kv_f32": ([_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64],
                         ctypes.c_int),
        "route_topk_f32": ([_ptr, _i64, _i64, _i64, ctypes.c_int, _ptr, _ptr], None)})


@functools.cache
def decoder_library() -> ctypes.CDLL | None:
    """The built decoder driver (one call per step through the other kernels), or None (logged)."""
    return _library("decoder.c", DECODER_FLAGS, "the CPU decoder runs layer by layer in Python",
                    {"decoder_forward": ([_ptr, _ptr, _ptr, _ptr], ctypes.c_int),
                     "moe_experts": ([_ptr, _ptr, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, ctypes.c_int],
                                     ctypes.c_int)})


def _library(source: str, flags: list[str], fallback: str,
             signatures: dict[str, tuple[list, type | None]]) -> ctypes.CDLL | None:
    """`source` built and loaded, each function of `signatures` given its (argument types, result type); None
    (logged, with what `fallback` runs instead) where it cannot be built."""
    cc = shutil.which(compiler())
    if cc is None:
        log.warning("no C compiler (%s) on PATH: %s", compiler(), fallback)
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc, CSRC / source, flags)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = e.stderr.strip() if isinstance(e, subprocess.CalledProcessError) else str(e)
        log.warning("building %s failed, %s: %s", source, fallback, detail)
        return None
    for name, (argtypes, restype) in signatures.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, restype
    return lib


def _build(cc: str, source: Path, flags: list[str]) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    key = "\n".join([source.read_text(), " ".join(flags), cc, version, platform.machine(), _cpu_flags()])
    target = cache_root() / "kernels" / f"{source.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: concurrent processes never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *flags, str(source), "-o", tmp, "-lm"], capture_output=True, text=True, check=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built %s: %s", source.name, target)
    return target


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()
