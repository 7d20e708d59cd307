"""Decode CUDA graphs: their static-buffer path (padding to a captured size, inputs copied in, hidden
states sliced out) runs eagerly here (capture=False) and must give the very tokens of the plain path.
Capture itself needs a GPU: the last test runs there (benchmarks/gpu_check.sh), as does HF parity with it."""

from __future__ import annotations

import json

import pytest
import torch

from pagedserve import LLM
from pagedserve.cli import _parser
from pagedserve.config import EngineConfig
from pagedserve.sampling_params import SamplingParams
from pagedserve.workers.cuda_graph import graph_batch_sizes

PROMPTS = [[(7 * i + 13 * j) % 400 + 5 for j in range(n)] for i, n in enumerate([3, 17, 40, 9, 33, 5, 64, 21, 2, 12])]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    """A 2-layer random Llama needing no tokenizer or embedded checkpoint, so this file also runs on the
    GPU machine (which has no gguf)."""
    d = tmp_path_factory.mktemp("tiny_llama")
    (d / "config.json").write_text(json.dumps(dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=True, hidden_act="silu")))
    return f"random:{d / 'config.json'}"


@pytest.fixture(scope="module")
def tiny_hybrid(tmp_path_factory) -> str:
    """A 2-layer random Qwen2 whose second layer slides (a window of 10): two KV-cache groups, each with block
    tables of its own in the graphs' static buffers."""
    d = tmp_path_factory.mktemp("tiny_hybrid")
    (d / "config.json").write_text(json.dumps(dict(
        model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=512, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=True, hidden_act="silu",
        use_sliding_window=True, sliding_window=10, max_window_layers=1)))
    return f"random:{d / 'config.json'}"


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> str:
    """A 2-layer random Qwen3-MoE (8 experts, top 2): on the Triton backend its experts run in the fused kernel,
    which never waits for the host, so its decode steps are captured too."""
    d = tmp_path_factory.mktemp("tiny_moe")
    (d / "config.json").write_text(json.dumps(dict(
        model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=512, hidden_size=64,
        intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu")))
    return f"random:{d / 'config.json'}"


@pytest.mark.parametrize("max_num_seqs,expected", [
    (1, [1]), (5, [1, 2, 4, 5]), (8, [1, 2, 4, 8]), (16, [1, 2, 4, 8, 16]),
    (40, [1, 2, 4, 8, 16, 32, 40]), (256, [1, 2, 4, 8] + list(range(16, 257, 16)))])
def test_graph_batch_sizes(max_num_seqs, expected):
    assert graph_batch_sizes(max_num_seqs) == expected


def generate(model: str, backend: str, static: bool, capture: bool = False, prompts: list[list[int]] = PROMPTS,
             max_tokens: int = 24, **config) -> tuple[list, int]:
    # fp32 everywhere: on a GPU, bf16 rounding of padded vs unpadded products could flip near-ties. A small
    # KV pool: on a GPU, engines in parallel test processes each get one (the default takes 0.9 of the card).
    with LLM(model, attention_backend=backend, max_model_len=256, dtype="float32", cuda_graphs=capture,
             kv_cache_memory="64MiB", **config) as llm:
        runner = llm.llm_engine.executor.worker.runner
        if static and not capture:  # captured graphs come from the engine setting, as users get them
            runner.use_decode_graphs(llm.llm_engine.config.max_num_seqs, llm.llm_engine.max_model_len, capture=False)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
        outs = llm.generate(prompts, params)
        runs = runner.decode_graphs.num_runs if static else 0
        return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs], runs


# 10 prompts with max_num_seqs=12: decode batches of 10 and fewer, padded to 12 (or 8, 4, 2, 1); a
# 24-token budget chunks the prefills, so mixed steps take the plain path in between.
CONFIG = dict(max_num_seqs=12, max_num_batched_tokens=24)


# Both models on the reference backend; on Triton's (in its interpreter without a GPU, where each program is Python)
# the hybrid model, whose full layers are the plain one's, and the MoE model: the fused kernel is what its graphs
# capture. Without a GPU the Triton cases take half the prompts (decode batches of 5 padded to 6) and 14 tokens each:
# the same paths, fewer times.
STATIC_CASES = [("tiny_llama", "reference"), ("tiny_hybrid", "reference"), ("tiny_hybrid", "triton"),
                ("tiny_moe", "triton")]


@pytest.mark.parametrize("model, backend", STATIC_CASES)
def test_static_decode_path_matches_the_plain_path(model, backend, request):
    model = request.getfixturevalue(model)
    config = dict(CONFIG, max_tokens=24)
    if backend == "triton" and not torch.cuda.is_available():
        config = dict(CONFIG, max_num_seqs=6, prompts=PROMPTS[:5], max_tokens=14)
    plain, _ = generate(model, backend, static=False, **config)
    static, runs = generate(model, backend, static=True, **config)
    assert runs >= config["max_tokens"] - 4  # the static path served most steps
    for (tokens_p, lp_p), (tokens_s, lp_s) in zip(plain, static, strict=True):
        assert tokens_s == tokens_p
        assert lp_s == pytest.approx(lp_p, abs=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU")
@pytest.mark.parametrize("model", ["tiny_llama", "tiny_hybrid", "tiny_moe"])
def test_captured_graphs_match_the_plain_path(model, request):
    model = request.getfixturevalue(model)
    plain, _ = generate(model, "triton", static=False, **CONFIG)
    graphed, runs = generate(model, "triton", static=True, capture=True, **CONFIG)
    assert runs >= 20
    for (tokens_p, lp_p), (tokens_g, lp_g) in zip(plain, graphed, strict=True):
        assert tokens_g == tokens_p
        assert lp_g == pytest.approx(lp_p, abs=1e-4)


def test_graphs_are_on_by_default_for_cuda_workers_only():
    assert EngineConfig().replays_graphs("cuda") and not EngineConfig().replays_graphs("cpu")
    assert not EngineConfig(cuda_graphs=False).replays_graphs("cuda")
    assert EngineConfig(cuda_graphs=True).replays_graphs("cuda")
    with pytest.raises(ValueError, match="cuda_graphs='yes' must be true, false or null"):
        EngineConfig(cuda_graphs="yes")
    # The command line leaves the choice to the engine unless told either way.
    assert _parser().parse_args(["generate", "hi"]).cuda_graphs is None
    assert _parser().parse_args(["generate", "hi", "--no-cuda-graphs"]).cuda_graphs is False


def test_a_cpu_engine_left_at_the_default_replays_no_graphs(tiny_llama):
    with LLM(tiny_llama, max_model_len=256, device="cpu") as llm:
        assert llm.llm_engine.config.cuda_graphs is None
        assert llm.llm_engine.executor.worker.runner.decode_graphs is None
