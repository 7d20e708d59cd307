"""Decode CUDA graphs: their static-buffer path (padding to a captured size, inputs copied in, hidden
states sliced out) runs eagerly here (capture=False) and must give the very tokens of the plain path.
Capture itself needs a GPU: benchmarks/gpu_check.sh runs the parity check with it on."""

from __future__ import annotations

import pytest

from pagedserve.engine import LLM
from pagedserve.sampling_params import SamplingParams
from pagedserve.workers.cuda_graph import graph_batch_sizes

PROMPTS = [[(7 * i + 13 * j) % 400 + 5 for j in range(n)] for i, n in enumerate([3, 17, 40, 9, 33, 5, 64, 21, 2, 12])]


@pytest.mark.parametrize("max_num_seqs,expected", [
    (1, [1]), (5, [1, 2, 4, 5]), (8, [1, 2, 4, 8]), (16, [1, 2, 4, 8, 16]),
    (40, [1, 2, 4, 8, 16, 32, 40]), (256, [1, 2, 4, 8] + list(range(16, 257, 16)))])
def test_graph_batch_sizes(max_num_seqs, expected):
    assert graph_batch_sizes(max_num_seqs) == expected


def generate(model: str, backend: str, static: bool, **config) -> tuple[list, int]:
    with LLM(model, attention_backend=backend, max_model_len=256, **config) as llm:
        runner = llm.engine.executor.worker.runner
        if static:
            runner.use_decode_graphs(llm.engine.config.max_num_seqs, llm.engine.max_model_len, capture=False)
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
        outs = llm.generate(PROMPTS, params)
        runs = runner.decode_graphs.num_runs if static else 0
        return [(o.outputs[0].token_ids, [lp["logprob"] for lp in o.outputs[0].logprobs]) for o in outs], runs


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_static_decode_path_matches_the_plain_path(tiny_random, backend):
    # 10 prompts with max_num_seqs=12: decode batches of 10 and fewer, padded to 12 (or 8, 4, 2, 1);
    # a 24-token budget chunks the prefills, so mixed steps take the plain path in between.
    config = dict(max_num_seqs=12, max_num_batched_tokens=24)
    plain, _ = generate(tiny_random, backend, static=False, **config)
    static, runs = generate(tiny_random, backend, static=True, **config)
    assert runs >= 20  # the static path served most steps
    for (tokens_p, lp_p), (tokens_s, lp_s) in zip(plain, static, strict=True):
        assert tokens_s == tokens_p
        assert lp_s == pytest.approx(lp_p, abs=1e-4)
