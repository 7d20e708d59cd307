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
])
def test_bad_sampling_params_name_the_field(make, field):
    with pytest.raises(ValueError, match=rf"^{field}="):
        make()


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
