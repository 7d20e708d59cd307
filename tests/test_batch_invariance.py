"""On the CPU backend in fp32, a request's outputs do not depend on how it was scheduled: alone or among
others, prefilled in one chunk or many, from the prefix cache, recomputed after a preemption, stepped one at a
time or scheduled ahead. Its tokens, logprobs and prompt logprobs are the same bits every time, so a seeded
request gives the same text whatever the load on the server.

Every kernel on that path computes a row the same way whatever else is in the step (tested kernel by kernel
in test_quant_linear.py, test_cpu_attention.py and test_cpu_layer_ops.py); this checks the whole model on the
embedded SmolLM2, on its GGUF blocks and on its fp32 weights. (oneDNN's GEMM, which bf16 layers use, blocks
by the batch's rows: there a row's last bits depend on the batch.)"""

from __future__ import annotations

import functools

import pytest

from pagedserve import LLM, SamplingParams

from .test_async_scheduling import PROMPTS, SMALL

TARGET = SamplingParams(temperature=0.8, seed=7, max_tokens=40, logprobs=5, prompt_logprobs=3)
CACHED = SamplingParams(temperature=0.8, seed=7, max_tokens=40, logprobs=5)  # prompt logprobs read no cache
OTHERS = [SamplingParams(temperature=0.9, seed=i, max_tokens=40) for i in range(len(PROMPTS) - 1)]


def exact(out) -> tuple:
    """Everything the request returned: tokens, text, and every logprob to the last bit."""
    c = out.outputs[0]
    return (c.token_ids, c.text, [(e.token_id, e.logprob, [(t.token_id, t.logprob) for t in e.top_logprobs])
                                  for e in c.logprobs],
            [None if e is None else (e.token_id, e.logprob, [(t.token_id, t.logprob) for t in e.top_logprobs])
             for e in out.prompt_logprobs or ()])


def preempted_mid_decode(llm) -> list[list[int]]:
    """Record the prompts of the sequences preempted after drawing a token (their recompute then runs drawn
    tokens through prefill); returns the list it fills."""
    scheduler = llm.llm_engine.scheduler
    preempt, seen = scheduler._preempt, []

    def record(seq):
        if seq.num_output_tokens > 0:
            seen.append(seq.request.prompt_token_ids)
        preempt(seq)
    scheduler._preempt = record
    return seen


@pytest.mark.parametrize("gguf_linears", [True, False], ids=["gguf-blocks", "fp32-weights"])
def test_a_seeded_request_gets_the_same_bits_however_it_is_scheduled(embedded_dir, gguf_linears):
    target = PROMPTS[-1]  # the last to come: the first to be preempted
    engine = functools.partial(LLM, gguf_linears=gguf_linears)
    with engine(str(embedded_dir)) as llm:
        alone = exact(llm.generate([target], [TARGET])[0])
        prompt_ids = llm.tokenizer.encode(target)
    got = {}
    with engine(str(embedded_dir)) as llm:
        got["among others"] = exact(llm.generate(PROMPTS, [*OTHERS, TARGET])[-1])
        first = exact(llm.generate([target], [CACHED])[0])
        hits = llm.stats()["prefix_cache_hits"]
        again = exact(llm.generate([target], [CACHED])[0])
        assert llm.stats()["prefix_cache_hits"] > hits
        assert first[:3] == again[:3] == alone[:3], "from the prefix cache"
    with engine(str(embedded_dir), max_num_batched_tokens=7) as llm:
        got["in chunks of 7 tokens"] = exact(llm.generate([target], [TARGET])[0])
    for async_scheduling in (False, True):
        with engine(str(embedded_dir), async_scheduling=async_scheduling, **SMALL) as llm:
            seen = preempted_mid_decode(llm)
            outputs = llm.generate(PROMPTS, [*OTHERS, TARGET])
            got[f"preempted (async_scheduling={async_scheduling})"] = exact(outputs[-1])
            assert prompt_ids in seen, "the target must have been preempted after drawing tokens"
    for how, outputs in got.items():
        assert outputs == alone, how
