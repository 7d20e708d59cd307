"""Sampler maths on synthetic logits, and sampling features end to end through LLM.generate."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.scheduler.batch import SampleSpec
from pagedserve.workers.penalties import PenaltyCounts
from pagedserve.workers.sampler import (
    Sampler,
    _apply_bias_and_bans,
    _top_k_top_p,
    _top_k_top_p_among_candidates,
    _top_k_top_p_sorted,
    draw_uniform,
    inverse_transform,
    token_scores,
)

from .conftest import launched_batches


def spec(params: SamplingParams, row: int = 0, n: int = 1, output: list[int] | None = None,
         prompt: list[int] | None = None) -> SampleSpec:
    return SampleSpec(seq_id=row, row=row, num_samples=n, sample_index=0, output_len=len(output or []),
                      params=params, prompt_token_ids=prompt or [], output_token_ids=output or [])


def draw(logits: list[float], params: SamplingParams, draws: int = 4000) -> torch.Tensor:
    sampler = Sampler(torch.device("cpu"), seed=0)
    rows = torch.tensor([logits] * draws)
    out = sampler(rows, [spec(params, row=i) for i in range(draws)])
    return torch.bincount(torch.tensor([o.token_ids[0] for o in out]), minlength=len(logits)).float() / draws


LOGITS = [2.0, 1.0, 0.5, 0.0, -1.0]


def test_temperature_sampling_follows_softmax():
    for temp in (1.0, 0.5):
        freq = draw(LOGITS, SamplingParams(temperature=temp))
        probs = torch.softmax(torch.tensor(LOGITS) / temp, dim=0)
        assert (freq - probs).abs().max() < 0.03


def test_top_k_top_p_min_p_restrict_the_support():
    assert draw(LOGITS, SamplingParams(top_k=2))[2:].sum() == 0
    probs = torch.softmax(torch.tensor(LOGITS), dim=0)  # [0.61, 0.22, 0.14, 0.08, 0.03]
    freq = draw(LOGITS, SamplingParams(top_p=0.7))  # nucleus: the first two tokens
    assert freq[2:].sum() == 0 and abs(freq[0] - probs[0] / probs[:2].sum()) < 0.03
    freq = draw(LOGITS, SamplingParams(min_p=0.3))  # keep p >= 0.3 * 0.61
    assert freq[2:].sum() == 0
    assert draw(LOGITS, SamplingParams(top_k=1, temperature=5.0))[0] == 1.0


@pytest.mark.parametrize("mask_rows_at_once", [1, 64])  # a CPU's, CUDA's
def test_bias_bans_and_grammar_masks_of_many_rows_at_once(mask_rows_at_once):
    """Each row's logit_bias, allowed_token_ids, banned tokens and grammar mask, applied to all rows together
    (masks in chunks), equal their definition row by row: a bias adds, a token not allowed, banned or masked
    out is -inf whatever its bias."""
    gen = torch.Generator().manual_seed(3)
    vocab, num_rows = 70, 200  # a vocabulary not a multiple of 32; 80 masked rows: more than one chunk
    logits = torch.randn(num_rows, vocab, generator=gen)
    rows, expected = [], logits.clone()
    for r in range(num_rows):
        kind = r % 5
        bias = {int(t): float(b) for t, b in zip(torch.randint(vocab, (3,), generator=gen).unique(),
                                                 torch.randn(3, generator=gen), strict=False)} if kind in (1, 4) else {}
        banned = torch.randint(vocab, (4,), generator=gen).tolist() if kind in (2, 4) else None
        allowed = torch.rand(vocab, generator=gen) < 0.3 if kind in (3, 4) else None
        bitmask = None
        if allowed is not None:  # bit t % 32 of int32 word t // 32, as xgrammar packs it
            bits = torch.nn.functional.pad(allowed, (0, -vocab % 32)).view(-1, 32).to(torch.int64)
            words = (bits << torch.arange(32)).sum(dim=1)
            bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).numpy().tobytes()
        # allowed_token_ids (repeats and all) on rows without a grammar, which SamplingParams refuses with it
        only = torch.randint(vocab, (5,), generator=gen).tolist() if r % 3 == 1 and allowed is None else None
        rows.append((replace(spec(SamplingParams(logit_bias=bias, allowed_token_ids=only), row=r),
                             banned_token_ids=banned, token_bitmask=bitmask), 0))
        for t, b in bias.items():
            expected[r, t] += b
        if only is not None:
            expected[r, [t for t in range(vocab) if t not in only]] = float("-inf")
        if banned:
            expected[r, banned] = float("-inf")
        if allowed is not None:
            expected[r, ~allowed] = float("-inf")
    assert torch.equal(_apply_bias_and_bans(logits, rows, mask_rows_at_once), expected)


def test_top_k_top_p_among_candidates_keeps_what_sorting_keeps():
    """The CPU's top-k/top-p (a nucleus sought among each row's largest logits, a row sorted whole only when
    they hold too little mass) keeps exactly the tokens and values that sorting every row keeps."""
    gen = torch.Generator().manual_seed(5)
    vocab = 5000
    peaked = 6 * torch.randn(12, vocab, generator=gen)
    flat = 0.1 * torch.randn(4, vocab, generator=gen)  # nuclei of thousands of tokens: sorted whole
    logits = torch.cat([peaked, flat])
    top_k = [-1, 50, -1, 1, 2000, -1, 10, -1, 3000, -1, 7, -1, -1, 40, -1, -1]
    top_p = [0.9, 1.0, 1.0, 0.5, 0.95, 0.3, 0.8, 0.99, 1.0, 0.0001, 1.0, 0.6, 0.9, 0.9, 1.0, 0.999]
    candidates = _top_k_top_p_among_candidates(logits, top_k, top_p)
    sorted_ = _top_k_top_p_sorted(logits, top_k, top_p)
    assert torch.equal(candidates.isinf(), sorted_.isinf())
    assert torch.equal(candidates[~candidates.isinf()], sorted_[~sorted_.isinf()])
    kept = (~candidates.isinf()).sum(dim=1).tolist()
    assert kept[2] == kept[14] == vocab and kept[1] == 50 and kept[8] == 3000 and kept[3] == kept[9] == 1
    assert kept[12] > 1024 and kept[15] > 1024, kept  # flat rows whose nucleus passes the candidates


def test_rows_restricted_alone_keep_what_sorting_keeps():
    """A batch whose rows ask for neither top-k nor top-p beside ones that do (only those are restricted)
    keeps what sorting every row keeps."""
    logits = 6 * torch.randn(6, 3000, generator=torch.Generator().manual_seed(6))
    top_k, top_p = [-1, 50, -1, -1, 7, -1], [1.0, 1.0, 0.9, 1.0, 0.5, 1.0]
    restricted = _top_k_top_p(logits.clone(), top_k, top_p)
    assert torch.equal(restricted, _top_k_top_p_sorted(logits, top_k, top_p))
    assert torch.equal(restricted[[0, 3, 5]], logits[[0, 3, 5]])


def test_inverse_transform_never_picks_a_token_without_mass():
    probs = torch.tensor([[0.0, 0.3, 0.7, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.2], [0.5, 0.0, 0.0, 0.0, 0.0]])
    top = 1 - 2**-24  # the largest fp32 uniform below 1
    # [0, 0.3) picks token 1; 1.0 stands for a uniform that rounding carried to the top of the mass
    for u, want in [(0.0, [1, 4, 0]), (top, [2, 4, 0]), (0.29, [1, 4, 0]), (0.3, [2, 4, 0]), (1.0, [2, 4, 0])]:
        uniform = torch.full((3, 1), u)
        assert inverse_transform(probs, uniform).tolist() == want, u
    assert all(0 <= draw_uniform(seed, 0, n) < 1 for seed in range(50) for n in range(20))


def test_greedy_rows_and_sampled_rows_mix():
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.tensor([LOGITS, LOGITS[::-1]])
    out = sampler(logits, [spec(SamplingParams(temperature=0), 0), spec(SamplingParams(top_k=1), 1)])
    assert [o.token_ids for o in out] == [[0], [4]]


def test_a_row_draws_the_same_among_others_greedy_or_not():
    # a mixed batch samples only its sampled rows (the greedy ones stop at argmax): each draws as alone
    logits = 3 * torch.randn(6, 50, generator=torch.Generator().manual_seed(5))
    greedy = SamplingParams(temperature=0)
    mixed = [greedy, SamplingParams(seed=7, top_p=0.8), greedy, SamplingParams(seed=8, top_k=5, temperature=0.7),
             SamplingParams(seed=9, min_p=0.1), greedy]
    sampler = Sampler(torch.device("cpu"), seed=0)
    together = [o.token_ids[0] for o in sampler(logits.clone(), [spec(p, r) for r, p in enumerate(mixed)])]
    alone = [sampler(logits[r:r + 1].clone(), [spec(p)])[0].token_ids[0] for r, p in enumerate(mixed)]
    assert together == alone
    assert [together[r] for r in (0, 2, 5)] == logits[[0, 2, 5]].argmax(dim=-1).tolist()


def test_penalties_change_logits_as_defined():
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    rep = SamplingParams(repetition_penalty=2.0)
    out = sampler.penalties.apply(logits.clone(), [(spec(rep, prompt=[0], output=[1]), 0)], [0])
    assert out.tolist() == [[1.0, -4.0, 1.0, 0.5]]
    pf = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = sampler.penalties.apply(logits.clone(), [(spec(pf, prompt=[3], output=[2, 2, 0]), 0)], [0])
    assert out.tolist() == [[2.0 - 0.75, -2.0, 1.0 - 1.0, 0.5]]


@pytest.mark.parametrize("rows_at_once", [1, 2])
def test_penalty_counts_follow_the_draws_after_one_history(rows_at_once):
    """Only a sequence's first draw in its slot carries its history; the sampler counts every later draw
    itself. Each step's penalized logits equal those from the whole history sent every step, for rows that
    share a step, change slots, fork, and come back after their slot served another sequence."""
    vocab = 12
    gen = torch.Generator().manual_seed(0)
    params = [SamplingParams(temperature=0, repetition_penalty=1.7, frequency_penalty=0.4, presence_penalty=0.3),
              SamplingParams(temperature=0, frequency_penalty=2.0), SamplingParams(temperature=0)]
    kept, fresh = Sampler(torch.device("cpu"), seed=0), Sampler(torch.device("cpu"), seed=0)
    kept.penalties = PenaltyCounts(rows_at_once)  # 2: the batched form a GPU uses, over 3-4 rows
    outputs = {0: [], 1: [3], 2: []}
    prompts = {0: [1, 2, 2], 1: [4], 2: [5]}
    slots = {0: 0, 1: 3, 2: 1}
    sent = set()
    for step in range(12):
        if step == 6:  # sequence 1 leaves its slot to sequence 9, then comes back in slot 2
            slots[9], outputs[9], prompts[9] = 3, [7, 7], [8]
            slots[1] = 2
            sent.discard(1)
            params.append(SamplingParams(temperature=0, presence_penalty=1.0))
        seqs = sorted(slots)
        logits = torch.randn(len(seqs), vocab, generator=gen)
        logits[:, 2] += 1.5  # a favourite that the penalties must push down
        with_history = [SampleSpec(seq_id=q, row=r, num_samples=1, sample_index=0, output_len=len(outputs[q]),
                                   params=params[min(q, len(params) - 1)], prompt_token_ids=prompts[q],
                                   output_token_ids=list(outputs[q])) for r, q in enumerate(seqs)]
        expected = [t.token_ids[0] for t in fresh.draw(logits.clone(), with_history,
                                                       slots=list(range(len(seqs)))).outputs()]
        fresh.penalties._owner.clear()  # every step from its histories alone
        specs = [SampleSpec(seq_id=q, row=r, num_samples=1, sample_index=0, output_len=len(outputs[q]),
                            params=params[min(q, len(params) - 1)],
                            prompt_token_ids=None if q in sent else prompts[q],
                            output_token_ids=None if q in sent else list(outputs[q])) for r, q in enumerate(seqs)]
        got = [t.token_ids[0] for t in kept.draw(logits, specs, slots=[slots[q] for q in seqs]).outputs()]
        assert got == expected, step
        sent.update(seqs)
        for q, token in zip(seqs, got, strict=True):
            outputs[q].append(token)
    assert len(set(outputs[0])) > 3  # the penalties did steer away from the favourite
    # A slot whose counts belong to another sequence, or to none, is refused by name.
    spec9 = SampleSpec(seq_id=1, row=0, num_samples=1, sample_index=0, output_len=1, params=params[1])
    with pytest.raises(RuntimeError, match="sequence 1's penalties need its token history: slot 3"):
        kept.draw(torch.zeros(1, vocab), [spec9], slots=[3])
    # A fork's draws are not counted: its slot must be sent again.
    fork = SampleSpec(seq_id=0, row=0, num_samples=2, sample_index=0, output_len=0, params=params[0],
                      prompt_token_ids=[1], output_token_ids=[])
    kept.draw(torch.zeros(1, vocab), [fork], slots=[0])
    with pytest.raises(RuntimeError, match="sequence 0's penalties"):
        kept.draw(torch.zeros(1, vocab), [replace(fork, num_samples=1, prompt_token_ids=None,
                                                  output_token_ids=None)], slots=[0])


def test_logprobs_of_sampled_and_top_tokens():
    sampler = Sampler(torch.device("cpu"), seed=0)
    out = sampler(torch.tensor([LOGITS]), [spec(SamplingParams(temperature=0, logprobs=2))])[0]
    lp = torch.log_softmax(torch.tensor(LOGITS), dim=0)
    assert out.token_ids == [0] and math.isclose(out.logprobs[0], lp[0].item(), rel_tol=1e-6)
    assert [t for t, _ in out.top_logprobs[0]] == [0, 1] and out.ranks == [1]


def test_ranks_are_vllms_counts_of_tokens_at_least_as_likely():
    """A drawn token's rank is in the raw distribution (a bias that forces it does not lift it), ties counted
    as vLLM counts them: every token whose logprob is >= its own; prompt tokens are ranked the same way."""
    tied = [2.0, 1.0, 0.5, 1.0, 1.0, -1.0]
    sampler = Sampler(torch.device("cpu"), seed=0)
    specs = [spec(SamplingParams(temperature=0, logprobs=0, logit_bias={t: 100.0}), row=t) for t in range(len(tied))]
    out = sampler(torch.tensor([tied] * len(tied)), specs)
    assert [o.token_ids[0] for o in out] == list(range(len(tied)))
    assert [o.ranks[0] for o in out] == [sum(x >= v for x in tied) for v in tied] == [1, 4, 5, 4, 4, 6]
    gen = torch.Generator().manual_seed(0)
    logprobs = torch.log_softmax(torch.randn(50, 1000, generator=gen), dim=-1)
    targets = torch.randint(1000, (50,), generator=gen)
    scores, _, _ = token_scores(logprobs, targets, 0)  # [50, 2]: logprob, rank
    assert scores[:, 0].tolist() == [row[t].item() for row, t in zip(logprobs, targets, strict=True)]
    # the same ranks from each row sorted: one past the last place that holds a value at least the target's
    ordered = logprobs.sort(dim=-1, descending=True).values
    assert scores[:, 1].tolist() == [float(next(i for i in range(1000, 0, -1) if row[i - 1] >= row_lp[t]))
                                     for row, row_lp, t in zip(ordered, logprobs, targets, strict=True)]


def test_penalties_count_a_pending_last_output_token():
    """A step scheduled ahead sends no output, and its last token is still pending on the host: the sampler
    has counted that draw itself, so the penalties come out as if the host had sent the whole output."""
    logits = torch.zeros(2, 16)
    logits[:, 7], logits[:, 8] = 3.0, 2.0
    params = SamplingParams(temperature=0, max_tokens=8, repetition_penalty=2.0, frequency_penalty=1.0)

    def row_spec(row: int, output: list[int] | None) -> SampleSpec:
        return SampleSpec(seq_id=row, row=row, num_samples=1, sample_index=0, output_len=len(output or [1]),
                          params=params, prompt_token_ids=None if output is None else [1], output_token_ids=output)

    sent = Sampler(torch.device("cpu"), seed=0).draw(logits.clone(), [row_spec(0, [7]), row_spec(1, [])]).outputs()
    assert [s.token_ids for s in sent] == [[8], [7]]  # 7 penalized where it was output
    sampler = Sampler(torch.device("cpu"), seed=0)
    first = sampler.draw(logits.clone(), [row_spec(0, [])]).outputs()
    assert first[0].token_ids == [7]
    ahead = sampler.draw(logits.clone(), [row_spec(0, None), row_spec(1, [])]).outputs()
    assert [s.token_ids for s in ahead] == [[8], [7]]


@pytest.fixture(scope="module")
def tiny(tiny_random):
    return LLM(tiny_random, seed=0)


def texts(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_same_seed_same_output_whatever_the_batch(tiny):
    prompt = [11, 12, 13, 14]
    params = SamplingParams(temperature=1.0, seed=42, max_tokens=24, ignore_eos=True)
    alone = tiny.generate([prompt], params)
    again = tiny.generate([[1, 2], prompt, [3] * 30], [SamplingParams(temperature=0.7, max_tokens=5), params,
                                                      SamplingParams(seed=1, max_tokens=9)])
    assert texts(alone)[0] == texts(again)[1]
    other = tiny.generate([prompt], SamplingParams(temperature=1.0, seed=43, max_tokens=24, ignore_eos=True))
    assert texts(other)[0] != texts(alone)[0]


def test_n_seeded_samples_differ_and_repeat(tiny):
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    first = texts(tiny.generate([[5, 6, 7]], params))[0]
    assert len(first) == 4 and len({tuple(t) for t in first}) == 4
    assert texts(tiny.generate([[5, 6, 7]], params))[0] == first
    assert tiny.stats()["num_free_blocks"] == tiny.stats()["num_total_blocks"]


def test_unseeded_sampling_uses_the_engine_seed(tiny_random):
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    a = texts(LLM(tiny_random, seed=3).generate([[4, 5]], params))
    b = texts(LLM(tiny_random, seed=3).generate([[4, 5]], params))
    assert a == b


def test_penalties_steer_generation(tiny):
    base = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = texts(tiny.generate([[8, 9]], base))[0][0]
    rep = texts(tiny.generate([[8, 9]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                       frequency_penalty=2.0, presence_penalty=2.0)))[0][0]
    assert len(set(rep)) > len(set(plain))


@pytest.fixture(scope="module")
def smol(embedded_dir):
    return LLM(str(embedded_dir))


CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_answer_and_eos(smol):
    out = smol.chat(CAPITAL, SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop" and out.token_ids[-1] in smol.llm_engine.eos_token_ids


def test_stop_strings_are_cut_from_text(smol):
    out = smol.chat(CAPITAL, SamplingParams(temperature=0, max_tokens=40, stop=["Paris", "xyz"]))[0].outputs[0]
    assert out.text == "The capital of France is " and out.finish_reason == "stop"
    full = smol.chat(CAPITAL, SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    assert full.token_ids[: len(out.token_ids)] == out.token_ids and len(out.token_ids) < len(full.token_ids)


def test_stop_token_ids_max_tokens_and_ignore_eos(smol):
    full = smol.chat(CAPITAL, SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    stop_id = full.token_ids[3]
    out = smol.chat(CAPITAL, SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == full.token_ids[:4] and out.finish_reason == "stop"
    out = smol.chat(CAPITAL, SamplingParams(temperature=0, max_tokens=3))[0].outputs[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"
    out = smol.chat(CAPITAL, SamplingParams(temperature=0, max_tokens=len(full.token_ids) + 5,
                                            ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == len(full.token_ids) + 5 and out.finish_reason == "length"


def test_logprobs_match_the_model(smol, embedded_dir):
    from transformers import AutoModelForCausalLM

    prompt = smol.tokenizer.encode("The capital of France is")
    out = smol.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=3))[0].outputs[0]
    model = AutoModelForCausalLM.from_pretrained(embedded_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1], dim=-1)
    top = ref.topk(3)
    entry = out.logprobs[0]
    assert entry.token_id == top.indices[0].item()
    assert abs(entry.logprob - top.values[0].item()) < 1e-4
    assert [t.token_id for t in entry.top_logprobs] == top.indices.tolist()
    assert entry.token == smol.tokenizer.decode([entry.token_id])
    assert [t.token for t in entry.top_logprobs] == [smol.tokenizer.decode([t]) for t in top.indices.tolist()]
    # vLLM's view of it: the greedy token is the top one, so the dict holds the 3 alone, ranked 1..3
    assert {t: (lp.logprob, lp.rank, lp.decoded_token) for t, lp in entry.items()} == {
        t.token_id: (t.logprob, r, t.token) for r, t in enumerate(entry.top_logprobs, 1)}


@pytest.mark.parametrize("max_num_batched_tokens", [None, 7])
def test_prompt_logprobs_match_the_model(embedded_dir, max_num_batched_tokens):
    """Every prompt token scored as the model scores it: in one step, in chunks of 7 tokens, and again
    when the prompt's blocks are in the prefix cache (cached positions must be computed anyway)."""
    from transformers import AutoModelForCausalLM

    llm = LLM(str(embedded_dir), block_size=4, max_num_batched_tokens=max_num_batched_tokens)
    prompt = llm.tokenizer.encode("The capital of France is Paris, and the capital of Italy is Rome.")
    model = AutoModelForCausalLM.from_pretrained(embedded_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0], dim=-1)  # [P, V]
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    for _ in range(2):
        out = llm.generate([prompt], params)[0]
        assert len(out.prompt_logprobs) == len(prompt)
        assert out.prompt_logprobs[0] is None  # as vLLM's: nothing predicts the first token
        for t in range(1, len(prompt)):
            entry = out.prompt_logprobs[t]
            assert entry.token_id == prompt[t] and next(iter(entry)) == prompt[t]
            assert abs(entry.logprob - ref[t - 1, prompt[t]].item()) < 1e-3, t
            assert [x.token_id for x in entry.top_logprobs] == ref[t - 1].topk(2).indices.tolist()
            assert entry.token == llm.tokenizer.decode([prompt[t]])
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_total_blocks"]
    llm.shutdown()


def test_prompt_logprobs_of_several_requests_in_one_step(smol, embedded_dir):
    """Prompts scored in one step, each with its own number of alternatives (0 among them), one longer than
    a slice of prompt logits (256 positions): each request gets its own scores, whole and in order."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(embedded_dir, dtype=torch.float32)
    prompts = [smol.tokenizer.encode(" ".join(f"item{i}," for i in range(120))),
               smol.tokenizer.encode("The capital of France is"), smol.tokenizer.encode("Two plus two is")]
    assert len(prompts[0]) > 300
    ks = [0, 3, 1]
    with launched_batches(smol.llm_engine) as batches:
        outs = smol.generate(prompts, [SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k) for k in ks])
    assert len(batches[0].prompt_logprobs) == 3
    for prompt, out, k in zip(prompts, outs, ks, strict=True):
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0], dim=-1)  # [P, V]
        assert out.prompt_logprobs[0] is None and [e.token_id for e in out.prompt_logprobs[1:]] == prompt[1:]
        for t in range(1, len(prompt)):
            entry = out.prompt_logprobs[t]
            assert abs(entry.logprob - ref[t - 1, prompt[t]].item()) < 1e-3, (k, t)
            assert [x.token_id for x in entry.top_logprobs] == ref[t - 1].topk(k).indices.tolist(), (k, t)


def test_min_tokens_holds_back_eos_and_stop_strings(smol):
    full = smol.chat(CAPITAL, SamplingParams(temperature=0, max_tokens=60))[0].outputs[0]
    assert full.finish_reason == "stop" and full.stop_reason is None  # EOS
    longer = smol.chat(CAPITAL, SamplingParams(temperature=0, max_tokens=60,
                                               min_tokens=len(full.token_ids) + 3))[0].outputs[0]
    assert len(longer.token_ids) >= len(full.token_ids) + 3
    assert longer.token_ids[:len(full.token_ids) - 1] == full.token_ids[:-1]  # the same until EOS was banned
    word = full.text.split()[0]
    out = smol.chat(CAPITAL, SamplingParams(temperature=0, max_tokens=60, stop=[word], min_tokens=0))[0].outputs[0]
    assert out.text == full.text[:full.text.index(word)] and out.stop_reason == word
    out = smol.chat(CAPITAL, SamplingParams(temperature=0, max_tokens=60, stop=[word],
                                            include_stop_str_in_output=True))[0].outputs[0]
    assert out.text == full.text[:full.text.index(word) + len(word)] and out.finish_reason == "stop"
    stop_id = full.token_ids[2]
    out = smol.chat(CAPITAL, SamplingParams(temperature=0, max_tokens=60, stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.stop_reason == stop_id


def test_logit_bias_steers_and_unbounded_chat_runs_to_eos(smol):
    out = smol.generate("Hello", SamplingParams(temperature=0, max_tokens=4, logit_bias={42: 100}))[0].outputs[0]
    assert out.token_ids == [42] * 4
    plain = smol.generate("Hello", SamplingParams(temperature=0, max_tokens=4))[0].outputs[0]
    banned = plain.token_ids[0]
    out = smol.generate("Hello", SamplingParams(temperature=0, max_tokens=4, logit_bias={banned: -100}))[0]
    assert out.outputs[0].token_ids[0] != banned
    say_hi = [{"role": "user", "content": "Say hi"}]
    out = smol.chat(say_hi, SamplingParams(temperature=0, max_tokens=None))[0].outputs[0]
    assert out.finish_reason == "stop" and len(out.token_ids) > 16


def test_allowed_token_ids_hold_greedy_sampled_and_min_tokens_draws(smol):
    first = smol.chat(CAPITAL, SamplingParams(temperature=0, max_tokens=1, logprobs=20))[0].outputs[0]
    ranked = [e.token_id for e in first.logprobs[0].top_logprobs]  # the model's first choices, best first
    allowed = [ranked[5], ranked[2], 42] if 42 not in ranked[:3] else [ranked[5], ranked[2]]
    greedy = SamplingParams(temperature=0, max_tokens=6, allowed_token_ids=allowed)
    out = smol.chat(CAPITAL, greedy)[0].outputs[0]
    assert out.token_ids[0] == ranked[2]  # greedy among the allowed: the allowed token ranked highest
    for c in [out, *smol.chat(CAPITAL, SamplingParams(temperature=1.0, top_p=0.9, seed=1, n=3, max_tokens=6,
                                                      allowed_token_ids=allowed, repetition_penalty=1.3))[0].outputs]:
        assert len(c.token_ids) == 6 and set(c.token_ids) <= set(allowed), c.token_ids
    # only EOS allowed, and min_tokens would ban it: EOS is still drawn, nothing else
    eos = smol.llm_engine.eos_token_ids[0]
    out = smol.generate("Hello", SamplingParams(temperature=0, max_tokens=5, min_tokens=3,
                                                allowed_token_ids=[eos]))[0].outputs[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop"


def test_truncate_prompt_tokens_keeps_the_prompts_end(smol):
    prompt = smol.tokenizer.encode("One two three four five six seven eight nine ten")
    params = SamplingParams(temperature=0, max_tokens=4)
    cut = smol.generate(prompt, replace(params, truncate_prompt_tokens=5))[0]
    assert cut.prompt_token_ids == prompt[-5:]
    assert cut.outputs[0].token_ids == smol.generate(prompt[-5:], params)[0].outputs[0].token_ids
    assert smol.generate(prompt, replace(params, truncate_prompt_tokens=1000))[0].prompt_token_ids == prompt
    with pytest.raises(ValueError, match="truncate_prompt_tokens=0"):
        SamplingParams(truncate_prompt_tokens=0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(allowed_token_ids=[]), r"allowed_token_ids=\[\] must be a non-empty list"),
    (dict(allowed_token_ids=[1, -2]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1], structured_outputs={"regex": "a+"}), "allowed_token_ids cannot be combined"),
])
def test_bad_allowed_token_ids_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_allowed_token_ids_outside_the_vocabulary_or_all_bad_are_named(smol):
    with pytest.raises(ValueError, match="allowed_token_ids"):
        smol.generate("Hello", SamplingParams(allowed_token_ids=[10**7]))
    paris = smol.tokenizer.encode(" Paris", add_special_tokens=False)
    with pytest.raises(ValueError, match="bad_words ban every token of allowed_token_ids"):
        smol.generate("Hello", SamplingParams(allowed_token_ids=paris, bad_words=["Paris"]))


def test_an_output_ends_when_bad_words_leave_no_allowed_token(smol):
    """With allowed_token_ids, bad words of several tokens may ban every allowed token after some output: the
    output ends there ("stop"), rather than with a draw from a row with nothing left (a token outside both)."""
    hello, world = (smol.tokenizer.encode(w, add_special_tokens=False) for w in (" hello", " world"))
    assert len(hello) == len(world) == 1
    allowed = hello + world
    rules = dict(allowed_token_ids=allowed, bad_words=["hello hello", "hello world"])
    params = [SamplingParams(temperature=0, max_tokens=8, **rules)]
    params += [SamplingParams(temperature=1.0, seed=seed, max_tokens=8, **rules) for seed in range(6)]
    params += [SamplingParams(temperature=0, max_tokens=8, logit_bias={world[0]: 100}, **rules)]
    outs = [o.outputs[0] for o in smol.generate(["Say:"] * len(params), params)]
    assert outs[0].token_ids == hello and outs[0].finish_reason == "stop"  # after " hello", nothing is left
    assert outs[-1].token_ids == world * 8 and outs[-1].finish_reason == "length"  # " world" leaves " hello"
    for c in outs:
        assert set(c.token_ids) <= set(allowed) and not contains(c.token_ids, hello * 2)
        assert not contains(c.token_ids, hello + world)
        assert c.finish_reason == "length" or c.token_ids[-1] == hello[0]


def contains(tokens: list[int], seq: list[int]) -> bool:
    return any(tokens[i:i + len(seq)] == seq for i in range(len(tokens) - len(seq) + 1))


def test_bad_words_are_never_completed_with_or_without_async_scheduling(smol, embedded_dir):
    plain = smol.chat(CAPITAL, SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    assert plain.text == "The capital of France is Paris."
    words = ["Paris", "France is"]  # one token after a space; two tokens, the second banned after the first
    spelled = smol.llm_engine.inputs.bad_words_token_ids(words)
    assert [smol.tokenizer.decode(ids) for ids in spelled] == ["Paris", " Paris", "France is", " France is"]
    assert any(len(ids) == 2 and contains(plain.token_ids, ids) for ids in spelled)
    params = [SamplingParams(temperature=0, max_tokens=40, bad_words=words),
              SamplingParams(temperature=1.0, seed=4, n=2, max_tokens=40, bad_words=words)]
    outs = smol.chat(CAPITAL, params[0])[0].outputs + smol.chat(CAPITAL, params[1])[0].outputs
    for c in outs:
        assert not any(contains(c.token_ids, ids) for ids in spelled), c.text
    assert outs[0].text.startswith("The capital of France") and "Paris" not in outs[0].text
    with LLM(str(embedded_dir), async_scheduling=True) as ahead:
        with launched_batches(ahead.llm_engine) as batches:
            again = ahead.chat(CAPITAL, params[0])[0].outputs + ahead.chat(CAPITAL, params[1])[0].outputs
        # a draw whose bans read the draw before it is never scheduled ahead of it
        assert not any(b.deferred_inputs for b in batches)
        single = ahead.chat(CAPITAL, SamplingParams(temperature=0, max_tokens=40, bad_words=["Paris"]))[0]
    assert [c.token_ids for c in again] == [c.token_ids for c in outs]
    assert "Paris" not in single.outputs[0].text


@pytest.mark.parametrize("kwargs, message", [
    (dict(bad_words=[""]), "bad_words"),
    (dict(bad_words="Paris"), "bad_words"),
    (dict(bad_words=["Paris"], structured_outputs={"regex": "a+"}), "bad_words cannot be combined"),
])
def test_bad_bad_words_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
