"""Triton paged-attention kernels vs torch SDPA on contiguous K/V (run on the GPU machine).

    PYTHONPATH=. python benchmarks/kernels.py            # H100/H200: the shapes below
    PYTHONPATH=. python benchmarks/kernels.py --smoke    # tiny shapes on CPU (Triton interpreter)

Decode: bf16, block_size 16, shuffled block tables; each result is checked against the plain-torch
reference (fp32 on upcast inputs) and timed with triton.testing.do_bench (median). Bandwidth counts
the bytes of K, V, Q and O once for both implementations (block tables are noise). Prefill reports
TFLOP/s with causal FLOPs counted exactly (4 * D * Hq per visible query-key pair).
Needs only torch and triton (no ray, no gguf).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass

if "--smoke" in sys.argv:  # must precede the first triton import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from pagedserve.kernels import attention  # noqa: E402
from pagedserve.kernels import reference as ref  # noqa: E402
from pagedserve.kernels.attention import paged_attention  # noqa: E402

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


def run_decode(shape: DecodeShape, device: torch.device, smoke: bool) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    dtype, block_size = torch.bfloat16, 16
    b, length, hq, hkv, d = shape.batch, shape.context, shape.q_heads, shape.kv_heads, shape.head_dim
    scale = d ** -0.5
    kv_bytes = 2 * b * length * hkv * d * dtype.itemsize
    qo_bytes = 2 * b * hq * d * dtype.itemsize
    n_rot = rotations(kv_bytes, smoke)
    inputs = []
    for _ in range(n_rot):
        kv, tables, k, v = paged_pool(b, length, hkv, d, block_size, dtype, device, gen)
        q = torch.randn(b, hq, d, generator=gen, device=device, dtype=torch.float32).to(dtype)  # [T=B, Hq, D]
        inputs.append((q, kv, tables, k, v))
    cu = torch.arange(b + 1, device=device)  # one new token per row
    ctx = torch.full((b,), length, device=device)

    q, kv, tables, k, v = inputs[0]
    expected = ref.paged_attention(q.float(), kv.float(), cu, ctx, tables, scale)  # fp32 oracle
    out = paged_attention(q, kv, cu, ctx, tables, scale)
    sdpa_out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale, enable_gqa=True).squeeze(2)
    result = {
        "shape": f"decode B={b} L={length} Hq={hq} Hkv={hkv} D={d}",
        "splits": attention.num_kv_splits(b, hkv, tables.shape[1] * block_size, _decode_n(device, d), device),
        "err": rel_err(out, expected),
        "sdpa_err": rel_err(sdpa_out, expected),
    }
    del expected

    def triton_fn(q, kv, tables, k, v, **kw):
        return lambda: paged_attention(q, kv, cu, ctx, tables, scale, **kw)

    def sdpa_fn(q, kv, tables, k, v):
        q4 = q.unsqueeze(2)  # [B, Hq, 1, D]
        return lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)

    moved = kv_bytes + qo_bytes
    result["triton_us"] = 1e3 * bench_ms([triton_fn(*x) for x in inputs], device)
    result["hinted_us"] = 1e3 * bench_ms([triton_fn(*x, max_query_len=1, max_context_len=length) for x in inputs],
                                         device)
    result["nosplit_us"] = (1e3 * bench_ms([triton_fn(*x, split_kv=False) for x in inputs], device)
                            if result["splits"] > 1 else result["triton_us"])
    result["sdpa_us"] = 1e3 * bench_ms([sdpa_fn(*x) for x in inputs], device)
    result["triton_gbs"] = moved / result["triton_us"] / 1e3
    result["sdpa_gbs"] = moved / result["sdpa_us"] / 1e3
    return result


def _decode_n(device: torch.device, head_dim: int) -> int:
    return attention._tiles(device, head_dim, fp32_dot=device.type != "cuda").decode_n


def causal_flops(batch: int, new: int, prefix: int, q_heads: int, head_dim: int) -> float:
    # Query i (0-based among the new tokens) sees prefix + i + 1 keys; QK^T and PV are 2*D each.
    pairs = new * prefix + new * (new + 1) / 2
    return 4.0 * head_dim * q_heads * batch * pairs


def run_prefill(shape: PrefillShape, device: torch.device, smoke: bool) -> dict:
    gen = torch.Generator(device=device).manual_seed(1)
    dtype, block_size = torch.bfloat16, 16
    b, n, p, hq, hkv, d = shape.batch, shape.new_tokens, shape.prefix, shape.q_heads, shape.kv_heads, shape.head_dim
    length = p + n
    scale = d ** -0.5
    kv, tables, k, v = paged_pool(b, length, hkv, d, block_size, dtype, device, gen)
    q = torch.randn(b * n, hq, d, generator=gen, device=device, dtype=torch.float32).to(dtype)  # [T, Hq, D]
    cu = torch.arange(0, b * n + 1, n, device=device)  # [B + 1]
    ctx = torch.full((b,), length, device=device)
    q4 = q.view(b, n, hq, d).transpose(1, 2).contiguous()  # [B, Hq, n, D] for SDPA

    if p == 0:
        def sdpa():
            return F.scaled_dot_product_attention(q4, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(n, length)  # queries are the last n positions

        def sdpa():
            return F.scaled_dot_product_attention(q4, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

    note = ""
    try:
        sdpa_out = sdpa()
    except RuntimeError as exc:  # an SDPA backend without GQA for this mask: give it repeated K/V
        note = f" (SDPA on repeated K/V: {str(exc).splitlines()[0][:60]})"
        k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
        sdpa_out = sdpa()

    expected = ref.paged_attention(q.float(), kv.float(), cu, ctx, tables, scale)
    out = paged_attention(q, kv, cu, ctx, tables, scale)
    result = {
        "shape": f"prefill B={b} new={n} prefix={p} Hq={hq} Hkv={hkv} D={d}{note}",
        "err": rel_err(out, expected),
        "sdpa_err": rel_err(sdpa_out.transpose(1, 2).reshape(b * n, hq, d), expected),
    }
    del expected
    flops = causal_flops(b, n, p, hq, d)
    result["triton_us"] = 1e3 * bench_ms([lambda: paged_attention(q, kv, cu, ctx, tables, scale)], device)
    result["sdpa_us"] = 1e3 * bench_ms([sdpa], device)
    result["triton_tflops"] = flops / result["triton_us"] / 1e6
    result["sdpa_tflops"] = flops / result["sdpa_us"] / 1e6
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    args = parser.parse_args()
    if args.smoke:
        device = torch.device("cpu")
        decode_shapes, prefill_shapes = SMOKE_DECODE, SMOKE_PREFILL
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: run with --smoke to check the script on CPU")
        device = torch.device("cuda")
        decode_shapes, prefill_shapes = GPU_DECODE, GPU_PREFILL
        print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {_triton_version()}")
    torch.manual_seed(0)

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
    worst = max(r["err"] for r in decode + prefill)
    print("\nhinted: max_query_len=1 and max_context_len passed (skips the prefill launch); "
          "no-split: split_kv=False. Bytes = K + V + Q + O.")
    if worst > MAX_REL_ERR:
        sys.exit(f"FAIL: Triton relative error {worst:.2e} > {MAX_REL_ERR:g} against the fp32 reference")


def _triton_version() -> str:
    import triton

    return triton.__version__


if __name__ == "__main__":
    main()
