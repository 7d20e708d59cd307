"""Reasoning parsed out of the answer: where a sample begins, the split of its text, and streams that join to
the unary answer."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.chat.reasoning import ReasoningStream, ReasoningTags, check_reasoning_parser, split_reasoning

OPEN, CLOSE = 7, 8  # the tags' token ids in the prompts below
WORDS = {1: "user", 2: "hi", 3: "\n", 4: "assistant", OPEN: "<think>", CLOSE: "</think>"}


def decode(ids):
    return "".join(WORDS[i] for i in ids)


@pytest.mark.parametrize("parser, prompt, start", [
    ("qwen3", [1, 2, 4, 3], "may_open"),  # Qwen3: the model opens the block itself, if it thinks
    ("deepseek_r1", [1, 2, 4, 3], "reasoning"),  # R1: it reasons first, tag or not
    ("qwen3", [1, 2, 4, OPEN, 3], "reasoning"),  # the template opened the block (Thinking-2507, R1)
    ("deepseek_r1", [1, 2, 4, OPEN, 3], "reasoning"),
    ("qwen3", [1, 2, 4, OPEN, 3, 3, CLOSE, 3, 3], "answer"),  # enable_thinking false: an empty block, closed
    ("deepseek_r1", [1, 2, 4, OPEN, 3, CLOSE, 3], "answer"),
    # an earlier turn's closed block, then more conversation: this turn may think again
    ("qwen3", [4, OPEN, 2, CLOSE, 2, 1, 2, 4, 3], "may_open"),
    ("deepseek_r1", [4, OPEN, 2, CLOSE, 2, 1, 2, 4, 3], "reasoning"),
    ("qwen3", [4, OPEN, 2, CLOSE, 2, 1, 2, 4, OPEN, 3], "reasoning"),
])
def test_where_a_sample_begins_is_read_from_the_prompt(parser, prompt, start):
    assert ReasoningTags(parser, OPEN, CLOSE).start(prompt, decode) == start


@pytest.mark.parametrize("start, text, reasoning, answer", [
    ("may_open", "<think>\nLet me see.\n</think>\n\nIt is 4.", "Let me see.", "It is 4."),
    ("may_open", "It is 4.", "", "It is 4."),
    ("may_open", "It is <think>4</think>.", "", "It is <think>4</think>."),  # tags inside an answer are text
    ("reasoning", "Let me see.\n</think>\n\nIt is 4.", "Let me see.", "It is 4."),
    ("reasoning", "<think>Let me see.</think>It is 4.", "Let me see.", "It is 4."),  # the tag written again
    ("reasoning", "Let me see, 2 + 2", "Let me see, 2 + 2", ""),  # cut short: all of it is reasoning
    ("reasoning", "a</think>b</think>c", "a", "b</think>c"),  # the first closing tag ends the reasoning
    ("answer", "<think>x</think>y", "", "<think>x</think>y"),
    ("may_open", "<thi", "", "<thi"),  # finished on half a tag: the text it is
    ("reasoning", "so </thi", "so </thi", ""),
])
def test_the_text_splits_into_reasoning_and_answer(start, text, reasoning, answer):
    assert split_reasoning(start, text, final=True) == (reasoning, answer)


@pytest.mark.parametrize("start, text, reasoning, answer", [
    ("may_open", " <thi", "", ""),  # may become <think>: nothing is known yet
    ("may_open", "<think>so </thi", "so", ""),  # may become </think>: held, with the space before it
    ("reasoning", "so\n\n", "so", ""),
    ("reasoning", "so</think>\n", "so", ""),
])
def test_what_may_yet_be_a_tag_is_held_back(start, text, reasoning, answer):
    assert split_reasoning(start, text, final=False) == (reasoning, answer)


PIECES = st.sampled_from(["<think>", "</think>", "<", "</th", "<thi", "nk>", " ", "\n", "a", "b c"])


@settings(max_examples=300, deadline=None)
@given(start=st.sampled_from(["reasoning", "may_open", "answer"]), pieces=st.lists(PIECES, max_size=12),
       cuts=st.lists(st.integers(0, 60), max_size=6))
def test_a_stream_joins_to_the_unary_answer(start, pieces, cuts):
    text = "".join(pieces)
    whole = split_reasoning(start, text, final=True)
    stream = ReasoningStream(start)
    reasoning = answer = ""
    for cut in sorted(c for c in cuts if c < len(text)) + [len(text)]:
        r, a = stream.update(text[:cut], final=cut == len(text))
        reasoning, answer = reasoning + r, answer + a
        # nothing sent is ever taken back: what has been sent is where the whole answer starts
        assert whole[0].startswith(reasoning) and whole[1].startswith(answer)
    assert (reasoning, answer) == whole


def test_an_unknown_parser_is_refused_by_name():
    with pytest.raises(ValueError, match="reasoning_parser='qwen2'"):
        check_reasoning_parser("qwen2")
    check_reasoning_parser(None)
    check_reasoning_parser("deepseek_r1")


# ---- the engine: the setting, where chats begin, and constraints that start after the reasoning ----------

THINK, UNTHINK = 49152, 49153  # the tags' ids in `thinking_random`
ASK = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def thinker(thinking_random):
    from pagedserve import LLM

    with LLM(thinking_random, max_model_len=512, reasoning_parser="qwen3") as llm:
        yield llm


def test_the_setting_needs_a_model_with_thinking_tags(tiny_random):
    from pagedserve import LLM

    with pytest.raises(ValueError, match="reasoning_parser='qwen3' is for models that write their reasoning"):
        LLM(tiny_random, reasoning_parser="qwen3")
    with pytest.raises(ValueError, match="reasoning_parser='qwen2' must be one of"):
        LLM(tiny_random, reasoning_parser="qwen2")


def test_a_chat_plan_knows_where_its_reasoning_begins(thinker):
    from pagedserve import SamplingParams
    from pagedserve.chat.template import ChatOptions

    def start(**kwargs):
        options = ChatOptions(chat_template_kwargs=kwargs)
        return thinker.llm_engine.inputs.chat_plan(ASK, SamplingParams(), options=options).reasoning

    assert start() == "may_open"  # the model may open a block itself
    assert start(thinking=True) == "reasoning"  # the template opened it
    assert start(enable_thinking=False) == "answer"  # the template closed an empty one


def test_chat_outputs_carry_the_reasoning_and_the_answer_apart(thinker):
    from pagedserve import SamplingParams

    never_closes = SamplingParams(seed=1, max_tokens=12, ignore_eos=True, logit_bias={UNTHINK: -100})
    out = thinker.chat(ASK, never_closes, chat_template_kwargs={"thinking": True})[0].outputs[0]
    assert out.reasoning == out.text.strip() and out.reasoning  # cut short while thinking: all reasoning
    closes_at_once = SamplingParams(seed=1, max_tokens=12, ignore_eos=True, logit_bias={UNTHINK: 100})
    out = thinker.chat(ASK, closes_at_once, chat_template_kwargs={"thinking": True})[0].outputs[0]
    assert out.token_ids[0] == UNTHINK and out.reasoning == ""
    plain = thinker.chat(ASK, never_closes, chat_template_kwargs={"enable_thinking": False})[0].outputs[0]
    assert plain.reasoning == ""  # no reasoning whatever the text


@pytest.mark.parametrize("prompt_end, first", [
    ([THINK, 198], UNTHINK),  # inside a block: free until it closes (the bias closes it at once), then the regex
    ([THINK, 198, UNTHINK, 198, 198], None),  # a closed block: the regex from the first token
    ([198], None),  # may open one: the regex, or the opening tag
])
def test_a_constraint_shapes_the_answer_after_the_reasoning(thinker, prompt_end, first):
    import re

    from pagedserve import SamplingParams

    prompt = thinker.tokenizer.encode("What is 2 + 2?") + prompt_end
    params = SamplingParams(temperature=0, max_tokens=12, logit_bias={UNTHINK: 100},
                            structured_outputs={"regex": "[a-z]{3,8}"})
    out = thinker.generate([prompt], params)[0].outputs[0]
    answer = out.token_ids[1:] if first is not None else out.token_ids
    assert out.token_ids[0] == first or first is None
    assert re.fullmatch("[a-z]{3,8}", thinker.tokenizer.decode(answer, skip_special_tokens=True)), out.text
    assert out.finish_reason == "stop"  # the grammar ended it


def test_a_sample_that_opens_a_block_draws_freely_inside_it(thinker):
    from pagedserve import SamplingParams

    prompt = thinker.tokenizer.encode("What is 2 + 2?") + [198]
    params = SamplingParams(temperature=0, max_tokens=6, logit_bias={THINK: 100},
                            structured_outputs={"regex": "[a-z]{3,8}"})
    out = thinker.generate([prompt], params)[0].outputs[0]
    # the opening tag is allowed first; inside the block the regex does not apply (the bias repeats the tag)
    assert out.token_ids == [THINK] * 6 and out.finish_reason == "length"


def test_an_answer_that_is_only_reasoning_may_come_back_without_content():
    from pagedserve.chat.template import check_messages

    history = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": None, "reasoning": "Two"}]
    assert check_messages(history)[1] == {"role": "assistant", "content": "", "reasoning": "Two",
                                          "reasoning_content": "Two"}
    with pytest.raises(ValueError, match=r"messages\[1\].content must be a string"):
        check_messages([history[0], {"role": "assistant", "content": None}])


def test_reasoning_sent_back_crosses_the_wire_under_one_name():
    from pagedserve.protos.chat_messages import messages_from_proto, messages_to_proto

    history = [{"role": "user", "content": "2 + 2?"},
               {"role": "assistant", "content": "4", "reasoning_content": "Two and two."}]
    assert messages_from_proto(messages_to_proto(history))[1] == {"role": "assistant", "content": "4",
                                                                  "reasoning": "Two and two."}
    with pytest.raises(ValueError, match=r"messages\[1\]: reasoning and reasoning_content differ"):
        messages_to_proto([history[0], dict(history[1], reasoning="Other.")])
    with pytest.raises(ValueError, match=r"messages\[0\].reasoning: only assistant messages carry reasoning"):
        messages_to_proto([dict(history[0], reasoning="x")])


def test_reasoning_tokens_run_to_the_tag_that_ends_the_thought():
    from pagedserve.chat.reasoning import reasoning_tokens

    end = 9
    assert reasoning_tokens("reasoning", [1, 2, end, 4, 5], end, "12") == 3  # the closing tag is the thought's
    assert reasoning_tokens("reasoning", [1, 2, 3], end, "123") == 3  # cut short: all of it
    assert reasoning_tokens("may_open", [8, 1, end, 4], end, "1") == 3
    assert reasoning_tokens("may_open", [4, 5], end, "") == 0  # it answered without thinking
    assert reasoning_tokens("answer", [1, end], end, "") == 0
