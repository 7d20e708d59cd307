"""Triton paged-attention kernels vs torch SDPA on contiguous K/V (run on the GPU machine).

    PYTHONPATH=. python benchmarks/kernels.py            # H100/H200: the shapes below
    PYTHONPATH=. python benchmarks/kernels.py --smoke    # tiny shapes on CPU (Triton interpreter)
    PYTHONPATH=. python benchmarks/kernels.py --sweep    # time a grid of tile shapes, warps, stages, the
                                                         # prefill launch order and split counts per shape;
                                                         # print the fastest
    PYTHONPATH=. python benchmarks/kernels.py --only prefill   # the prefill shapes alone

Decode: bf16, block_size 16, shuffled block tables; each result is checked against the plain-torch
reference (fp32 on upcast inputs) and timed with triton.testing.do_bench (median). Bandwidth counts
the bytes of K, V, Q and O once for both implementations (block tables are noise). Prefill reports
TFLOP/s with causal FLOPs counted exactly (4 * D * Hq per visible query-key pair).
The sweep times each configuration in the engine's own call (decode with its max_query_len=1 and
max_context_len hints), drops any whose result is off the reference, and names one `Tiles` that is
closest to the fastest on every shape (the geometric mean of its time over each shape's fastest).
Needs only torch and triton (no ray, no gguf).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

# environment.py beside it, also where the tests import this module as benchmarks.kernels
sys.path.insert(0, str(Path(__file__).resolve().parent))

if "--smoke" in sys.argv:  # must precede the first triton import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from environment import announce  # noqa: E402

from pagedserve.kernels import reference as ref  # noqa: E402
from pagedserve.kernels.gpu import attention  # noqa: E402
from pagedserve.kernels.gpu.attention import paged_attention  # noqa: E402

MAX_REL_ERR = 1e-2  # bf16 outputs typically land near 3e-3
L2_BYTES = 50 * 2**20  # H100 L2; smaller inputs are rotated so timings do not run from cache


@dataclass
class DecodeShape:
    batch: int
    context: int
    q_heads: int
    kv_heads: int
    head_dim: int


@dataclass
class PrefillShape:
    batch: int
    new_tokens: int
    prefix: int
    q_heads: int
    kv_heads: int
    head_dim: int


GPU_DECODE = [DecodeShape(64, 4096, 16, 8, 128), DecodeShape(256, 1024, 14, 2, 64), DecodeShape(8, 32768, 32, 8, 128)]
GPU_PREFILL = [PrefillShape(8, 2048, 0, 32, 8, 128), PrefillShape(8, 2048, 2048, 32, 8, 128)]
SMOKE_DECODE = [DecodeShape(3, 100, 4, 2, 64), DecodeShape(2, 70, 14, 2, 80), DecodeShape(1, 1100, 4, 1, 64)]
SMOKE_PREFILL = [PrefillShape(2, 40, 0, 4, 2, 64), PrefillShape(2, 24, 40, 4, 2, 64)]


def grid(**axes: tuple) -> list[dict]:
    return [dict(zip(axes, values, strict=True)) for values in itertools.product(*axes.values())]


# Sweep grids: about 120 compilations and 200 timings on the GPU, within a few minutes.
GPU_DECODE_SWEEP = grid(decode_n=(32, 64, 128), decode_warps=(2, 4, 8), decode_stages=(2, 3, 4))
GPU_PREFILL_SWEEP = grid(prefill_m=(64, 128), prefill_n=(32, 64, 128), prefill_warps=(4, 8), prefill_stages=(2, 3),
                         prefill_heavy_first=(False, True))
GPU_SPLIT_SWEEP = (1, 2, 4, 8, 16, 32)
SMOKE_DECODE_SWEEP = grid(decode_n=(16, 32), decode_warps=(4,), decode_stages=(1,))
SMOKE_PREFILL_SWEEP = grid(prefill_m=(32, 64), prefill_n=(16, 32), prefill_warps=(4,), prefill_stages=(1,),
                           prefill_heavy_first=(False, True))
SMOKE_SPLIT_SWEEP = (1, 3)


def bench_ms(fns: list, device: torch.device) -> float:
    """Median milliseconds per call, cycling through `fns` (one closure per rotated input)."""
    state = {"i": 0}

    def step():
        fns[state["i"] % len(fns)]()
        state["i"] += 1

    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(step, warmup=25, rep=200, return_mode="median")
    step()  # the interpreter: a rough wall-clock figure, only to exercise this path
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[1]


def paged_pool(batch: int, context: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
               device: torch.device, gen: torch.Generator):
    """A pool holding `batch` sequences of `context` tokens in shuffled blocks, and their K/V made contiguous."""
    blocks_per_seq = math.ceil(context / block_size)
    num_blocks = batch * blocks_per_seq
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen, device=device,
                     dtype=torch.float32).to(dtype)  # [2, N, bs, Hkv, D]
    tables = torch.randperm(num_blocks, generator=gen, device=device).view(batch, blocks_per_seq)  # [B, nb]
    # Contiguous copies for SDPA: [B, Hkv, L, D].
    k = kv[0][tables].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    v = kv[1][tables].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    return kv, tables, k, v


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected).norm() / expected.norm()).item()


def rotations(bytes_per_input: int, smoke: bool) -> int:
    # do_bench also flushes L2 between calls; rotating inputs keeps small shapes honest regardless.
    if smoke:
        return 1
    return 1 if bytes_per_input > 2 * L2_BYTES else min(8, math.ceil(4 * L2_BYTES / bytes_per_input))


@dataclass
class DecodeCase:
    """A decode shape's inputs (rotated copies), its fp32 reference and the bytes a call must move."""

    shape: DecodeShape
    inputs: list[tuple]  # (q [B, Hq, D], kv [2, N, bs, Hkv, D], tables [B, nb], k, v [B, Hkv, L, D])
    cu: torch.Tensor  # [B + 1]
    ctx: torch.Tensor  # [B]
    scale: float
    expected: torch.Tensor  # [B, Hq, D] fp32, for inputs[0]
    moved: int  # bytes of K, V, Q and O

    def name(self) -> str:
        s = self.shape
        return f"decode B={s.batch} L={s.context} Hq={s.q_heads} Hkv={s.kv_heads} D={s.head_dim}"

    def calls(self, **kw) -> list[Callable]:
        return [lambda q=q, kv=kv, tables=tables: paged_attention(q, kv, self.cu, self.ctx, tables, self.scale, **kw)
                for q, kv, tables, _, _ in self.inputs]

    def hints(self) -> dict:
        """What the engine passes for a decode step."""
        return {"max_query_len": 1, "max_context_len": self.shape.context}

    def err(self, **kw) -> float:
        return rel_err(self.calls(**kw)[0](), self.expected)

    def rate(self, us: float) -> float:
        """GB/s at `us` microseconds a call."""
        return self.moved / us / 1e3


def decode_case(shape: DecodeShape, device: torch.device, smoke: bool) -> DecodeCase:
    gen = torch.Generator(device=device).manual_seed(0)
    dtype, block_size = torch.bfloat16, 16
    b, length, hq, hkv, d = shape.batch, shape.context, shape.q_heads, shape.kv_heads, shape.head_dim
    kv_bytes = 2 * b * length * hkv * d * dtype.itemsize
    qo_bytes = 2 * b * hq * d * dtype.itemsize
    inputs = []
    for _ in range(rotations(kv_bytes, smoke)):
        kv, tables, k, v = paged_pool(b, length, hkv, d, block_size, dtype, device, gen)
        q = torch.randn(b, hq, d, generator=gen, device=device, dtype=torch.float32).to(dtype)  # [T=B, Hq, D]
        inputs.append((q, kv, tables, k, v))
    cu = torch.arange(b + 1, device=device)  # one new token per row
    ctx = torch.full((b,), length, device=device)
    q, kv, tables, _, _ = inputs[0]
    expected = ref.paged_attention(q.float(), kv.float(), cu, ctx, tables, d ** -0.5)  # fp32 oracle
    return DecodeCase(shape, inputs, cu, ctx, d ** -0.5, expected, kv_bytes + qo_bytes)


def run_decode(shape: DecodeShape, device: torch.device, smoke: bool) -> dict:
    case = decode_case(shape, device, smoke)
    q, kv, tables, k, v = case.inputs[0]
    sdpa_out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=case.scale, enable_gqa=True).squeeze(2)
    result = {
        "shape": case.name(),
        "splits": attention.num_kv_splits(shape.batch, shape.kv_heads, tables.shape[1] * kv.shape[2],
                                          _decode_n(device, shape.head_dim), device),
        "err": case.err(),
        "sdpa_err": rel_err(sdpa_out, case.expected),
    }

    def sdpa_fn(q, kv, tables, k, v):
        q4 = q.unsqueeze(2)  # [B, Hq, 1, D]
        return lambda: F.scaled_dot_product_attention(q4, k, v, scale=case.scale, enable_gqa=True)

    result["triton_us"] = 1e3 * bench_ms(case.calls(), device)
    result["hinted_us"] = 1e3 * bench_ms(case.calls(**case.hints()), device)
    result["nosplit_us"] = (1e3 * bench_ms(case.calls(split_kv=False), device)
                            if result["splits"] > 1 else result["triton_us"])
    result["sdpa_us"] = 1e3 * bench_ms([sdpa_fn(*x) for x in case.inputs], device)
    result["triton_gbs"] = case.moved / result["triton_us"] / 1e3
    result["sdpa_gbs"] = case.moved / result["sdpa_us"] / 1e3
    return result


def _decode_n(device: torch.device, head_dim: int) -> int:
    return attention._tiles(device, head_dim, fp32_dot=device.type != "cuda").decode_n


def causal_flops(batch: int, new: int, prefix: int, q_heads: int, head_dim: int) -> float:
    # Query i (0-based among the new tokens) sees prefix + i + 1 keys; QK^T and PV are 2*D each.
    pairs = new * prefix + new * (new + 1) / 2
    return 4.0 * head_dim * q_heads * batch * pairs


@dataclass
class PrefillCase:
    shape: PrefillShape
    q: torch.Tensor  # [T, Hq, D]
    kv: torch.Tensor  # [2, N, bs, Hkv, D]
    tables: torch.Tensor  # [B, nb]
    cu: torch.Tensor  # [B + 1]
    ctx: torch.Tensor  # [B]
    scale: float
    expected: torch.Tensor  # [T, Hq, D] fp32
    k: torch.Tensor  # [B, Hkv, L, D] for SDPA
    v: torch.Tensor

    def name(self) -> str:
        s = self.shape
        return (f"prefill B={s.batch} new={s.new_tokens} prefix={s.prefix} Hq={s.q_heads} Hkv={s.kv_heads} "
                f"D={s.head_dim}")

    def flops(self) -> float:
        s = self.shape
        return causal_flops(s.batch, s.new_tokens, s.prefix, s.q_heads, s.head_dim)

    def calls(self, **kw) -> list[Callable]:
        return [lambda: paged_attention(self.q, self.kv, self.cu, self.ctx, self.tables, self.scale, **kw)]

    def hints(self) -> dict:
        return {}

    def err(self, **kw) -> float:
        return rel_err(self.calls(**kw)[0](), self.expected)

    def rate(self, us: float) -> float:
        """TFLOP/s at `us` microseconds a call."""
        return self.flops() / us / 1e6


def prefill_case(shape: PrefillShape, device: torch.device) -> PrefillCase:
    gen = torch.Generator(device=device).manual_seed(1)
    dtype, block_size = torch.bfloat16, 16
    b, n, p, hq, hkv, d = shape.batch, shape.new_tokens, shape.prefix, shape.q_heads, shape.kv_heads, shape.head_dim
    kv, tables, k, v = paged_pool(b, p + n, hkv, d, block_size, dtype, device, gen)
    q = torch.randn(b * n, hq, d, generator=gen, device=device, dtype=torch.float32).to(dtype)  # [T, Hq, D]
    cu = torch.arange(0, b * n + 1, n, device=device)  # [B + 1]
    ctx = torch.full((b,), p + n, device=device)
    expected = ref.paged_attention(q.float(), kv.float(), cu, ctx, tables, d ** -0.5)
    return PrefillCase(shape, q, kv, tables, cu, ctx, d ** -0.5, expected, k, v)


def run_prefill(shape: PrefillShape, device: torch.device, smoke: bool) -> dict:
    case = prefill_case(shape, device)
    b, n, p, hq, hkv, d = shape.batch, shape.new_tokens, shape.prefix, shape.q_heads, shape.kv_heads, shape.head_dim
    k, v, scale = case.k, case.v, case.scale
    q4 = case.q.view(b, n, hq, d).transpose(1, 2).contiguous()  # [B, Hq, n, D] for SDPA

    if p == 0:
        def sdpa():
            return F.scaled_dot_product_attention(q4, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(n, p + n)  # queries are the last n positions

        def sdpa():
            return F.scaled_dot_product_attention(q4, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

    note = ""
    try:
        sdpa_out = sdpa()
    except RuntimeError as exc:  # an SDPA backend without GQA for this mask: give it repeated K/V
        note = f" (SDPA on repeated K/V: {str(exc).splitlines()[0][:60]})"
        k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
        sdpa_out = sdpa()

    result = {
        "shape": case.name() + note,
        "err": case.err(),
        "sdpa_err": rel_err(sdpa_out.transpose(1, 2).reshape(b * n, hq, d), case.expected),
    }
    flops = case.flops()
    result["triton_us"] = 1e3 * bench_ms(case.calls(), device)
    result["sdpa_us"] = 1e3 * bench_ms([sdpa], device)
    result["triton_tflops"] = flops / result["triton_us"] / 1e6
    result["sdpa_tflops"] = flops / result["sdpa_us"] / 1e6
    return result


def timed(case: DecodeCase | PrefillCase, kw: dict, device: torch.device) -> dict:
    """One sweep point: its error against the reference and, where that is good, its time. A configuration
    the compiler rejects (shared memory, registers) is recorded as such, not fatal."""
    try:
        e = case.err(**kw)
        if e > MAX_REL_ERR:
            return {"err": e, "failed": f"relative error {e:.2e}"}
        us = 1e3 * bench_ms(case.calls(**kw), device)
        return {"err": e, "us": us, "rate": case.rate(us)}
    except Exception as exc:  # noqa: BLE001 - any compile or launch failure of one point
        first_line = (str(exc).strip().splitlines() or [""])[0][:100]
        return {"failed": f"{type(exc).__name__}: {first_line}"}


def sweep_point(case: DecodeCase | PrefillCase, base: attention.Tiles, point: dict, splits: int | None,
                device: torch.device, deadline: float) -> dict:
    """`point` (fields of `Tiles`) over `base`, with `splits` decode slices (None: the heuristic's)."""
    row = {"shape": case.name(), "point": point, "splits": splits}
    if time.monotonic() > deadline:
        return {**row, "failed": "skipped: past the time budget"}
    kw = {"tiles": replace(base, **point), **case.hints()}
    if splits is not None:
        kw["num_splits"] = splits
    return {**row, **timed(case, kw, device)}


def sweep(shapes: list, device: torch.device, smoke: bool, points: list[dict], splits: tuple[int, ...],
          deadline: float) -> list[dict]:
    """Every point of the grid on every shape; decode shapes then try each split count with their fastest
    tiles. Points past the deadline are left out (recorded as skipped), so a long sweep still reports."""
    results = []
    for shape in shapes:
        is_decode = isinstance(shape, DecodeShape)
        case = decode_case(shape, device, smoke) if is_decode else prefill_case(shape, device)
        base = attention._tiles(device, shape.head_dim, fp32_dot=device.type != "cuda")
        plan = [(point, None) for point in points]
        rows = []
        while plan:
            point, n = plan.pop(0)
            row = sweep_point(case, base, point, n, device, deadline)
            print(json.dumps(row), flush=True)
            rows.append(row)
            ran = [r for r in rows if "us" in r]
            if is_decode and not plan and n is None and ran:  # the grid is done: split counts, fastest tiles
                plan = [(min(ran, key=lambda r: r["us"])["point"], n) for n in splits]
        results += rows
    return results


def closest_to_fastest(rows: list[dict]) -> tuple[dict, float] | None:
    """The grid point (split counts aside) whose geometric mean of time over each shape's fastest is least,
    among the points that ran on every shape; with that mean."""
    grid_rows = [r for r in rows if r["splits"] is None]
    shapes = {r["shape"] for r in grid_rows}
    best = {s: min((r["us"] for r in grid_rows if r["shape"] == s and "us" in r), default=None) for s in shapes}
    by_point: dict[str, list[float]] = {}
    for r in grid_rows:
        if "us" in r and best[r["shape"]]:
            by_point.setdefault(json.dumps(r["point"], sort_keys=True), []).append(r["us"] / best[r["shape"]])
    scored = [(json.loads(k), math.exp(sum(map(math.log, v)) / len(v))) for k, v in by_point.items()
              if len(v) == len(shapes)]
    return min(scored, key=lambda x: x[1]) if scored else None


def print_sweep(title: str, rows: list[dict], unit: str, top: int = 5) -> dict | None:
    """The `top` fastest grid points of each shape, then its split counts (decode); `unit` names the rate.
    Returns the point closest to the fastest on every shape."""
    print(f"\n### {title}\n")
    print(f"| shape | point | splits | us | {unit} | rel err |")
    print("|---|---|---:|---:|---:|---:|")
    for shape in dict.fromkeys(r["shape"] for r in rows):
        ran = sorted((r for r in rows if r["shape"] == shape and "us" in r), key=lambda r: r["us"])
        grid_rows = [r for r in ran if r["splits"] is None][:top]
        split_rows = [r for r in ran if r["splits"] is not None]
        for r in grid_rows + split_rows:
            point = " ".join(f"{k.split('_', 1)[1]}={v}" for k, v in r["point"].items())
            splits = r["splits"] or ("heuristic" if shape.startswith("decode") else "-")
            print(f"| {shape} | {point} | {splits} | {r['us']:.1f} | {r['rate']:.1f} "
                  f"| {r['err']:.1e} |")
        failed = [r for r in rows if r["shape"] == shape and "failed" in r]
        if failed:
            print(f"| {shape} | {len(failed)} points failed or skipped, e.g. {failed[0]['failed']} | | | | |")
    pick = closest_to_fastest(rows)
    if pick is None:
        return None
    print(f"\nOne configuration for all these shapes: {pick[0]}, {pick[1]:.3f}x each shape's fastest "
          "(geometric mean).")
    return pick[0]


def run_sweep(device: torch.device, smoke: bool, budget_s: float, json_path: str | None, decode_shapes: list,
              prefill_shapes: list, env: dict) -> None:
    deadline = time.monotonic() + budget_s
    decode_points, prefill_points, splits = ((SMOKE_DECODE_SWEEP, SMOKE_PREFILL_SWEEP, SMOKE_SPLIT_SWEEP) if smoke
                                             else (GPU_DECODE_SWEEP, GPU_PREFILL_SWEEP, GPU_SPLIT_SWEEP))
    decode = sweep(decode_shapes, device, smoke, decode_points, splits, deadline)
    prefill = sweep(prefill_shapes, device, smoke, prefill_points, (), deadline)
    base = attention._tiles(device, 64, fp32_dot=device.type != "cuda")
    print(f"\nDefaults now: {asdict(base)}")
    decode_pick = print_sweep("Decode sweep (fastest points per shape, then split counts with the fastest tiles)",
                              decode, "GB/s")
    prefill_pick = print_sweep("Prefill sweep (fastest points per shape)", prefill, "TFLOP/s")
    print(f"\nTogether: {replace(base, **(decode_pick or {}), **(prefill_pick or {}))}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"environment": env, "device": str(device), "decode": decode, "prefill": prefill}, f,
                      indent=1)
    if not any("us" in r for r in decode + prefill):
        sys.exit("FAIL: no sweep point ran")


@dataclass(frozen=True)
class MoeShape:
    tokens: int
    experts: int
    top_k: int
    hidden: int
    inter: int

    def name(self) -> str:
        return f"T={self.tokens} E={self.experts} k={self.top_k} H={self.hidden} I={self.inter}"


# Qwen3-30B-A3B's layer (128 experts, top 8) at decode batches and a prefill chunk; Mixtral-8x7B's (8, top 2).
GPU_MOE = [MoeShape(t, 128, 8, 2048, 768) for t in (1, 16, 64, 256, 2048)] + [MoeShape(64, 8, 2, 4096, 14336)]
SMOKE_MOE = [MoeShape(3, 8, 2, 64, 32), MoeShape(20, 16, 4, 32, 48)]


def run_moe(shape: MoeShape, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The fused kernel (two grouped GEMMs) and the loop over experts (a matmul per expert with tokens) in
    `dtype`, each against the loop in fp32 on the same inputs. Bytes: x, the weights of every expert some token
    is routed to, and the output, each once."""
    from pagedserve.kernels.gpu.fused_moe import fused_experts
    from pagedserve.workers.models.moe import grouped_experts, route

    gate_up = (torch.randn(shape.experts, 2 * shape.inter, shape.hidden, device=device) / shape.hidden**0.5)
    down = torch.randn(shape.experts, shape.hidden, shape.inter, device=device) / shape.inter**0.5
    x = torch.randn(shape.tokens, shape.hidden, device=device)
    weights, experts = route(torch.randn(shape.tokens, shape.experts, device=device), shape.top_k, True)
    exact = grouped_experts(x, weights, experts, gate_up, down)
    args = (x.to(dtype), weights.to(dtype), experts, gate_up.to(dtype), down.to(dtype))
    used = experts.unique().numel()
    nbytes = 2 * (2 * shape.tokens * shape.hidden + used * 3 * shape.hidden * shape.inter)
    result = {"shape": shape.name(), "experts_used": used}
    for name, fn in (("fused", fused_experts), ("loop", grouped_experts)):
        out = fn(*args)
        result[f"{name}_err"] = rel_err(out, exact)
        us = bench_ms([lambda fn=fn: fn(*args)], device) * 1e3
        result[f"{name}_us"], result[f"{name}_gbs"] = us, nbytes / us / 1e3
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    parser.add_argument("--sweep", action="store_true", help="time a grid of kernel configurations per shape")
    parser.add_argument("--budget-s", type=float, default=420.0, help="the sweep stops timing after this long")
    parser.add_argument("--json", help="write the sweep's every point here")
    parser.add_argument("--only", choices=["decode", "prefill", "moe"],
                        help="time only these shapes (e.g. under a profiler that follows one kernel)")
    args = parser.parse_args()
    env = announce()
    if args.smoke:
        device = torch.device("cpu")
        decode_shapes, prefill_shapes, moe_shapes = SMOKE_DECODE, SMOKE_PREFILL, SMOKE_MOE
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: run with --smoke to check the script on CPU")
        device = torch.device("cuda")
        decode_shapes, prefill_shapes, moe_shapes = GPU_DECODE, GPU_PREFILL, GPU_MOE
    if args.only:
        decode_shapes, prefill_shapes, moe_shapes = (shapes if args.only == kind else [] for kind, shapes in (
            ("decode", decode_shapes), ("prefill", prefill_shapes), ("moe", moe_shapes)))
    torch.manual_seed(0)
    if args.sweep:
        run_sweep(device, args.smoke, args.budget_s, args.json, decode_shapes, prefill_shapes, env)
        return

    decode = []
    for shape in decode_shapes:
        r = run_decode(shape, device, args.smoke)
        print(r, flush=True)
        decode.append(r)
    prefill = []
    for shape in prefill_shapes:
        r = run_prefill(shape, device, args.smoke)
        print(r, flush=True)
        prefill.append(r)
    moe = []
    for shape in moe_shapes:
        # the interpreter truncates bf16 stores (twice the error): fp16 there, the same 16-bit path
        r = run_moe(shape, device, torch.float16 if args.smoke else torch.bfloat16)
        print(r, flush=True)
        moe.append(r)

    unit = "(interpreter: timings meaningless)" if args.smoke else ""
    print(f"\n### Decode {unit}\n")
    print("| shape | splits | Triton us | Triton GB/s | hinted us | no-split us | SDPA us | SDPA GB/s "
          "| Triton/SDPA BW | rel err | SDPA rel err |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in decode:
        print(f"| {r['shape']} | {r['splits']} | {r['triton_us']:.1f} | {r['triton_gbs']:.0f} | {r['hinted_us']:.1f} "
              f"| {r['nosplit_us']:.1f} | {r['sdpa_us']:.1f} | {r['sdpa_gbs']:.0f} "
              f"| {r['triton_gbs'] / r['sdpa_gbs']:.2f} | {r['err']:.1e} | {r['sdpa_err']:.1e} |")
    print(f"\n### Prefill {unit}\n")
    print("| shape | Triton us | Triton TFLOP/s | SDPA us | SDPA TFLOP/s | Triton/SDPA | rel err | SDPA rel err |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in prefill:
        print(f"| {r['shape']} | {r['triton_us']:.1f} | {r['triton_tflops']:.1f} | {r['sdpa_us']:.1f} "
              f"| {r['sdpa_tflops']:.1f} | {r['triton_tflops'] / r['sdpa_tflops']:.2f} | {r['err']:.1e} "
              f"| {r['sdpa_err']:.1e} |")
    print(f"\n### Mixture-of-experts layer, {'fp16' if args.smoke else 'bf16'} {unit}\n")
    print("| shape | experts used | fused us | fused GB/s | loop us | loop GB/s | loop / fused | fused rel err "
          "| loop rel err |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in moe:
        print(f"| {r['shape']} | {r['experts_used']} | {r['fused_us']:.1f} | {r['fused_gbs']:.0f} | {r['loop_us']:.1f} "
              f"| {r['loop_gbs']:.0f} | {r['loop_us'] / r['fused_us']:.2f} | {r['fused_err']:.1e} "
              f"| {r['loop_err']:.1e} |")
    worst = max([r["err"] for r in decode + prefill] + [r["fused_err"] for r in moe])
    print("\nhinted: max_query_len=1 and max_context_len passed (skips the prefill launch); "
          "no-split: split_kv=False. Bytes = K + V + Q + O.")
    if worst > MAX_REL_ERR:
        sys.exit(f"FAIL: Triton relative error {worst:.2e} > {MAX_REL_ERR:g} against the fp32 reference")


if __name__ == "__main__":
    main()
