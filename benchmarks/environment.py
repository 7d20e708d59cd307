"""Where a benchmark ran: the commit, the machine and the library versions, printed at the start of every
benchmark's output and kept in its JSON, so that a figure can be traced to the code and the CPU or GPU that
produced it (this project's CPU kernels are built for the CPU they run on, so the CPU's ISA matters).

  python benchmarks/environment.py          # the description as text
  python benchmarks/environment.py --json   # as JSON
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The libraries whose versions move the figures: the model code and CPU kernels (torch), the HF peer
# (transformers), the GPU kernels (triton), serving (ray), grammars (xgrammar, and llguidance where the grammar
# benchmark's peer is installed).
LIBRARIES = ("torch", "transformers", "triton", "ray", "xgrammar", "llguidance")
# The ISA extensions the CPU kernels (and llama.cpp's native build) choose their code by.
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (every core reports the same on the machines here)."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _gpu() -> str | None:
    """The first CUDA device's name, where torch is installed and sees one."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    count = torch.cuda.device_count()
    return torch.cuda.get_device_name(0) + (f" (x{count})" if count > 1 else "")


def versions() -> dict[str, str]:
    """Python's version and those of LIBRARIES that are installed."""
    found = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def describe() -> dict:
    """The run's description: commit (and whether the working tree differs from it), date, CPU model (and its
    vendor's numbers, and whether it is a VM's), logical cores, the ISA flags of ISA_FLAGS the CPU has, memory,
    GPU (None without CUDA), library versions."""
    changed = _git("status", "--porcelain", "--untracked-files=no")
    cpu = _cpuinfo()
    flags = set(cpu.get("flags", "").split())
    return {
        "commit": _git("rev-parse", "HEAD"),
        "dirty": None if changed is None else bool(changed),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu": cpu.get("model name") or platform.processor() or platform.machine(),
        # A VM's model name can be generic ("Intel(R) Xeon(R) Processor"): the vendor's numbers name the part.
        "cpu_id": " ".join(f"{label}{cpu[key]}" for key, label in (("vendor_id", ""), ("cpu family", "family "),
                                                                  ("model", "model "), ("stepping", "stepping "))
                           if key in cpu),
        "virtual_machine": "hypervisor" in flags,
        "cores": os.cpu_count(),
        "isa": [f for f in ISA_FLAGS if f in flags],
        "memory_gib": _memory_gib(),
        "gpu": _gpu(),
        "versions": versions(),
    }


def as_text(env: dict) -> str:
    """The description in three lines, as each benchmark prints it first."""
    commit = (env["commit"] or "unknown")[:12] + (" (working tree differs)" if env["dirty"] else "")
    lines = [f"run: commit {commit}, {env['date']}",
             f"machine: {env['cpu']} ({env['cpu_id']}{', a VM' if env['virtual_machine'] else ''}), "
             f"{env['cores']} logical cores, {env['memory_gib']} GiB; "
             f"ISA: {' '.join(env['isa']) or 'none of ' + ', '.join(ISA_FLAGS[:4])}; GPU: {env['gpu'] or 'none'}",
             "versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items())]
    return "\n".join(lines)


def announce() -> dict:
    """Print the description (before anything the benchmark prints) and return it, for the JSON output."""
    env = describe()
    print(as_text(env), flush=True)
    return env


if __name__ == "__main__":
    print(json.dumps(describe(), indent=2) if "--json" in sys.argv[1:] else as_text(describe()))
