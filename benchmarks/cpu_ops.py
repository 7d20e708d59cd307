"""The CPU path's two hot spots at the embedded model's shapes (or Llama-3.2-1B's, `--shape`), each beside what
it replaced, one run:

- decode attention, 16 sequences: the native kernel reading the paged pool in place vs the torch reference
  (gather each row's K/V through the block table, then one masked SDPA);
- prefill attention, one 1,024-token prompt: the native kernel, every token a decode row of its own, vs the
  reference's causal SDPA;
- one decode step's linear layers (30 layers: qkv, o, gate_up, down; then the LM head) at 16 rows, each
  layer with weights of its own (so they stream from memory as in a model): F.linear on the plain fp32
  weight, weights packed into oneDNN's layout, the GGUF-block kernel on Q4_1 layers and a Q8_0 LM head
  (the embedded GGUF's types), and the same kernel on the fp32 weights (what a checkpoint without GGUF
  blocks runs) and on them rounded to bf16 (what a bf16 checkpoint runs: its weights kept 16-bit); where every
  layer's inputs are a multiple of 256 (Llama-3.2-1B's, not SmolLM2's), on the K-types' and IQ4_XS blocks too.

  .venv/bin/python benchmarks/cpu_ops.py [--rows 16] [--context 400] [--prefill 1024] [--shape llama-3.2-1b]
                                        [--layers N]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from environment import announce  # noqa: E402

# query heads, KV heads, head_dim, hidden, MLP, vocab, layers
SHAPES = {"smollm2": (9, 3, 64, 576, 1536, 49152, 30),  # SmolLM2-135M, the embedded model
          "llama-3.2-1b": (32, 8, 64, 2048, 8192, 128256, 16)}


def median_ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--context", type=int, default=400)
    p.add_argument("--prefill", type=int, default=1024, help="prompt length of the prefill attention (0: none)")
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2",
                   help="the model whose shapes the kernels run at (llama-3.2-1b: its layers take Q4_K blocks)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers of the linear layers' step")
    args = p.parse_args()
    announce()

    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from pagedserve.kernels import reference
    from pagedserve.kernels.cpu import ops as cpu
    from pagedserve.kernels.cpu import quant_linear
    from pagedserve.kernels.cpu.packed_linear import PackedLinear, can_pack

    hq, hkv, d, hidden, inter, vocab, layers = SHAPES[args.shape]
    layers = args.layers or layers
    bs = 16
    r, ctx = args.rows, args.context
    blocks_per_row = -(-ctx // bs)
    pool_blocks = 4096  # rows' blocks scattered through a pool larger than the caches
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(2, pool_blocks, bs, hkv, d, generator=gen)  # [2, N, B, Hkv, D]
    tables = torch.randperm(pool_blocks, generator=gen)[: r * blocks_per_row].view(r, blocks_per_row)
    query = torch.randn(r, hq, d, generator=gen)  # [R, Hq, D]: one new token per row
    cu = torch.arange(r + 1)
    lens = torch.full((r,), ctx)
    print(f"{torch.get_num_threads()} torch threads, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}")
    print(f"\ndecode attention, {r} rows x {ctx} tokens (per layer):")
    kv_bytes = 2 * r * ctx * hkv * d * 4
    for name, fn in [("reference (gather + SDPA)", lambda: reference.paged_attention(query, kv, cu, lens, tables,
                                                                                         d ** -0.5)),
                     ("native, in place", lambda: cpu.paged_attention(query, kv, cu, lens, tables, d ** -0.5,
                                                                      max_query_len=1))]:
        ms = median_ms(fn, args.repeat)
        print(f"  {name:28s} {ms:7.3f} ms  ({kv_bytes / ms / 1e6:5.1f} GB/s of K/V)")

    if args.prefill:
        n = args.prefill
        prompt_table = torch.randperm(pool_blocks, generator=gen)[:-(-n // bs)][None]  # [1, blocks]
        prompt_q = torch.randn(n, hq, d, generator=gen)  # [P, Hq, D]
        prompt_cu, prompt_lens = torch.tensor([0, n]), torch.tensor([n])
        print(f"\nprefill attention, one prompt of {n} tokens (per layer):")
        flops = 4 * hq * d * n * (n + 1) / 2  # q.k and p.v over each token's causal context
        for name, fn in [("reference (causal SDPA)", lambda: reference.paged_attention(
                              prompt_q, kv, prompt_cu, prompt_lens, prompt_table, d ** -0.5)),
                         ("native, in place", lambda: cpu.paged_attention(
                              prompt_q, kv, prompt_cu, prompt_lens, prompt_table, d ** -0.5))]:
            ms = median_ms(fn, max(3, args.repeat // 10))
            print(f"  {name:28s} {ms:7.3f} ms  ({flops / ms / 1e6:5.1f} GFLOP/s)")

    print(f"\nlinear layers of one decode step, {r} rows ({layers} layers + LM head):")
    shapes = [(hidden, hq * d + 2 * hkv * d), (hq * d, hidden), (hidden, 2 * inter), (inter, hidden)] * layers
    shapes.append((hidden, vocab))  # the tied LM head
    weights = [torch.randn(n, k, generator=gen) * 0.02 for k, n in shapes]
    inputs = [torch.randn(r, w.shape[1], generator=gen) for w in weights]
    flops = 2 * r * sum(k * n for k, n in shapes)

    def step(layer_fns):
        def run():
            for x, fn in zip(inputs, layer_fns, strict=True):
                fn(x)
        return run

    # Every layer is built before any runs, as an engine loads its weights before its first step: memory
    # allocated after oneDNN's first packing streams slower here (the GGUF layers took ~1.6x as long).
    runs = [("F.linear, plain fp32", step([lambda x, w=w: F.linear(x, w) for w in weights]))]
    if quant_linear.available(torch.device("cpu"), torch.float32):
        qtypes = ["Q4_1"] * (len(weights) - 1) + ["Q8_0"]
        blocks = [quant_linear.QuantLinear(torch.from_numpy(quantize(w.numpy(), GGMLQuantizationType[t])), t,
                                           w.shape[1], None) for w, t in zip(weights, qtypes, strict=True)]
        runs.append(("GGUF blocks (Q4_1, Q8_0 head)", step(blocks)))
        if all(w.shape[1] % 256 == 0 for w in weights):  # the K-types' blocks are 256 values: random ones (gguf
            # cannot quantize to them), timed as the kernel reads any
            for qtype in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"):
                layers_k = [quant_linear.QuantLinear(random_k_blocks(*w.shape, qtype, gen), qtype, w.shape[1], None)
                            for w in weights]
                runs.append((f"GGUF {qtype} blocks", step(layers_k)))
        runs.append(("fp32 panels (the same kernel)", step([quant_linear.QuantLinear.from_fp32(w, None)
                                                            for w in weights])))
        # The weights rounded to bf16 (a bf16 checkpoint's), held as they are: the same kernel, half the bytes
        runs.append(("bf16 panels (the same kernel)", step([quant_linear.QuantLinear.from_fp32(
            w.bfloat16().float(), None) for w in weights])))
    if can_pack(torch.device("cpu"), torch.float32):
        runs.insert(1, ("oneDNN packed fp32", step([PackedLinear(w, None, r) for w in weights])))
    for name, fn in runs:
        ms = median_ms(fn, max(5, args.repeat // 3))
        print(f"  {name:28s} {ms:7.1f} ms  ({flops / ms / 1e6:5.1f} GFLOP/s)")


def random_k_blocks(n: int, k: int, qtype: str, gen: torch.Generator, d: float = 0.01) -> torch.Tensor:
    """Q2_K, Q3_K, Q4_K, Q5_K, Q6_K or IQ4_XS rows [n, k / 256 * block bytes]: random bytes under a small fp16 d
    (and dmin): every such block is a valid one."""
    size, scales = {"Q2_K": (84, slice(80, 84)), "Q3_K": (110, slice(108, 110)), "Q4_K": (144, slice(0, 4)),
                    "Q5_K": (176, slice(0, 4)), "Q6_K": (210, slice(208, 210)), "IQ4_XS": (136, slice(0, 2))}[qtype]
    blocks = torch.randint(0, 256, (n, k // 256, size), dtype=torch.uint8, generator=gen)
    count = (scales.stop - scales.start) // 2
    blocks[..., scales] = torch.full((n, k // 256, count), d, dtype=torch.float16).view(torch.uint8)
    return blocks.reshape(n, -1)


if __name__ == "__main__":
    main()
