"""Async scheduling: each step is scheduled and launched while the one before it runs, the tokens that step
draws filled in on the worker. The outputs must be exactly those of stepping one at a time, through
everything that reads a step's draws: stop strings, stop tokens and EOS found one step late, min_tokens,
seeded sampling, the fork into n samples, penalties, logprobs, prompt logprobs, a grammar, chunked
prefill, preemption while a token is in flight, and an abort between steps.

The scheduler's side (placeholders, preemption, prefix caching) is checked against a model-free oracle in
test_scheduler.py; this runs the embedded SmolLM2 on the in-process worker."""

from __future__ import annotations

import json
import re

import pytest

from pagedserve import LLM, LLMEngine, SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.sampling_params import StructuredOutputs

from .conftest import launched_batches

STORY = "A short note, written for a reader who is in no hurry at all and likes details: "  # ~20 tokens
PROMPTS = [f"{STORY}{i}. {p}" for i, p in enumerate([
    "The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
    "List three colors:", "The quick brown fox", "Water boils at", "My favourite book is", "In 1969, astronauts",
    "Rivers flow toward"])]
# A pool of 14 blocks of 16 tokens and chunks of 32 tokens: the nine requests preempt one another.
SMALL = dict(kv_cache_memory=14 * 16 * 30 * 2 * 3 * 64 * 4, max_num_batched_tokens=32, max_num_seqs=8)


def params_mix(stop_text: str, stop_token: int) -> list[SamplingParams]:
    # A step with the fork into n samples is not scheduled ahead (the next step must know the draw on the
    # host first): that request is short, so that most steps are. Penalties are scheduled ahead: the
    # worker counts each draw of theirs itself; so is a grammar's, whose mask follows the launch.
    return [
        SamplingParams(temperature=0, max_tokens=40),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=32, stop=[stop_text]),
        SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=24),
        SamplingParams(temperature=0, max_tokens=40, repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0, max_tokens=40, min_tokens=12, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0.7, seed=11, max_tokens=24, logprobs=3, prompt_logprobs=2),
        SamplingParams(temperature=0.8, seed=5, max_tokens=10,
                       structured_outputs=StructuredOutputs(choice=["alpha", "beta", "gamma delta"])),
        SamplingParams(temperature=0.9, seed=13, max_tokens=40, frequency_penalty=1.5),
    ]


def summary(out) -> tuple[list, list]:
    """(tokens, text, finish and the scored tokens; their logprobs): both must match to the last bit, as the CPU
    kernels give a row the same bits whatever else shares its steps (test_batch_invariance.py)."""
    def entries(logprobs):
        return [] if logprobs is None else [
            (e.token_id, e.logprob, [(t.token_id, t.logprob) for t in e.top_logprobs])
            for e in logprobs if e is not None]  # offline prompt_logprobs[0] is None, as vLLM's
    exact = [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in out.outputs]
    scored = entries(out.prompt_logprobs) + [e for c in out.outputs for e in entries(c.logprobs)]
    exact.append([(token, [t for t, _ in top]) for token, _, top in scored])
    values = [v for _, value, top in scored for v in [value, *(x for _, x in top)] if v is not None]
    return exact, values


def run(embedded_dir, async_scheduling: bool, params: list[SamplingParams], **engine) -> tuple[list, dict, dict]:
    """(summaries, stats, counts: "ahead" steps scheduled ahead, "penalties" of them drawing for a penalized
    request, whose counts the worker keeps, "histories" penalized draws that carried their token history)."""
    with LLM(str(embedded_dir), async_scheduling=async_scheduling, **SMALL, **engine) as llm:
        with launched_batches(llm.llm_engine) as batches:
            outs = llm.generate(PROMPTS, params)
        counts = {"ahead": sum(bool(b.deferred_inputs) for b in batches),
                  "late masks": sum(bool(b.late_masks) for b in batches),
                  "penalties": sum(bool(b.deferred_inputs) and any(s.params.needs_penalties for s in b.samples)
                                   for b in batches),
                  "histories": sum(s.prompt_token_ids is not None for b in batches for s in b.samples)}
        return [summary(o) for o in outs], llm.stats(), counts


_ONE_AT_A_TIME: dict[tuple[str, str], list] = {}


def one_at_a_time(embedded_dir, params: list[SamplingParams]) -> list:
    """`run`'s summaries stepping one at a time, the reference of every engine here: computed once a process (this
    module's tests and test_cluster.py's compare several engines with it)."""
    key = (str(embedded_dir), repr(params))
    if key not in _ONE_AT_A_TIME:
        summaries, _, counts = run(embedded_dir, False, params)
        assert counts["ahead"] == 0
        _ONE_AT_A_TIME[key] = summaries
    return _ONE_AT_A_TIME[key]


def check_same_outputs(embedded_dir, **engine) -> None:
    """The mixed workload scheduled ahead on the engine that `engine` configures gives the outputs of the
    in-process engine stepping one at a time."""
    with LLM(str(embedded_dir)) as llm:
        sampled, greedy = [o.outputs[0] for o in llm.generate(
            [PROMPTS[1], PROMPTS[4]], [SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=32),
                                       SamplingParams(temperature=0, max_tokens=40)])]
    stop_text = sampled.text[len(sampled.text) // 2:][:4]  # found midway through request 1's text
    assert stop_text.strip(), sampled.text
    stop_token = greedy.token_ids[16]  # ends request 4 early (and request 5, if at all, after min_tokens)
    params = params_mix(stop_text, stop_token)

    sync = one_at_a_time(embedded_dir, params)
    ahead, stats, counts = run(embedded_dir, True, params, **engine)
    assert counts["ahead"] > 20, "steps must have been scheduled ahead"
    assert counts["penalties"] > 10, "penalized requests must have been scheduled ahead"
    # Two penalized requests of up to 40 draws: a history with the first and after each preemption only.
    assert 2 <= counts["histories"] <= 2 + stats["num_preemptions"], counts
    assert stats["num_preemptions"] > 0, "the pool must be small enough to preempt"
    for i, ((want, want_values), (got, got_values)) in enumerate(zip(sync, ahead, strict=True)):
        assert got == want, f"request {i} ({params[i]})"
        assert got_values == want_values, f"request {i} ({params[i]})"
    assert len(ahead[6][1]) > 24 * 4  # scored prompt and output tokens, with their top alternatives
    assert ahead[1][0][0][2] == "stop" and ahead[4][0][0][2] == "stop"  # stops found one step late
    assert len(ahead[5][0][0][0]) >= 12
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_outputs_match_stepping_one_at_a_time(embedded_dir):
    check_same_outputs(embedded_dir)


GRAMMARS = [
    StructuredOutputs(choice=["alpha", "beta", "gamma delta"]),
    StructuredOutputs(regex=r"[0-9]{3}-[a-z]{4}"),
    StructuredOutputs(json={"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
                            "required": ["n", "ok"]}),
]


def grammar_mix() -> list[SamplingParams]:
    """Six constrained requests of three grammars (seeded, so they differ) among three plain ones."""
    constrained = [SamplingParams(temperature=0.9, seed=i, max_tokens=30, structured_outputs=GRAMMARS[i % 3])
                   for i in range(6)]
    return constrained + [SamplingParams(temperature=0, max_tokens=30) for _ in range(3)]


def check_grammars_scheduled_ahead(embedded_dir, **engine) -> None:
    """Grammar steps scheduled ahead, their masks sent once the step before is processed, give the outputs
    of stepping one at a time, and every output keeps to its grammar."""
    params = grammar_mix()
    sync = one_at_a_time(embedded_dir, params)
    ahead, stats, counts = run(embedded_dir, True, params, **engine)
    assert counts["late masks"] > 10 and counts["ahead"] > 20, counts
    for i, ((want, want_values), (got, got_values)) in enumerate(zip(sync, ahead, strict=True)):
        assert got == want, f"request {i} ({params[i]})"
        assert got_values == want_values, f"request {i} ({params[i]})"
    texts = [exact[0][1] for exact, _ in ahead]
    assert texts[0] in ("alpha", "beta", "gamma delta") and texts[3] in ("alpha", "beta", "gamma delta")
    assert re.fullmatch(r"[0-9]{3}-[a-z]{4}", texts[1]) and re.fullmatch(r"[0-9]{3}-[a-z]{4}", texts[4])
    for i in (2, 5):
        if ahead[i][0][0][2] == "stop":  # complete (else cut by max_tokens)
            assert set(json.loads(texts[i])) == {"n", "ok"}, texts[i]
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_grammar_steps_are_scheduled_ahead(embedded_dir):
    check_grammars_scheduled_ahead(embedded_dir)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_abort_between_steps_frees_everything(embedded_dir, async_scheduling):
    engine = LLMEngine(EngineConfig(model=str(embedded_dir), async_scheduling=async_scheduling, **SMALL))
    try:
        ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
               for p in PROMPTS[:4]]
        outputs: dict[str, list[int]] = {}
        for _ in range(6):
            for out in engine.step():
                outputs[out.request_id] = out.outputs[0].token_ids
        aborted = engine.abort_request(ids[0])
        assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
        assert aborted.outputs[0].token_ids == outputs[ids[0]]  # what was reported, nothing drawn since
        finished = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
        assert sorted(finished) == sorted(ids[1:])
        assert all(len(o.outputs[0].token_ids) == 30 for o in finished.values())
        engine.step()  # a step launched ahead for requests that all ended is processed, and nothing breaks
        stats = engine.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        assert not engine.scheduler.seqs
    finally:
        engine.shutdown()
