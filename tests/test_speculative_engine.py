"""Speculative decoding in the engine (n-gram proposals): greedy and seeded output token for token what it is
without speculation, logprobs to the bit (the CPU kernels compute a position the same in a row of one token or of
several), over random workloads with preemption, prefix hits, penalties, biases, min_tokens and stops; unseeded
sampled output with the target's distribution; rejected proposals leaving nothing behind in the pool or the prefix
cache."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineConfig

from .conftest import launched_batches

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
BS = 4
# tiny_random's fp32 K/V: 2 layers x (K, V) x 2 heads x 16 dims x 4 bytes a token
BLOCK_BYTES = BS * 2 * 2 * 2 * 16 * 4
# 40 blocks (160 tokens) and steps of 32 tokens for up to 8 sequences of up to 70 tokens: they preempt one another
SMALL = dict(block_size=BS, kv_cache_memory=40 * BLOCK_BYTES, max_num_batched_tokens=32, max_num_seqs=8)
ALPHABET = [1000, 1001, 1002, 1003, 2000]  # few distinct tokens: n-grams recur, so proposals come often
PREFIX = [1000, 1001, 1002, 1003] * 3  # shared by some prompts: prefix-cache hits


class FreeTokens:
    """A step cost under which every proposal is worth verifying (`speculative/policy.py`): the tests see every
    proposal verified, whatever this machine's step times."""

    def fit(self) -> tuple[float, float]:
        return 0.01, 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        pass


def speculating(llm: LLM) -> LLM:
    llm.llm_engine.scheduler.step_cost = FreeTokens()
    return llm


def summary(out) -> list:
    """Everything a request's output says, its logprobs to the bit."""
    def entries(logprobs):
        return None if logprobs is None else [
            (e.token_id, e.logprob, e.rank, [(t.token_id, t.logprob) for t in e.top_logprobs]) for e in logprobs]
    return [(c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason, entries(c.logprobs)) for c in out.outputs]


@pytest.fixture(scope="module")
def engines(tiny_random):
    plain = LLM(tiny_random, **SMALL)
    speculative = speculating(LLM(tiny_random, speculative_config=NGRAM, **SMALL))
    yield plain, speculative
    plain.shutdown()
    speculative.shutdown()


params_strategy = st.builds(
    lambda sampling, max_tokens, penalty, min_tokens, stop, bias, logprobs, ignore_eos: SamplingParams(
        **sampling, max_tokens=max_tokens, repetition_penalty=penalty, min_tokens=min(min_tokens, max_tokens),
        stop_token_ids=stop, logit_bias=bias, logprobs=logprobs, ignore_eos=ignore_eos),
    # greedy, or seeded draws (top-k, top-p, min-p among them)
    sampling=st.sampled_from([{"temperature": 0}, {"temperature": 0},
                              {"temperature": 0.9, "seed": 3}, {"temperature": 1.2, "top_p": 0.9, "seed": 11},
                              {"temperature": 0.7, "top_k": 5, "min_p": 0.05, "seed": 7}]),
    max_tokens=st.integers(1, 24),
    penalty=st.sampled_from([1.0, 1.0, 1.3]),
    min_tokens=st.integers(0, 6),
    stop=st.sampled_from([[], [], [1002], [2000, 1003]]),
    bias=st.sampled_from([{}, {}, {1001: 3.0}, {2000: -100.0}]),
    logprobs=st.sampled_from([None, 2]),
    ignore_eos=st.booleans(),
)
prompt_strategy = st.tuples(st.booleans(), st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=30)).map(
    lambda shared_body: (PREFIX if shared_body[0] else []) + shared_body[1])


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workload=st.lists(st.tuples(prompt_strategy, params_strategy), min_size=1, max_size=8))
def test_greedy_and_seeded_output_with_ngram_speculation_is_the_output_without(engines, workload):
    plain, speculative = engines
    prompts = [prompt for prompt, _ in workload]
    params = [p for _, p in workload]
    expected = [summary(o) for o in plain.generate(prompts, params)]
    assert [summary(o) for o in speculative.generate(prompts, params)] == expected
    stats = speculative.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def random_variant(tmp_path_factory, tiny_random: str, name: str, **changes) -> str:
    """tiny_random's config with `changes` (a key set to None: left out)."""
    config = json.loads(open(tiny_random.removeprefix("random:")).read())
    config.update(changes)
    config = {k: v for k, v in config.items() if v is not None}
    d = tmp_path_factory.mktemp(name)
    (d / "config.json").write_text(json.dumps(config))
    return f"random:{d / 'config.json'}"


@pytest.fixture(scope="module")
def drafting(tmp_path_factory, tiny_random):
    """tiny_random with an output layer of its own (tied to its embeddings, a random model tends to repeat its
    input, which any draft predicts), alone and with two drafts: itself (every proposal kept) and its first layer
    alone (random weights are drawn by name: the same embeddings, first layer and output layer), which proposes its
    tokens often, not always."""
    target = random_variant(tmp_path_factory, tiny_random, "untied", tie_word_embeddings=False)
    first_layer = random_variant(tmp_path_factory, tiny_random, "first_layer", tie_word_embeddings=False,
                                 num_hidden_layers=1)
    llms = {"plain": LLM(target, **SMALL)}
    llms.update({name: speculating(LLM(target, **SMALL, speculative_config={
        "method": "draft_model", "model": draft, "num_speculative_tokens": 3}))
        for name, draft in (("itself", target), ("another", first_layer))})
    yield llms
    for llm in llms.values():
        llm.shutdown()


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workload=st.lists(st.tuples(prompt_strategy, params_strategy), min_size=1, max_size=8))
def test_greedy_output_with_a_draft_model_is_the_output_without(drafting, workload):
    """Greedy rows verify a draft's proposals as n-gram ones (the same tokens, logprobs to the bit); seeded rows
    are rejection-sampled (their distribution is the model's, their tokens others). Penalized requests and bad
    words get no draft (their proposals' counts and bans are on the host)."""
    prompts = [prompt for prompt, _ in workload]
    params = [p for _, p in workload]
    greedy = [i for i, p in enumerate(params) if p.greedy]
    expected = [summary(o) for o in drafting["plain"].generate(prompts, params)]
    for name in ("itself", "another"):
        outs = drafting[name].generate(prompts, params)
        assert [summary(outs[i]) for i in greedy] == [expected[i] for i in greedy]
        stats = drafting[name].stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_a_draft_equal_to_the_model_is_always_kept_and_another_is_not(drafting):
    prompts = [PREFIX + [ALPHABET[(i * j) % 5] for j in range(20 + i)] for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    counts = {}
    for name in ("itself", "another"):
        llm = drafting[name]
        before = llm.stats()
        with launched_batches(llm.llm_engine) as batches:
            llm.generate(prompts, params)
        after = llm.stats()
        counts[name] = [after[k] - before[k] for k in ("spec_num_proposed_tokens", "spec_num_accepted_tokens")]
        assert after["num_preemptions"] > before["num_preemptions"] and after["prefix_cache_hits"] > 0
        assert all(s.draft for b in batches for s in b.samples if s.proposals)
        # all of a row's proposals kept: the draft computes the last of them with the row after
        assert any(b.draft_catch_up for b in batches) or name != "itself"
    assert counts["itself"][0] == counts["itself"][1] > 0
    assert 0 < counts["another"][1] < counts["another"][0]


def test_a_workload_keeps_and_rejects_proposals_and_preempts(tiny_random):
    """The workload of the test above at its largest, once: proposals are kept and rejected, sequences are
    preempted, prompts hit the prefix cache, and every block comes back; the counts add up."""
    prompts = [PREFIX + [ALPHABET[(i * j) % 5] for j in range(20 + i)] for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = speculating(LLM(tiny_random, speculative_config=NGRAM, **SMALL))
    with launched_batches(llm.llm_engine) as batches:
        outs = llm.generate(prompts, params)
    stats = llm.stats()
    llm.shutdown()
    verified = [s for b in batches for s in b.samples if s.proposals]
    assert stats["spec_num_rows"] == len(verified) > 0
    assert stats["spec_num_proposed_tokens"] == sum(len(s.proposals) for s in verified)
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_proposed_tokens"]
    assert stats["spec_acceptance_rate"] == stats["spec_num_accepted_tokens"] / stats["spec_num_proposed_tokens"]
    assert stats["spec_mean_accepted_length"] == 1 + stats["spec_num_accepted_tokens"] / stats["spec_num_rows"]
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    # a row computes its last token and its proposals: 1 + k query tokens, the token budget counting them all
    for batch in batches:
        assert batch.num_tokens <= SMALL["max_num_batched_tokens"]
        for s in batch.samples:
            if s.proposals:
                start, end = batch.cu_seqlens_q[s.row], batch.cu_seqlens_q[s.row + 1]
                assert batch.input_ids[end - len(s.proposals):end] == s.proposals and end - start == 1 + len(
                    s.proposals)


def test_rejected_tokens_are_never_registered_in_the_prefix_cache(tiny_random):
    """After a workload whose proposals are often rejected, every cached block's tokens are tokens of a sequence
    as it was output (the chained hashes of its prompt and output), never a rejected proposal's."""
    from pagedserve.scheduler.block_manager import prefix_hashes

    prompts = [[1000, 1001, 1002, 1003, 2000] * 4 + [1000 + i] for i in range(4)]
    llm = speculating(LLM(tiny_random, speculative_config=NGRAM, block_size=BS))
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    stats = llm.stats()
    assert stats["spec_num_accepted_tokens"] < stats["spec_num_proposed_tokens"]
    known = {h for o in outs for h in prefix_hashes(o.prompt_token_ids + o.outputs[0].token_ids, BS)}
    cached = set(llm.llm_engine.cached_block_hashes())
    llm.shutdown()
    assert cached and cached <= known


def test_stop_strings_end_the_text_where_they_would_without_speculation(engines):
    """Stop strings found in several tokens a step emits: the tokens after the one that completes the string are
    dropped, whether the sequence would have ended later by a stop token, by its length or not at all."""
    plain, speculative = engines
    prompt = PREFIX + [2000, 1000, 1001]
    text = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0].text
    stops = [text[len(text) // 3:len(text) // 3 + 3], text[len(text) // 2:len(text) // 2 + 5]]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[s], include_stop_str_in_output=inc,
                             logprobs=1) for s in stops for inc in (False, True)]
    expected = [summary(o) for o in plain.generate([prompt] * len(params), params)]
    assert [summary(o) for o in speculative.generate([prompt] * len(params), params)] == expected
    assert any(o[0][3] == "stop" for o in expected)


def test_async_scheduling_and_n_samples_give_the_same_tokens(tiny_random, engines):
    plain, _ = engines
    prompts = [PREFIX + [2000] * i for i in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=20, n=2),
              SamplingParams(temperature=0, max_tokens=20, presence_penalty=0.5, frequency_penalty=0.3),
              SamplingParams(temperature=0, max_tokens=20, min_tokens=15, stop_token_ids=[1000]),
              SamplingParams(temperature=0, max_tokens=20, logprobs=3)]
    expected = [summary(o) for o in plain.generate(prompts, params)]
    llm = speculating(LLM(tiny_random, speculative_config=NGRAM, async_scheduling=True, **SMALL))
    assert [summary(o) for o in llm.generate(prompts, params)] == expected
    assert llm.stats()["spec_num_rows"] > 0
    llm.shutdown()


def marginals(outs, positions: range, vocab: list[int]) -> list[list[int]]:
    """Per output position, how often each of `vocab` came."""
    return [[sum(o.outputs[0].token_ids[p] == t for o in outs) for t in vocab] for p in positions]


def test_sampled_output_has_the_models_distribution(tmp_path, tiny_random):
    """Four allowed tokens, a prompt that repeats them (so that proposals come every step), and 3,000 requests
    without speculation, with n-gram proposals and with a draft model's (the model's first layer; rejection
    sampling), each run with seeds of its own (independent draws; an engine's seed would draw other random
    weights): each output position's token counts are one distribution (a chi-square test of homogeneity, 3
    degrees of freedom, at p = 0.001: 16.27). A verification that kept proposals it should not would favour the
    proposed tokens by far more. tiny_random with a vocabulary of 64 and no tokenizer: the draws' rows cost
    little."""
    config = json.loads(open(tiny_random.removeprefix("random:")).read())
    config.update(vocab_size=64, bos_token_id=0, eos_token_id=1)
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "draft").mkdir()
    (tmp_path / "draft" / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=1)))
    draft = {"method": "draft_model", "model": f"random:{tmp_path / 'draft' / 'config.json'}",
             "num_speculative_tokens": 3}
    allowed = [10, 11, 12, 13]
    prompt = [10, 11, 12, 13, 10, 11, 12, 13, 10]
    counts = []
    for first_seed, spec in ((0, None), (10_000, NGRAM), (20_000, draft)):
        llm = speculating(LLM(f"random:{tmp_path / 'config.json'}", speculative_config=spec, max_num_seqs=256))
        params = [SamplingParams(temperature=1.5, allowed_token_ids=allowed, max_tokens=4, seed=first_seed + i)
                  for i in range(3000)]
        outs = llm.generate([prompt] * len(params), params)
        stats = llm.stats()
        llm.shutdown()
        counts.append(marginals(outs, range(1, 4), allowed))
        if spec is not None:
            assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_proposed_tokens"], spec["method"]
    for speculative_counts in counts[1:]:
        for plain, speculative in zip(counts[0], speculative_counts, strict=True):
            total = [a + b for a, b in zip(plain, speculative, strict=True)]
            chi2 = sum((row[t] - total[t] / 2) ** 2 / (total[t] / 2) for row in (plain, speculative)
                       for t in range(len(allowed)) if total[t])
            assert chi2 < 16.27, (plain, speculative)


def test_min_tokens_holds_back_a_stop_token_among_proposals(engines):
    """A stop token the output would end at, and min_tokens past it: the positions a step verifies are banned as
    far as they are before min_tokens, each by its own place in the output."""
    plain, speculative = engines
    prompt = PREFIX + [1000, 1001]
    free = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    stop = free.outputs[0].token_ids[-3]  # after a run of proposals kept: 1001 nine times, then another
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop], min_tokens=m)
              for m in (0, 5, 9, 10, 11)]
    expected = [summary(o) for o in plain.generate([prompt] * len(params), params)]
    with launched_batches(speculative.llm_engine) as batches:
        outs = speculative.generate([prompt] * len(params), params)
    assert [summary(o) for o in outs] == expected
    assert any(s.proposals and s.proposal_bans for b in batches for s in b.samples)


@pytest.mark.parametrize(("config", "message"), [
    ({"method": "eagle", "num_speculative_tokens": 2}, r"speculative_config.method='eagle' must be one of"),
    ({"method": "ngram"}, r"speculative_config.num_speculative_tokens=None must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens=0 must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     r"prompt_lookup_min=4 is above prompt_lookup_max=2"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": "3"}, r"prompt_lookup_max='3' must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, r"speculative_config.lookahead is not a"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, r"speculative_config.model='x' is for"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, r"speculative_config.model=None: method='draft_model'"),
    ({"method": "draft_model", "model": "x", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
     r"speculative_config.prompt_lookup_max is for method='ngram'"),
    ("ngram", r"speculative_config='ngram' must be a mapping"),
])
def test_bad_speculative_settings_are_refused_by_name(config, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=config)


def test_one_lookup_bound_stands_for_both():
    config = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4})
    assert (config.speculative().prompt_lookup_min, config.speculative().prompt_lookup_max) == (4, 4)
    config = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert (config.speculative().prompt_lookup_min, config.speculative().prompt_lookup_max) == (5, 5)


def test_a_rope_that_follows_the_sequence_length_is_refused(tmp_path, tiny_random):
    config = json.loads(open(tiny_random.removeprefix("random:")).read())
    config["rope_scaling"] = {"rope_type": "dynamic", "factor": 2.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"speculative_config with rope_scaling.rope_type='dynamic'"):
        LLM(f"random:{tmp_path / 'config.json'}", speculative_config=NGRAM)


def test_structured_outputs_verify_only_what_the_grammar_accepts(embedded_dir):
    """A grammar's sequences get the prefix of their proposals the grammar accepts, and a mask at each position:
    the embedded SmolLM2 copying JSON and lists from its prompt gives the same greedy text as without
    speculation, every output fits its constraint, and some constrained proposals are kept, some cut."""
    from pagedserve.sampling_params import StructuredOutputs

    record = '{"name": "Ada Lovelace", "born": 1815, "fields": ["mathematics", "computing"]}'
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "born": {"type": "integer"},
                                               "fields": {"type": "array", "items": {"type": "string"}}},
              "required": ["name", "born", "fields"]}
    prompts = [f"Copy this record exactly: {record}\nCopy: ", f"Copy this record exactly: {record}\nCopy: ",
               "Phone numbers: 555-1234, 555-9876, 555-1234. Again: ", "Answer yes or no, yes or no: "]
    constraints = [StructuredOutputs(json=schema), StructuredOutputs(json_object=True),
                   StructuredOutputs(regex=r"([0-9]{3}-[0-9]{4}, ){2}[0-9]{3}-[0-9]{4}"),
                   StructuredOutputs(choice=["yes or no", "no"])]
    params = [SamplingParams(temperature=0, max_tokens=60, structured_outputs=c) for c in constraints]
    plain = LLM(str(embedded_dir))
    expected = [summary(o) for o in plain.generate(prompts, params)]
    plain.shutdown()
    llm = speculating(LLM(str(embedded_dir), speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                                 "prompt_lookup_max": 3, "prompt_lookup_min": 1}))
    engine = llm.llm_engine
    offered, kept = [], []
    check = engine.scheduler.grammar_proposals
    engine.scheduler.grammar_proposals = lambda seq, p: offered.append(p) or kept.append(check(seq, p)) or kept[-1]
    with launched_batches(engine) as batches:
        outs = llm.generate(prompts, params)
    stats = llm.stats()
    llm.shutdown()
    assert [summary(o) for o in outs] == expected
    json.loads(outs[0].outputs[0].text)
    assert any(len(k) < len(o) for o, k in zip(offered, kept, strict=True)), "no proposal was cut by a grammar"
    assert any(s.proposals and s.proposal_bitmasks for b in batches for s in b.samples)
    assert stats["spec_num_accepted_tokens"] > 0


class CostlyTokens(FreeTokens):
    """A step cost under which a token costs ten steps: no proposal pays."""

    def fit(self) -> tuple[float, float]:
        return 0.001, 0.01


def test_proposals_that_cost_more_than_they_are_likely_to_save_are_not_verified(engines, tiny_random):
    plain, _ = engines
    prompts = [PREFIX + [2000] * i for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = [summary(o) for o in plain.generate(prompts, params)]
    llm = LLM(tiny_random, speculative_config=NGRAM, **SMALL)
    assert llm.llm_engine.scheduler.step_cost.fit() is None
    assert [summary(o) for o in llm.generate(prompts, params)] == expected
    assert llm.llm_engine.scheduler.step_cost.fit() is not None  # the engine timed its steps
    llm.llm_engine.scheduler.step_cost = CostlyTokens()
    assert [summary(o) for o in llm.generate(prompts, params)] == expected
    rows = llm.stats()["spec_num_rows"]
    assert [summary(o) for o in llm.generate(prompts, params)] == expected and llm.stats()["spec_num_rows"] == rows
    llm.shutdown()


def test_a_draft_the_model_cannot_run_beside_it_is_refused_by_name(tmp_path_factory, tiny_random):
    other_vocab = random_variant(tmp_path_factory, tiny_random, "other_vocab", vocab_size=512)
    short = random_variant(tmp_path_factory, tiny_random, "short", max_position_embeddings=64)
    windowed = random_variant(tmp_path_factory, tiny_random, "windowed", model_type="qwen2",
                              architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=8,
                              max_window_layers=1, attention_bias=None, mlp_bias=None)
    cases = [(dict(model=other_vocab), r"has a vocabulary of 512 tokens, the model 49152: a draft must share"),
             (dict(model=short), r"has 64 positions, fewer than max_model_len=512"),
             (dict(model=windowed), r"the draft has sliding-window layers")]
    for case, message in cases:
        with pytest.raises(ValueError, match=message):
            LLM(tiny_random, speculative_config={"method": "draft_model", "num_speculative_tokens": 2, **case})

