"""A Qwen3-MoE-shaped GGUF made as llama.cpp users make one: a checkpoint (random bf16 weights here, from
transformers), llama.cpp's own `convert_hf_to_gguf.py` to a bf16 GGUF, then `llama-quantize` to Q4_K_M.

The default shape is Qwen3-30B-A3B's halved in width and depth: 24 layers of 1,024, 16 query and 4 KV heads of 128,
64 experts of 384 a layer, 8 of them a token; 2.0B weights, 0.45B active a token, on SmolLM2's 49,152-token
vocabulary (the embedded model's tokenizer, which llama.cpp's converter knows). The file is then the `--model` of
`throughput.py` (beside `--llama-server` on the same file) and the `--gguf` of `gguf_memory.py`:

  python benchmarks/moe_gguf.py --out DIR                  # DIR/qwen3moe-2b.Q4_K_M.gguf
  python benchmarks/throughput.py --model DIR/qwen3moe-2b.Q4_K_M.gguf --llama-server native --skip-hf ...
  python benchmarks/gguf_memory.py --gguf DIR/qwen3moe-2b.Q4_K_M.gguf --llama-server

Needs the peers' llama.cpp tree and its portable build (`setup_peers.sh llama-server-portable`: llama-quantize).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from environment import announce  # noqa: E402
from peers import PEERS_DIR, peer_binary  # noqa: E402


def make_checkpoint(out: Path, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, experts: int,
                    used: int, expert_size: int) -> None:
    """A Qwen3-MoE checkpoint of this shape with random bf16 weights (transformers' initializer, routers drawn
    wider so that tokens spread over the experts) and the embedded SmolLM2's tokenizer."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    from pagedserve.workers.loader import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None).tokenizer_dir)
    config = transformers.Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, num_experts=experts,
        num_experts_per_tok=used, moe_intermediate_size=expert_size, norm_topk_prob=True, max_position_embeddings=4096,
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.3)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"checkpoint: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B weights")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="directory for the GGUF")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--experts-per-token", type=int, default=8)
    p.add_argument("--expert-size", type=int, default=384)
    p.add_argument("--type", default="Q4_K_M", help="llama-quantize's type")
    args = p.parse_args()
    announce()
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"qwen3moe-{args.layers}x{args.hidden}-{args.experts}e"
    with tempfile.TemporaryDirectory(prefix="moe-gguf-", dir=args.out) as d:
        checkpoint, bf16 = Path(d) / "hf", Path(d) / f"{name}.bf16.gguf"
        start = time.perf_counter()
        make_checkpoint(checkpoint, args.layers, args.hidden, args.heads, args.kv_heads, args.head_dim, args.experts,
                        args.experts_per_token, args.expert_size)
        converter = PEERS_DIR / "llama.cpp" / "convert_hf_to_gguf.py"
        subprocess.run([sys.executable, str(converter), str(checkpoint), "--outtype", "bf16", "--outfile", str(bf16)],
                       check=True)
        out = args.out / f"{name}.{args.type}.gguf"
        subprocess.run([str(peer_binary("llama-quantize")), str(bf16), str(out), args.type], check=True)
    print(f"{out}: {out.stat().st_size / 2**20:,.0f} MiB, made in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
