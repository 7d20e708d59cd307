"""What structured outputs cost: grammar compile time (cold and cached), and throughput of a batch of
JSON-schema requests beside the same number of unconstrained ones, in the same run.

    .venv/bin/python benchmarks/structured_output.py [--requests 16] [--max-tokens 96] [--repeats 3]

Embedded SmolLM2-135M-Instruct, offline engine. The three workloads (constrained alone, unconstrained
alone, both mixed) alternate `--repeats` times, so that drift of the machine falls on all of them alike.
The engine's grammar work (masks and matcher updates, on the host) is timed on its own during the mixed
runs, as a share of their wall time: that share is what an unconstrained row waits for in a mixed batch.
"""

from __future__ import annotations

import argparse
import statistics
import time

from environment import announce

from pagedserve import LLM, SamplingParams
from pagedserve.sampling_params import StructuredOutputs

ASK = [{"role": "user", "content": "Describe a person as JSON."}]


def schema(i: int) -> dict:
    return {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12 + i % 5},
        "age": {"type": "integer", "minimum": 0, "maximum": 100 + i},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 1 + i % 3},
        "home": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                 "required": ["city"], "additionalProperties": False}},
        "required": ["name", "age", "tags", "home"], "additionalProperties": False}


def timed(llm: LLM, prompts: list, params: list[SamplingParams]) -> tuple[float, int, int]:
    """(seconds, output tokens of constrained requests, output tokens of the others)."""
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    constrained = sum(len(o.outputs[0].token_ids) for o, p in zip(outs, params, strict=True)
                      if p.structured_outputs is not None)
    plain = sum(len(o.outputs[0].token_ids) for o, p in zip(outs, params, strict=True) if p.structured_outputs is None)
    return seconds, constrained, plain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    announce()

    llm = LLM()
    grammars = llm.llm_engine.grammars
    t0 = time.perf_counter()
    grammars.compile(StructuredOutputs(json=schema(10_000)))
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammars.compile(StructuredOutputs(json=schema(10_000)))
    cached = time.perf_counter() - t0
    print(f"grammar compile: cold {cold * 1e3:.1f} ms, cached {cached * 1e6:.1f} us")

    prompt = llm.llm_engine.inputs.chat_prompt(ASK)
    n = args.requests
    # Constrained requests stop when their JSON is complete; unconstrained ones run to max_tokens. Tokens/s
    # is counted per kind, so the comparison holds even though their lengths differ.
    plain = [SamplingParams(temperature=0.7, seed=i, max_tokens=args.max_tokens, ignore_eos=True) for i in range(n)]
    json_params = [SamplingParams(temperature=0.7, seed=i, max_tokens=args.max_tokens,
                                  structured_outputs=StructuredOutputs(json=schema(i))) for i in range(n)]
    for p in json_params:  # compiled before timing: the runs measure decoding, not compilation
        grammars.compile(p.structured_outputs)
    llm.generate([prompt], SamplingParams(max_tokens=4))  # warm-up
    rates: dict[str, list[float]] = {"unconstrained alone": [], "constrained alone": [],
                                     "mixed: unconstrained": [], "mixed: constrained": [], "mixed: all": []}
    grammar_seconds = [0.0]
    for name in ("fill_masks", "advance"):
        original = getattr(grammars, name)

        def timed_call(*a, _original=original, **kw):
            t = time.perf_counter()
            try:
                return _original(*a, **kw)
            finally:
                grammar_seconds[0] += time.perf_counter() - t
        setattr(grammars, name, timed_call)
    mixed_seconds = mixed_grammar_seconds = 0.0
    for _ in range(args.repeats):
        s, _, p_tokens = timed(llm, [prompt] * n, plain)
        rates["unconstrained alone"].append(p_tokens / s)
        s, c_tokens, _ = timed(llm, [prompt] * n, json_params)
        rates["constrained alone"].append(c_tokens / s)
        before = grammar_seconds[0]
        s, c_tokens, p_tokens = timed(llm, [prompt] * (2 * n), [x for pair in zip(plain, json_params,
                                                                                   strict=True) for x in pair])
        mixed_seconds += s
        mixed_grammar_seconds += grammar_seconds[0] - before
        rates["mixed: unconstrained"].append(p_tokens / s)
        rates["mixed: constrained"].append(c_tokens / s)
        rates["mixed: all"].append((p_tokens + c_tokens) / s)
    print(f"{n} JSON-schema requests and {n} unconstrained ones, max_tokens {args.max_tokens}, "
          f"{args.repeats} repeats (output tokens/s, median; each run's figures in brackets)")
    for name, values in rates.items():
        print(f"  {name:22s} {statistics.median(values):8.1f}   [{', '.join(f'{v:.1f}' for v in values)}]")
    print(f"grammar work in the mixed runs: {mixed_grammar_seconds:.2f} s of {mixed_seconds:.1f} s "
          f"({mixed_grammar_seconds / mixed_seconds:.1%})")
    llm.shutdown()


if __name__ == "__main__":
    main()
