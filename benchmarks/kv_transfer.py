"""A long prefix fetched from the replica that holds it, beside computing it, in the same run, on the embedded SmolLM2.

  scripts/loopback-netns.sh python benchmarks/kv_transfer.py [--documents 6] [--document-tokens 1024] [--json F]

Three engines, each with its worker on a Ray actor of its own, as served replicas have: the holder has computed
`documents` long prefixes (random tokens of the vocabulary, each followed by an 8-token question); then each
prompt goes to two other replicas that hold none of it, one at a time: one fetches the prefix's full blocks from the
holder (the holder's next step reads them, each rank's pages move through Ray's object store to the same rank
here, the request's step copies them in) and computes the rest; the other computes the whole prompt. Each request
generates one token, so its time, fetch included, is its time to first token. The order of the two alternates from
one document to the next. Prints the TTFT of each path (mean, p50), the fetch's share, the ratio, and what the cost
model measured at start on the fetching replica would have chosen; the first tokens must be the same.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from environment import announce  # noqa: E402

BLOCK_SIZE = 16


def first_token(engine, prompt: list[int], kv_import=None) -> int:
    from pagedserve import SamplingParams

    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0), kv_import=kv_import)
    token = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            token = out.outputs[0].token_ids[0] if out.finished else token
    return token


def fetch(holder, engine, prompt: list[int]):
    """The prompt's full blocks exported by `holder` and staged on `engine`'s workers (a `PrefixImport`)."""
    export_id = holder.export_prefix(prompt)
    while export_id not in holder.exports_done:
        holder.step()
    return engine.import_prefix(holder.exports_done.pop(export_id), prompt)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--documents", type=int, default=6)
    p.add_argument("--document-tokens", type=int, default=1024)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    env = announce()
    import ray

    from pagedserve import LLM
    from pagedserve.engine.transfer_cost import measure

    # A logical CPU for each worker: one computes at a time here, on all the cores (worker_cpus unset).
    ray.init(num_cpus=4, include_dashboard=False)
    settings = dict(executor="ray", block_size=BLOCK_SIZE, max_num_seqs=4, kv_cache_memory="1GiB")
    holder, fetching, computing = (LLM(**settings) for _ in range(3))
    vocab = holder.llm_engine.model_config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(100, vocab) for _ in range(args.document_tokens + 8)] for _ in range(args.documents)]
    cost = measure(fetching.llm_engine)  # what a served replica measures at start
    for llm in (holder, fetching, computing):
        first_token(llm.llm_engine, [5] * 40)  # warm-up: nothing of the workload cached
    expected = [first_token(holder.llm_engine, prompt) for prompt in prompts]
    fetched_ttft, fetch_s, computed_ttft, fetched_first, computed_first = [], [], [], [], []
    for i, prompt in enumerate(prompts):
        for path in (("fetch", "compute") if i % 2 == 0 else ("compute", "fetch")):
            t0 = time.perf_counter()
            if path == "fetch":
                kv_import = fetch(holder.llm_engine, fetching.llm_engine, prompt)
                fetch_s.append(time.perf_counter() - t0)
                fetched_first.append(first_token(fetching.llm_engine, prompt, kv_import))
                fetched_ttft.append(time.perf_counter() - t0)
            else:
                computed_first.append(first_token(computing.llm_engine, prompt))
                computed_ttft.append(time.perf_counter() - t0)
    stats = fetching.stats()
    for llm in (holder, fetching, computing):
        llm.shutdown()
    num_blocks = args.document_tokens // BLOCK_SIZE
    rows = {"fetch": {"ttft_mean_s": statistics.fmean(fetched_ttft), "ttft_p50_s": statistics.median(fetched_ttft),
                      "fetch_mean_s": statistics.fmean(fetch_s), "hits": stats["kv_transfer_hits"]},
            "compute": {"ttft_mean_s": statistics.fmean(computed_ttft),
                        "ttft_p50_s": statistics.median(computed_ttft)},
            "cost_model": {"prefill_s": cost.prefill_seconds(num_blocks), "fetch_s": cost.fetch_seconds(num_blocks),
                           "chooses_fetch": cost.worth(num_blocks)}}
    same = fetched_first == computed_first == expected
    print(f"\n{args.documents} prompts of {args.document_tokens + 8} tokens, one at a time, each on a replica that "
          f"holds none of it; same first tokens: {'yes' if same else 'NO'}")
    print("| path | TTFT mean | p50 | of which the fetch | TTFT vs computing it |")
    print("| --- | ---: | ---: | ---: | ---: |")
    base = rows["compute"]["ttft_mean_s"]
    print(f"| compute the prompt | {base * 1e3:.1f} ms | {rows['compute']['ttft_p50_s'] * 1e3:.1f} ms | - | 1.00x |")
    f = rows["fetch"]
    print(f"| fetch {num_blocks} blocks, compute the rest | {f['ttft_mean_s'] * 1e3:.1f} ms | "
          f"{f['ttft_p50_s'] * 1e3:.1f} ms | {f['fetch_mean_s'] * 1e3:.1f} ms | {f['ttft_mean_s'] / base:.2f}x |")
    c = rows["cost_model"]
    print(f"cost model measured at start: {num_blocks} blocks fetched in {c['fetch_s'] * 1e3:.1f} ms, computed in "
          f"{c['prefill_s'] * 1e3:.1f} ms: it {'fetches' if c['chooses_fetch'] else 'computes'} them")
    if args.json is not None:
        args.json.write_text(json.dumps({"environment": env, "args": vars(args) | {"json": str(args.json)},
                                         "rows": rows, "same_first_tokens": same}, indent=2))


if __name__ == "__main__":
    main()
