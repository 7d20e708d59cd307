"""The benchmark scripts' own parts that decide what a GPU run measures, checked where no GPU is."""

from __future__ import annotations

import random

from benchmarks.synthetic_tokenizer import EOS, write_synthetic_tokenizer
from pagedserve.detokenizer import Detokenizer


def test_synthetic_tokenizer_has_the_vocabulary_asked_for(tmp_path):
    from transformers import AutoTokenizer

    eos = write_synthetic_tokenizer(tmp_path, 5000, seed=3)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == 5000 and eos == 4999 and tok.eos_token_id == eos and tok.convert_ids_to_tokens(eos) == EOS
    text = "the quick brown fox, 42 times"
    assert tok.decode(tok.encode(text)) == text
    ids = tok.encode(text)
    assert len(ids) < len(text)  # merges apply: words are not spelled out byte by byte
    # Random ids, as a random-weight model draws them, decode to text a piece at a time.
    rng = random.Random(0)
    drawn = [rng.randrange(256, 4999) for _ in range(200)]
    detok = Detokenizer(tok)
    assert tok.clean_up_tokenization_spaces is False  # the Rust decoder's fast path, as for Llama-3 and Qwen2
    for i in range(len(drawn)):
        detok.update(0, drawn[: i + 1], 0, skip_special_tokens=True, stop=[])
    assert detok.text(0) == tok.decode(drawn) and len(detok.text(0)) > 400


def test_decode_profile_runs_the_steps_as_generate_does_and_leaves_nothing_behind(tiny_random):
    """The throughput script's profile of decode steps (what a GPU run reports on the host side): it times
    and profiles steps of final-output-only requests, and leaves the engine with no request and no block."""
    from benchmarks.throughput import profile_decode
    from pagedserve import LLM

    with LLM(tiny_random, max_model_len=256, max_num_seqs=4, kv_cache_memory="8MiB") as llm:
        rng = random.Random(5)
        prompts = [[rng.randrange(100, 4000) for _ in range(n)] for n in (9, 30, 17)]
        timeline = profile_decode(llm, prompts, [4, 4, 4], steps=3)
        assert timeline["steps"] == 3 and timeline["rows"] == 3 and timeline["step_us_unprofiled"] > 0
        assert sorted(timeline["host_phases_us"]) == ["phase collect", "phase launch", "phase process",
                                                      "phase schedule"]
        assert all(us > 0 for us in timeline["host_phases_us"].values()) and timeline["host_ops"]
        assert "busy_us" not in timeline  # no device timeline off CUDA
        engine = llm.engine
        assert not engine.has_unfinished_requests()
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
