"""Offline logprobs in vLLM's shape, indexed as scripts written for vLLM index them: per position a
{token id: Logprob(logprob, rank, decoded_token)} dict, the sampled token first, then the top k; prompt
logprobs with None first. Values and ranks against a transformers forward of the same random model (fp32)."""

from __future__ import annotations

import json
import pickle
import shutil

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.outputs import Logprob, PositionLogprobs

TOLERANCE = 1e-4  # between our logprobs and transformers'


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, embedded_dir):
    """A random 2-layer Llama saved by transformers, with SmolLM2's tokenizer and chat template. Its weights are
    large enough that its next-token distributions are far from uniform: sampled tokens' ranks spread out."""
    import transformers

    d = tmp_path_factory.mktemp("random_llama")
    config = json.loads((embedded_dir / "config.json").read_text())
    config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True, initializer_range=0.25)
    config.pop("head_dim", None)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**config), dtype=torch.float32)
    model.eval().save_pretrained(d)
    for f in embedded_dir.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, d / f.name)
    return d


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(str(model_dir), max_model_len=512) as llm:
        yield llm


@pytest.fixture(scope="module")
def hf(model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def reference(hf, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), V]: the logprobs of the token after each position."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([token_ids])).logits[0].float(), dim=-1)


def check_rank(rank: int, row: torch.Tensor, token: int) -> None:
    """vLLM's rank, how many tokens are at least as likely, within what the two forwards' rounding allows."""
    value = row[token].item()
    lowest, highest = ((row >= value + s * TOLERANCE).sum().item() for s in (2, -2))
    assert lowest <= rank <= highest and highest - lowest < 10, (rank, lowest, highest)


def check_position(scored: dict[int, Logprob], row: torch.Tensor, token: int, k: int, tokenizer) -> None:
    """One position, as a vLLM script reads it: the token first, then the top k by rank; k or k + 1 entries."""
    top = row.topk(k)
    ranked = top.indices.tolist()
    assert next(iter(scored)) == token
    assert len(scored) == (k if token in ranked else k + 1)
    assert [tid for tid in scored if tid != token] == [t for t in ranked if t != token]
    for tid, lp in scored.items():
        assert abs(lp.logprob - row[tid].item()) < TOLERANCE, tid
        assert lp.decoded_token == tokenizer.decode([tid])
        if tid in ranked:
            assert lp.rank == ranked.index(tid) + 1  # top k: ranks 1..k
        else:
            check_rank(lp.rank, row, tid)
    # pagedserve's own view of the same position
    assert isinstance(scored, PositionLogprobs) and scored.token_id == token
    assert (scored.logprob, scored.token, scored.rank) == (scored[token].logprob, scored[token].decoded_token,
                                                           scored[token].rank)
    assert [t.token_id for t in scored.top_logprobs] == ranked
    assert [t.rank for t in scored.top_logprobs] == list(range(1, k + 1))
    assert all(scored[t.token_id] is t for t in scored.top_logprobs)


@pytest.mark.parametrize("k", [0, 3])
def test_generate_gives_vllm_logprobs_and_prompt_logprobs(llm, hf, k):
    prompts = [llm.tokenizer.encode("The quick brown fox jumps over"), llm.tokenizer.encode("Once upon a time")]
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True, logprobs=k, prompt_logprobs=k)
    ranks = []
    for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
        c = out.outputs[0]
        ref = reference(hf, prompt + c.token_ids)
        assert len(c.logprobs) == len(c.token_ids)
        for i, token in enumerate(c.token_ids):
            check_position(c.logprobs[i], ref[len(prompt) - 1 + i], token, k, llm.tokenizer)
            ranks.append(c.logprobs[i][token].rank)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for t in range(1, len(prompt)):
            check_position(out.prompt_logprobs[t], ref[t - 1], prompt[t], k, llm.tokenizer)
    assert len(set(ranks)) > 5  # sampled, not only the most likely tokens: the ranks say which


def test_greedy_tokens_rank_first(llm):
    out = llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2))[0]
    for token, scored in zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=True):
        assert list(scored) == [token, scored.top_logprobs[1].token_id] and scored[token].rank == 1


def test_chat_gives_vllm_logprobs(llm, hf):
    messages = [{"role": "user", "content": "Name a color."}]
    params = SamplingParams(temperature=1.0, seed=2, n=2, max_tokens=8, ignore_eos=True, logprobs=2)
    out = llm.chat(messages, params)[0]
    assert out.prompt_logprobs is None
    for c in out.outputs:
        ref = reference(hf, out.prompt_token_ids + c.token_ids)
        for i, token in enumerate(c.token_ids):
            check_position(c.logprobs[i], ref[len(out.prompt_token_ids) - 1 + i], token, 2, llm.tokenizer)


def test_outputs_pickle_with_their_logprobs(llm):
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=4, logprobs=2, prompt_logprobs=1)
    out = llm.generate("Pickled logprobs", params)[0]
    back = pickle.loads(pickle.dumps(out))
    assert back == out and back.prompt_logprobs[0] is None
    for before, after in zip(out.outputs[0].logprobs + out.prompt_logprobs[1:],
                             back.outputs[0].logprobs + back.prompt_logprobs[1:], strict=True):
        assert type(after) is PositionLogprobs and list(after.items()) == list(before.items())
        assert after.token_id == before.token_id and after.top_logprobs == before.top_logprobs
        assert all(after[t.token_id] is t for t in after.top_logprobs)


def test_logprob_takes_vllms_arguments():
    lp = Logprob(logprob=-0.5, rank=2, decoded_token="a")
    assert (lp.logprob, lp.rank, lp.decoded_token, lp.token, lp.token_id) == (-0.5, 2, "a", "a", None)
    assert Logprob(-0.5, 2, "a") == lp and pickle.loads(pickle.dumps(lp)) == lp
