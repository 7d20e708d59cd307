"""xgrammar beside llguidance on the embedded SmolLM2 tokenizer: compile time of a nested JSON schema and
the time of each step's token mask while a valid answer is fed through.

    .venv/bin/pip install --target benchmarks/.peers/llguidance --no-deps llguidance==1.9.1
    PYTHONPATH=benchmarks/.peers/llguidance .venv/bin/python benchmarks/grammar_backends.py

llguidance is a peer here, in its own directory, not a dependency of the package.
"""

from __future__ import annotations

import json
import time

import torch  # noqa: F401  (llguidance.torch and xgrammar expect it loaded)
from environment import announce
from transformers import AutoTokenizer

from pagedserve.workers.loader import resolve_model

VOCAB = 49152  # SmolLM2's logits width
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city"]}}, "required": ["name", "age"]}
ANSWER = json.dumps({"name": "Ann", "age": 31, "tags": ["a", "c"], "address": {"city": "Paris"}})


def report(name: str, compile_s: float, steps: list[float]) -> None:
    mean = sum(steps) / len(steps)
    print(f"{name:12s} compile {compile_s * 1e3:7.1f} ms   mask per step: mean {mean * 1e6:6.0f} us, "
          f"max {max(steps) * 1e6:6.0f} us ({len(steps)} steps)")


def main() -> None:
    announce()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None).tokenizer_dir)
    ids = tokenizer.encode(ANSWER)

    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB),
                                   max_threads=1, cache_enabled=False)
    t = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    compile_s = time.perf_counter() - t
    matcher, bitmask, steps = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, VOCAB), []
    for token in ids:
        t = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        steps.append(time.perf_counter() - t)
        assert matcher.accept_token(token)
    report("xgrammar", compile_s, steps)

    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=VOCAB)
    t = time.perf_counter()
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA))
    compile_s = time.perf_counter() - t
    bitmask, steps = llguidance.torch.allocate_token_bitmask(1, lltok.vocab_size), []
    for token in ids:
        t = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        steps.append(time.perf_counter() - t)
        assert matcher.consume_token(token), matcher.get_error()
    report("llguidance", compile_s, steps)


if __name__ == "__main__":
    main()
