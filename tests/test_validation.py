"""Every bad input raises ValueError naming the field, and the engine keeps serving."""

from __future__ import annotations

import pytest

from pagedserve import LLM, LLMEngine, SamplingParams
from pagedserve.config import EngineConfig


@pytest.fixture(scope="module")
def llm(tiny_random):
    return LLM(tiny_random, max_model_len=256, kv_cache_memory=64 * 16 * 2 * 2 * 2 * 16 * 4)  # 64 blocks


def greedy(max_tokens=8, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.mark.parametrize("make, field", [
    (lambda: SamplingParams(max_tokens=0), "max_tokens"),
    (lambda: SamplingParams(temperature=-0.1), "temperature"),
    (lambda: SamplingParams(top_p=0.0), "top_p"),
    (lambda: SamplingParams(top_p=1.5), "top_p"),
    (lambda: SamplingParams(top_k=0), "top_k"),
    (lambda: SamplingParams(top_k=-2), "top_k"),
    (lambda: SamplingParams(n=0), "n"),
    (lambda: SamplingParams(min_p=2), "min_p"),
    (lambda: SamplingParams(repetition_penalty=0), "repetition_penalty"),
    (lambda: SamplingParams(logprobs=-1), "logprobs"),
    (lambda: SamplingParams(stop=[""]), "stop"),
    # Values the workers cannot compute with: past a seeded draw's 64 bits, or past float32 (inf, NaN, or 0)
    (lambda: SamplingParams(seed=2**63), "seed"),
    (lambda: SamplingParams(seed=-2**63 - 1), "seed"),
    (lambda: SamplingParams(seed=2**64), "seed"),
    (lambda: SamplingParams(temperature=1e39), "temperature"),
    (lambda: SamplingParams(temperature=10**400), "temperature"),
    (lambda: SamplingParams(top_p=1e-50), "top_p"),
    (lambda: SamplingParams(top_p=1e-320), "top_p"),
    (lambda: SamplingParams(repetition_penalty=1e-320), "repetition_penalty"),
    (lambda: SamplingParams(repetition_penalty=1e-30), "repetition_penalty"),
    (lambda: SamplingParams(repetition_penalty=1e39), "repetition_penalty"),
    (lambda: SamplingParams(repetition_penalty=10**400), "repetition_penalty"),
    (lambda: SamplingParams(logit_bias={5: 10**400}), r"logit_bias\[5\]"),
    (lambda: SamplingParams(n=2, use_beam_search=True, length_penalty=1e308), "length_penalty"),
    (lambda: SamplingParams(n=2, use_beam_search=True, length_penalty=-1e308), "length_penalty"),
    (lambda: SamplingParams(n=2, use_beam_search=True, length_penalty=33), "length_penalty"),
])
def test_bad_sampling_params_name_the_field(make, field):
    with pytest.raises(ValueError, match=rf"^{field}="):
        make()


def test_seed_is_a_signed_64_bit_integer():
    with pytest.raises(ValueError, match=r"^seed=9223372036854775808 must be None or an integer in "
                                         r"\[-9223372036854775808, 9223372036854775807\]$"):
        SamplingParams(seed=2**63)
    with pytest.raises(ValueError, match=r"^seed=<an integer of 16610 bits> must be"):
        SamplingParams(seed=10**5000)  # too long to write out: named by its size
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1 and SamplingParams(seed=-2**63).seed == -2**63


def test_the_extreme_seeds_are_drawn_with(llm):
    outs = llm.generate([[5, 6, 7]] * 2, [SamplingParams(temperature=1.0, seed=seed, max_tokens=6, ignore_eos=True)
                                          for seed in (2**63 - 1, -2**63)])
    assert all(o.error is None and len(o.outputs[0].token_ids) == 6 for o in outs)


def test_a_temperature_below_1e_5_is_greedy(llm):
    """Sampling tends to greedy as the temperature tends to 0; dividing logits by a tiny one would overflow
    float32 into NaN (a garbage token) instead."""
    assert SamplingParams(temperature=1e-6).greedy and not SamplingParams(temperature=1e-5).greedy
    expected = llm.generate([[5, 6, 7]], greedy())[0].outputs[0].token_ids
    for temperature in (1e-300, 1e-40, 1e-6, -0.0):
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=temperature, seed=1, max_tokens=8, ignore_eos=True))
        assert out[0].outputs[0].token_ids == expected, temperature


def test_a_float_field_given_as_an_int_reaches_the_workers_as_a_float():
    params = SamplingParams(temperature=2, repetition_penalty=10**30, top_p=1, min_p=0, length_penalty=1)
    assert all(type(getattr(params, name)) is float
               for name in ("temperature", "repetition_penalty", "top_p", "min_p", "length_penalty"))


def test_params_mutated_after_construction_are_checked(llm):
    params = greedy()
    params.top_k = 0
    with pytest.raises(ValueError, match="top_k"):
        llm.generate(["hello"], params)


@pytest.mark.parametrize("prompt, field", [
    ("", "prompt is empty"),
    ([], "prompt is empty"),
    ([1, 2, 49152], "prompt_token_ids"),
    ([1, -1], "prompt_token_ids"),
    ([1, "a"], "prompt_token_ids"),
    (list(range(1, 300)), "max_model_len"),
    (3.5, "prompt must be"),
    ({"prompt": "hi", "multi_modal_data": {}}, r"prompt has keys \['multi_modal_data'\] that are not supported"),
    ({"prompt": "hi", "prompt_token_ids": [1]}, "prompt: give one of prompt, prompt_token_ids, not 2"),
    ({"prompt": [1]}, "prompt.prompt must be a string"),
    ({"prompt_token_ids": "hi"}, "prompt.prompt_token_ids must be a list"),
    ({"prompt_token_ids": [1, 49152]}, "prompt_token_ids"),
])
def test_bad_prompts_name_the_field(llm, prompt, field):
    with pytest.raises(ValueError, match=field):
        llm.generate([prompt], greedy())


def test_vllms_prompt_dicts_are_the_text_or_ids_they_hold(llm):
    text, ids = "Once upon a time", [5, 6, 7]
    plain = llm.generate([text, ids], greedy(4))
    dicts = llm.generate([{"prompt": text}, {"prompt_token_ids": ids}], greedy(4))
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    assert dicts[0].prompt == text and dicts[0].prompt_token_ids == plain[0].prompt_token_ids
    assert llm.generate({"prompt_token_ids": ids}, greedy(4))[0].prompt_token_ids == ids  # one dict: one prompt


def test_truncate_prompt_tokens_minus_1_keeps_the_last_tokens_that_leave_room(llm):
    prompt = [5 + i % 100 for i in range(300)]  # longer than the 256-token context
    out = llm.generate(prompt, greedy(8, truncate_prompt_tokens=-1))[0]
    assert out.prompt_token_ids == prompt[-248:] and len(out.outputs[0].token_ids) == 8
    whole = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=None, truncate_prompt_tokens=-1))[0]
    assert whole.prompt_token_ids == prompt[-255:] and len(whole.outputs[0].token_ids) == 1
    short = llm.generate(prompt[:20], greedy(8, truncate_prompt_tokens=-1))[0]
    assert short.prompt_token_ids == prompt[:20]  # a prompt with room is whole
    with pytest.raises(ValueError, match="max_tokens=256 leaves no room for a prompt in a context of 256"):
        llm.generate(prompt, greedy(256, truncate_prompt_tokens=-1))
    with pytest.raises(ValueError, match=r"^truncate_prompt_tokens=-2 must be None, -1"):
        greedy(truncate_prompt_tokens=-2)


def test_request_longer_than_model_len_names_max_tokens(llm):
    with pytest.raises(ValueError, match="max_tokens=255"):
        llm.generate(["hello there"], greedy(max_tokens=255))


def test_request_that_can_never_fit_the_pool(tiny_random):
    small = LLM(tiny_random, kv_cache_memory=4 * 16 * 2 * 2 * 2 * 16 * 4)  # 4 blocks of 16 tokens
    assert small.stats()["num_total_blocks"] == 4
    with pytest.raises(ValueError, match="can never fit"):
        small.generate([[5] * 40], greedy(max_tokens=30))
    out = small.generate([[5] * 40], greedy(max_tokens=20))[0]  # 60 tokens: fits alone
    assert len(out.outputs[0].token_ids) == 20


def test_bad_prompt_in_a_batch_leaves_the_engine_clean(llm):
    good = ["The quick brown fox", [5, 6, 7]]
    expected = [o.outputs[0].token_ids for o in llm.generate(good, greedy())]
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt_token_ids"):
        llm.generate([good[0], [10**9], good[1]], greedy())
    stats = llm.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert [o.outputs[0].token_ids for o in llm.generate(good, greedy())] == expected
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_total_blocks"]


def test_engine_keeps_serving_in_flight_requests_after_a_bad_one(tiny_random):
    engine = LLMEngine(EngineConfig(model=tiny_random, max_model_len=256))
    ref = LLM(tiny_random, max_model_len=256).generate([[9, 8, 7]], greedy(max_tokens=12))[0]
    rid = engine.add_request([9, 8, 7], greedy(max_tokens=12))
    engine.step()
    for bad in ([], [10**6]):
        with pytest.raises(ValueError):
            engine.add_request(bad, greedy())
    bad_params = greedy()
    bad_params.temperature = -1
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request([1], bad_params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    assert final.request_id == rid and final.outputs[0].token_ids == ref.outputs[0].token_ids
    assert engine.stats()["num_free_blocks"] == engine.stats()["num_total_blocks"]


# (field, value) set on a request's params after they were made: each one reached the workers once, and
# failed the step of every request in the batch (seed, an int repetition_penalty past int64) or drew garbage
REFUSED_BESIDE = [("seed", 2**63), ("seed", -2**63 - 1), ("seed", 2**64), ("temperature", 1e39),
                  ("top_p", 1e-50), ("top_p", 1e-320), ("repetition_penalty", 1e-30), ("repetition_penalty", 1e39)]
# ... and values that run, harmless: a tiny temperature samples greedily, an int penalty becomes a float
HARMLESS_BESIDE = [("temperature", 1e-300), ("temperature", 1e-320), ("repetition_penalty", 10**30),
                   ("repetition_penalty", 2**63)]


def test_a_bad_value_never_fails_a_good_request_beside_it(llm):
    engine = llm.llm_engine
    good = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    expected = llm.generate([[9, 8, 7]], good)[0].outputs[0].token_ids
    failures = engine.stats()["num_worker_failures"]
    rid = engine.add_request([9, 8, 7], good)
    engine.step()
    for name, value in REFUSED_BESIDE:
        params = SamplingParams(temperature=1.0, max_tokens=4)
        setattr(params, name, value)
        with pytest.raises(ValueError, match=rf"^{name}="):
            engine.add_request([1, 2, 3], params)
    beside = []
    for name, value in HARMLESS_BESIDE:
        params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
        setattr(params, name, value)
        beside.append(engine.add_request([1, 2, 3], params))
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((out.request_id, out) for out in engine.step() if out.finished)
    assert finals[rid].error is None and finals[rid].outputs[0].token_ids == expected
    assert all(finals[b].error is None and len(finals[b].outputs[0].token_ids) == 4 for b in beside)
    greedy_tokens = llm.generate([[1, 2, 3]], greedy(4))[0].outputs[0].token_ids
    assert [finals[b].outputs[0].token_ids for b in beside[:2]] == [greedy_tokens] * 2
    assert engine.stats()["num_worker_failures"] == failures
    assert engine.stats()["num_free_blocks"] == engine.stats()["num_total_blocks"]


def test_a_bad_value_in_a_batch_starts_none_of_it(llm):
    good = [SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)] * 2
    expected = [o.outputs[0].token_ids for o in llm.generate([[5, 6, 7], [8, 9]], good)]
    for bad, field in [(SamplingParams(temperature=1.0, max_tokens=6), "seed"),
                       (SamplingParams(n=2, use_beam_search=True, max_tokens=4), "length_penalty")]:
        setattr(bad, field, 2**63 if field == "seed" else 1e308)  # a beam's length ** 1e308 overflowed float64
        with pytest.raises(ValueError, match=rf"^prompts\[1\]: {field}="):
            llm.generate([[5, 6, 7], [8, 9], [10, 11]], [good[0], bad, good[1]])
    assert [o.outputs[0].token_ids for o in llm.generate([[5, 6, 7], [8, 9]], good)] == expected


def test_bad_engine_settings_name_the_field(tiny_random):
    for kwargs, field in [({"block_size": 12}, "block_size"), ({"dtype": "int8"}, "dtype"),
                          ({"max_num_seqs": 0}, "max_num_seqs"), ({"kv_cache_memory": "lots"}, "kv_cache_memory"),
                          ({"kv_cache_memory": 10}, "kv_cache_memory"), ({"max_model_len": 10**6}, "max_model_len"),
                          ({"attention_backend": "cuda"}, "attention_backend")]:
        with pytest.raises(ValueError, match=field):
            LLM(tiny_random, **kwargs)
    with pytest.raises(FileNotFoundError, match="model="):
        LLM("/nonexistent/model")


def test_abort_frees_blocks_and_reports_abort(tiny_random):
    engine = LLMEngine(EngineConfig(model=tiny_random))
    rid = engine.add_request([1, 2, 3] * 20, greedy(max_tokens=100))
    engine.step()
    engine.step()
    out = engine.abort_request(rid)
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    assert engine.stats()["num_free_blocks"] == engine.stats()["num_total_blocks"]
