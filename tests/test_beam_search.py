"""Beam search: the beams transformers' num_beams search finds, token for token and in its order (embedded
SmolLM2, fp32), offline and on the served step loop; an abort or a caller that leaves ends it and frees every
block; what a beam search cannot honour is refused by name."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.engine.async_engine import AsyncEngine

ASKS = [[{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "Name a color."}]]


def beams(n: int, max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(n=n, max_tokens=max_tokens, temperature=0, use_beam_search=True, **kw)


@pytest.fixture(scope="module")
def smol(embedded_dir):
    with LLM(str(embedded_dir)) as llm:
        yield llm


def hf_beams(model, prompt: list[int], width: int, max_tokens: int, length_penalty: float,
             eos: list[int]) -> list[list[int]]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, num_return_sequences=width,
                             max_new_tokens=max_tokens, do_sample=False, length_penalty=length_penalty,
                             eos_token_id=eos, pad_token_id=eos[0])
    beams = []
    for row in out[:, len(prompt):].tolist():  # a beam that ended is padded after its end-of-sequence token
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        beams.append(row[:end])
    return beams


@pytest.mark.parametrize("width, length_penalty, max_tokens", [(2, 1.0, 12), (4, 0.5, 16), (3, 2.0, 10)])
def test_the_beams_are_transformers_beams(smol, embedded_dir, width, length_penalty, max_tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(embedded_dir, dtype=torch.float32).eval()
    prompts = [smol.llm_engine.inputs.chat_prompt(ask) for ask in ASKS] + [smol.tokenizer.encode("The printing press")]
    outs = smol.generate(prompts, beams(width, max_tokens, length_penalty=length_penalty))
    eos = list(smol.llm_engine.eos_token_ids)
    reasons = set()
    for prompt, out in zip(prompts, outs, strict=True):
        assert [c.token_ids for c in out.outputs] == hf_beams(model, prompt, width, max_tokens, length_penalty, eos)
        for c in out.outputs:
            ended = c.token_ids[-1] in eos
            assert c.finish_reason == ("stop" if ended else "length") and (ended or len(c.token_ids) == max_tokens)
            assert c.text == smol.tokenizer.decode(c.token_ids, skip_special_tokens=True)
            reasons.add(c.finish_reason)
    assert reasons == {"stop", "length"}  # beams that ended and beams that ran out, both compared
    assert smol.stats()["num_free_blocks"] == smol.stats()["num_total_blocks"]


def test_beam_searches_and_plain_requests_share_a_generate_call(smol):
    prompt = smol.llm_engine.inputs.chat_prompt(ASKS[0])
    plain = SamplingParams(temperature=0, max_tokens=8)
    alone = smol.generate([prompt, prompt], [beams(2, 8), plain])
    mixed = smol.generate([prompt, prompt, prompt], [plain, beams(2, 8), beams(3, 8, stop_token_ids=[30])])
    assert mixed[0].outputs[0].token_ids == alone[1].outputs[0].token_ids
    assert [c.token_ids for c in mixed[1].outputs] == [c.token_ids for c in alone[0].outputs]
    # a stop_token_ids token ends a beam as an end-of-sequence token does, and is its stop_reason
    for c in mixed[2].outputs:
        assert (c.finish_reason, c.stop_reason) in {("length", None), ("stop", None), ("stop", 30)}
        assert c.finish_reason == "length" or c.token_ids[-1] == (c.stop_reason or 2)
    assert smol.stats()["num_free_blocks"] == smol.stats()["num_total_blocks"]


def test_a_served_beam_search_answers_once_and_ends_on_abort_or_when_its_caller_leaves(smol, embedded_dir):
    prompt = smol.llm_engine.inputs.chat_prompt(ASKS[1])
    want = smol.generate(prompt, beams(3, 12))[0]

    async def main():
        core = AsyncEngine(EngineConfig(model=str(embedded_dir)))
        try:
            answers = [out async for out in core.generate(prompt, beams(3, 12), request_id="b")]
            endless = beams(2, 400, ignore_eos=True)

            async def run(rid):
                return [out async for out in core.generate(prompt, endless, request_id=rid)]

            aborted = asyncio.create_task(run("aborted"))
            left = asyncio.create_task(run("left"))
            deadline = time.monotonic() + 60
            # both searches running their third step (their beams have tokens), or the test's time is up
            searches = core.llm_engine._searches
            while not all(rid in searches and searches[rid].num_steps >= 3 for rid in ("aborted", "left")):
                assert time.monotonic() < deadline, "the searches did not reach their third step"
                await asyncio.sleep(0.01)
            assert core.abort("aborted") and not core.abort("nothing-by-this-id")
            left.cancel()
            with pytest.raises(asyncio.CancelledError):
                await left
            ended = await aborted
            for _ in range(100):
                stats = core.stats()
                if stats["num_free_blocks"] == stats["num_total_blocks"]:
                    break
                await asyncio.sleep(0.05)
            return answers, ended, stats
        finally:
            core.shutdown()

    answers, ended, stats = asyncio.run(main())
    assert len(answers) == 1 and answers[0].finished
    assert [c.token_ids for c in answers[0].outputs] == [c.token_ids for c in want.outputs]
    assert len(ended) == 1 and [c.finish_reason for c in ended[0].outputs] == ["abort", "abort"]
    assert all(0 < len(c.token_ids) < 400 for c in ended[0].outputs)
    assert stats["num_free_blocks"] == stats["num_total_blocks"] and stats["num_streams"] == 0
    assert stats["num_running"] == stats["num_waiting"] == 0


@pytest.mark.parametrize("kw, named", [
    (dict(top_p=0.5), "top_p=0.5 cannot be combined with use_beam_search"),
    (dict(repetition_penalty=1.2), "repetition_penalty"),
    (dict(stop=["."]), "stop="),
    (dict(logprobs=1), "logprobs="),
    (dict(structured_outputs={"regex": "a+"}), "structured_outputs"),
    (dict(temperature=0.7), "temperature=0.7"),
    (dict(n=11), "n=11 beams"),
])
def test_what_a_beam_search_cannot_honour_is_refused_by_name(smol, kw, named):
    kw = {"n": 2, "temperature": 0, **kw}
    with pytest.raises(ValueError, match=named):
        smol.generate("Hi", SamplingParams(max_tokens=4, use_beam_search=True, **kw))


def test_a_forced_tool_call_is_refused_with_a_beam_search_by_its_own_name(smol):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with pytest.raises(ValueError, match="tool_choice='required' constrains the output: .* use_beam_search"):
        smol.chat(ASKS[0], beams(2, 8), tools=tools, tool_choice="required")


def test_length_penalty_needs_a_beam_search(smol):
    with pytest.raises(ValueError, match="length_penalty=0.5 .* needs use_beam_search"):
        smol.generate("Hi", SamplingParams(max_tokens=4, length_penalty=0.5))
    with pytest.raises(ValueError, match="use_beam_search: a beam search runs as requests of its own"):
        smol.llm_engine.inputs.make_request("Hi", SamplingParams(max_tokens=4, use_beam_search=True))
