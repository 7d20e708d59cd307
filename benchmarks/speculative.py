"""Speculative decoding, on and off in the same run, on the embedded SmolLM2 (a CPU).

  python benchmarks/speculative.py [--requests 1 16] [--llama-server] [--draft-layers N] [--json out.json]

Two workloads of chat prompts, greedy, each request's output as long as the text it is asked to copy:
- "copy": prompts that hold most of their answer: repeat this code with one name changed, copy this paragraph
  with one word replaced (made from templates, the same every run);
- "fresh": questions whose answer is nowhere in the prompt (a short story about a given animal).
For each workload and each request count (all requests at once): output tokens/s with speculation over without,
and its acceptance rate and tokens per verifying row. With --llama-server, the same prompts (as token ids) through
llama-server on the same GGUF file, without and with its own n-gram speculative decoding (`--spec-type
ngram-simple`, the same n-gram and proposal lengths), in the same run. With --draft-layers N, the `draft_model`
method too, its draft the model's own first N layers with its final norm and output layer (its real weights, its
GGUF blocks: an early exit of the same model, as self-speculative decoding makes one).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from environment import announce  # noqa: E402

ANIMALS = ["otter", "fox", "heron", "badger", "owl", "hare", "wolf", "crow", "seal", "lynx", "mole", "swan", "deer",
           "frog", "bear", "wren"]
VERBS = ["count", "total", "scale", "merge", "clip", "shift", "pack", "sort"]
CODE = '''def {verb}_values(values, factor={n}):
    """Return the values after {verb}ing them by factor, keeping their order."""
    result = []
    for index, value in enumerate(values):
        if value is None:
            continue
        adjusted = value * factor + index
        if adjusted > {limit}:
            adjusted = {limit}
        result.append(adjusted)
    return result


def {verb}_table(rows, factor={n}):
    """Apply {verb}_values to every row of a table."""
    return [{verb}_values(row, factor) for row in rows]
'''
PARAGRAPH = ("The {animal} lives near the river, where the water runs slowly past the old stone bridge. Every "
             "morning the {animal} walks along the bank, looks for food among the reeds, and rests in the sun when "
             "the day grows warm. In the evening it returns to its den under the roots of a tall willow tree, and "
             "the {animal} sleeps there until the birds begin to sing again.")


def copy_prompts(count: int) -> list[list[dict]]:
    """Chat messages that hold most of their answer."""
    out = []
    for i in range(count):
        if i % 2 == 0:
            verb = VERBS[i // 2 % len(VERBS)]
            code = CODE.format(verb=verb, n=i + 2, limit=100 * (i + 1))
            ask = f"Repeat this code exactly, but rename `{verb}_values` to `{verb}_items`:\n\n```python\n{code}```"
        else:
            animal = ANIMALS[i % len(ANIMALS)]
            ask = (f"Copy this paragraph word for word, but write 'lake' instead of 'river':\n\n"
                   f"{PARAGRAPH.format(animal=animal)}")
        out.append([{"role": "user", "content": ask}])
    return out


def fresh_prompts(count: int) -> list[list[dict]]:
    """Chat messages whose answer is not in them."""
    return [[{"role": "user", "content": f"Write a short story about a {ANIMALS[i % len(ANIMALS)]} who learns to "
              f"{VERBS[i % len(VERBS)]} the stars."}] for i in range(count)]


def token_prompts(tokenizer, messages: list[list[dict]]) -> list[list[int]]:
    return [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False)
            for m in messages]


def output_lengths(tokenizer, messages: list[list[dict]], workload: str, fresh_len: int) -> list[int]:
    """Copy: the tokens of the text to copy (the part after the instruction); fresh: `fresh_len`."""
    if workload == "fresh":
        return [fresh_len] * len(messages)
    return [len(tokenizer.encode(m[0]["content"].split("\n\n", 1)[1])) for m in messages]


def layer_draft(weights_dir: Path, num_layers: int, out: Path) -> Path:
    """A draft of the model's first `num_layers` layers, its embeddings, final norm and output layer, written to
    `out` with the tokenizer: the weights and GGUF blocks of those tensors, the config cut to those layers."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    def kept(name: str) -> bool:
        return not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers

    out.mkdir(parents=True, exist_ok=True)
    for source in weights_dir.iterdir():
        if source.suffix == ".safetensors":
            with safe_open(source, "pt") as f:
                metadata = f.metadata()
                tensors = {name: f.get_tensor(name) for name in f.keys() if kept(name)}
            if metadata:
                metadata = {k: v for k, v in metadata.items() if k in tensors or not k.startswith("model.")}
            save_file(tensors, out / source.name, metadata=metadata)
        elif source.name == "config.json":
            config = json.loads(source.read_text())
            config["num_hidden_layers"] = num_layers
            (out / source.name).write_text(json.dumps(config))
        elif source.is_file() and source.suffix in (".json", ".jinja", ".txt", ".model"):
            shutil.copy(source, out / source.name)
    return out


def run_pagedserve(prompts: list[list[int]], outputs: list[int], speculative: dict | None) -> dict:
    from pagedserve import LLM, SamplingParams

    llm = LLM(speculative_config=speculative, max_num_seqs=max(16, len(prompts)))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8))  # warm-up (kernels built, caches)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    stats = llm.stats()
    llm.shutdown()
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(outputs)
    result = {"seconds": seconds, "tokens": produced, "tokens_per_s": produced / seconds,
              "token_ids": [o.outputs[0].token_ids for o in outs]}
    result.update({k: v for k, v in stats.items() if k.startswith("spec_")})
    return result


def run_llama_server(gguf: Path, prompts: list[list[int]], outputs: list[int], spec_args: list[str]) -> dict:
    from peers import llama_server_cmd, server_process, timed_completions

    slot = max(map(len, prompts)) + max(outputs) + 16
    cmd, url = llama_server_cmd(gguf, parallel=len(prompts), context_per_slot=slot, build="native")
    with server_process(cmd + spec_args, url + "/health", None):
        replies, seconds = timed_completions(url, prompts, outputs, {"temperature": 0, "top_k": 1,
                                                                     "return_tokens": True})
    produced = sum(len(r["tokens"]) for r in replies)
    return {"seconds": seconds, "tokens": produced, "tokens_per_s": produced / seconds}


def report(label: str, off: dict, on: dict, same: bool) -> None:
    print(f"{label}: {off['tokens_per_s']:7.1f} -> {on['tokens_per_s']:7.1f} tok/s = "
          f"{on['tokens_per_s'] / off['tokens_per_s']:.2f}x (acceptance {on['spec_acceptance_rate']:.2f}, "
          f"{on['spec_mean_accepted_length']:.2f} tokens a verifying row; same tokens: {same})", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, nargs="+", default=[1, 16])
    p.add_argument("--workloads", nargs="+", choices=["copy", "fresh"], default=["copy", "fresh"])
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    p.add_argument("--lookup", type=int, nargs=2, default=(1, 3), metavar=("MIN", "MAX"),
                   help="prompt_lookup_min and prompt_lookup_max")
    p.add_argument("--fresh-len", type=int, default=128, help="output tokens of each fresh-workload request")
    p.add_argument("--llama-server", action="store_true", help="also llama-server, without and with ngram-simple")
    p.add_argument("--draft-layers", type=int, default=None, metavar="N",
                   help="also the draft_model method, its draft the model's first N layers")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    env = announce()
    from transformers import AutoTokenizer

    from pagedserve.workers.gguf import embedded_model_gguf
    from pagedserve.workers.loader import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None).tokenizer_dir)
    speculative = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
                   "prompt_lookup_min": args.lookup[0], "prompt_lookup_max": args.lookup[1]}
    draft = None
    tmp = tempfile.TemporaryDirectory()  # the draft's files, removed at the end
    if args.draft_layers is not None:
        draft = {"method": "draft_model", "num_speculative_tokens": args.num_speculative_tokens,
                 "model": str(layer_draft(resolve_model(None).weights_dir, args.draft_layers, Path(tmp.name)))}
    rows = []
    for workload in args.workloads:
        for count in args.requests:
            messages = copy_prompts(count) if workload == "copy" else fresh_prompts(count)
            prompts = token_prompts(tokenizer, messages)
            outputs = output_lengths(tokenizer, messages, workload, args.fresh_len)
            off = run_pagedserve(prompts, outputs, None)
            on = run_pagedserve(prompts, outputs, speculative)
            same = on.pop("token_ids") == off["token_ids"]
            row = {"workload": workload, "requests": count, "output_tokens": sum(outputs), "off": off, "on": on,
                   "speedup": on["tokens_per_s"] / off["tokens_per_s"], "same_tokens": same}
            report(f"{workload:5} x{count:<3} pagedserve", off, on, same)
            if draft is not None:
                drafted = run_pagedserve(prompts, outputs, draft)
                row["draft"] = {**drafted, "speedup": drafted["tokens_per_s"] / off["tokens_per_s"],
                                "same_tokens": drafted.pop("token_ids") == off["token_ids"]}
                report(f"{'':10} draft of {args.draft_layers} layers", off, drafted, row["draft"]["same_tokens"])
            off.pop("token_ids")
            if args.llama_server:
                gguf = embedded_model_gguf()
                peer_off = run_llama_server(gguf, prompts, outputs, [])
                peer_on = run_llama_server(gguf, prompts, outputs, [
                    "--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(args.lookup[1]),
                    "--spec-ngram-simple-size-m", str(args.num_speculative_tokens)])
                row["llama_server"] = {"off": peer_off, "on": peer_on,
                                       "speedup": peer_on["tokens_per_s"] / peer_off["tokens_per_s"]}
                print(f"{'':10} llama-server (native): {peer_off['tokens_per_s']:7.1f} -> "
                      f"{peer_on['tokens_per_s']:7.1f} tok/s = {row['llama_server']['speedup']:.2f}x; pagedserve "
                      f"with speculation / llama-server with: {on['tokens_per_s'] / peer_on['tokens_per_s']:.2f}x",
                      flush=True)
            rows.append(row)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"environment": env, "speculative_config": speculative, "draft": draft,
                                         "rows": rows}, indent=2))
    tmp.cleanup()


if __name__ == "__main__":
    main()
