"""How the chat template renders a conversation: template variables (`chat_template_kwargs`), the last
message left open (`continue_final_message`) and the generation prompt, in the engine and the offline
`LLM.chat`; participants' names and the developer role; bad options refused by name."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.chat.template import ChatOptions

ASK = [{"role": "user", "content": "What is the capital of France?"}]
PREFILLED = ASK + [{"role": "assistant", "content": "The capital of France is"}]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_random):
    with LLM(tiny_random) as llm:
        yield llm


def text(llm, messages, options=None) -> str:
    return llm.tokenizer.decode(llm.llm_engine.inputs.chat_prompt(messages, options=options))


def test_template_variables_reach_the_template(llm):
    plain = text(llm, ASK)
    assert plain.endswith("<|im_start|>assistant\n")
    # the fixture's template opens an empty thinking block when enable_thinking is false, as Qwen3's does
    assert text(llm, ASK, ChatOptions(chat_template_kwargs={"enable_thinking": False})) == \
        plain + "<think>\n\n</think>\n\n"
    assert text(llm, ASK, ChatOptions(chat_template_kwargs={"enable_thinking": True})) == plain
    # a variable the template does not read changes nothing, as with transformers' apply_chat_template
    assert text(llm, ASK, ChatOptions(chat_template_kwargs={"unread": 1})) == plain
    thinking_off = llm.chat(ASK, GREEDY, chat_template_kwargs={"enable_thinking": False})[0]
    assert llm.tokenizer.decode(thinking_off.prompt_token_ids) == plain + "<think>\n\n</think>\n\n"


def test_continue_final_message_leaves_the_last_message_open(llm):
    options = ChatOptions(add_generation_prompt=False, continue_final_message=True)
    ids = llm.llm_engine.inputs.chat_prompt(PREFILLED, options=options)
    assert llm.tokenizer.decode(ids).endswith("<|im_start|>assistant\nThe capital of France is")
    # closed and followed by a new turn by default; closed and nothing after without the generation prompt
    assert text(llm, PREFILLED).endswith("The capital of France is<|im_end|>\n<|im_start|>assistant\n")
    assert text(llm, PREFILLED, ChatOptions(add_generation_prompt=False)).endswith(
        "The capital of France is<|im_end|>\n")
    out = llm.chat(PREFILLED, GREEDY, add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == llm.generate([ids], GREEDY)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="continue_final_message.*add_generation_prompt"):
        llm.chat(PREFILLED, GREEDY, continue_final_message=True)


def test_documents_reach_the_template(llm):
    docs = [{"title": "Paris", "text": "The capital of France."}, {"title": "Lyon", "text": "A city."}]
    grounded = text(llm, ASK, ChatOptions(documents=docs))
    assert grounded == ("<|im_start|>system\nDocuments:\nParis: The capital of France.\nLyon: A city.\n<|im_end|>\n"
                        + text(llm, ASK))
    assert text(llm, ASK, ChatOptions(documents=[])) == text(llm, ASK)  # none: as without them
    out = llm.chat(ASK, GREEDY, documents=docs)[0]
    assert llm.tokenizer.decode(out.prompt_token_ids) == grounded


def test_add_special_tokens_adds_the_tokenizers_own_on_top_of_the_templates(tiny_random):
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    from pagedserve.chat.template import ChatTemplate

    # The fixture's tokenizer adds no BOS (SmolLM2's); this copy adds one, as Llama 3's does.
    tokenizer = AutoTokenizer.from_pretrained(tiny_random.removeprefix("random:").removesuffix("config.json"))
    plain = ChatTemplate(tokenizer).render(ASK, [])
    tokenizer._tokenizer.post_processor = TemplateProcessing(single="<|endoftext|> $A",
                                                             special_tokens=[("<|endoftext|>", 0)])
    template = ChatTemplate(tokenizer)
    assert template.render(ASK, []) == plain  # the template's tokens alone, by default
    assert template.render(ASK, [], ChatOptions(add_special_tokens=True)) == [0] + plain


@pytest.mark.parametrize("kwargs, message", [
    ({"documents": {"title": "a"}}, r"documents=\{'title': 'a'\} must be a list of objects of strings"),
    ({"documents": [{"title": 1}]}, r"documents=\[\{'title': 1\}\] must be a list"),
    ({"add_special_tokens": "no"}, r"add_special_tokens='no' must be true or false"),
    ({"continue_final_message": True}, r"continue_final_message=true .* add_generation_prompt=true"),
    ({"add_generation_prompt": "yes"}, r"add_generation_prompt='yes' must be true or false"),
    ({"add_generation_prompt": False, "continue_final_message": 1}, r"continue_final_message=1 must be true"),
    ({"chat_template_kwargs": {"tokenize": False}}, r"chat_template_kwargs: \['tokenize'\] are set by the server"),
    ({"chat_template_kwargs": {"messages": [], "tools": []}}, r"chat_template_kwargs: \['messages', 'tools'\]"),
    ({"chat_template_kwargs": ["enable_thinking"]}, r"chat_template_kwargs=\['enable_thinking'\] must be an object"),
    ({"chat_template_kwargs": {1: True}}, r"chat_template_kwargs=\{1: True\} must be an object"),
])
def test_bad_options_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ChatOptions(**kwargs)


def test_a_final_message_the_template_rewrites_cannot_be_continued(llm):
    engine = llm.llm_engine.inputs
    template = engine.chat_template()
    saved = template.tokenizer.chat_template
    template.tokenizer.chat_template = "{% for m in messages %}{{ m.content | upper }}{% endfor %}"
    try:
        with pytest.raises(ValueError, match="continue_final_message: the model's chat template does not render"):
            engine.chat_prompt(PREFILLED, options=ChatOptions(add_generation_prompt=False,
                                                              continue_final_message=True))
    finally:
        template.tokenizer.chat_template = saved


def test_chat_options_go_with_messages_not_text(llm):
    engine = llm.llm_engine.inputs
    with pytest.raises(ValueError, match="continue_final_message, chat_template_kwargs: these shape a chat's prompt"):
        engine.tokenize("hi", options=ChatOptions(add_generation_prompt=False, continue_final_message=True,
                                                  chat_template_kwargs={"enable_thinking": False}))
    with pytest.raises(ValueError, match="tools: these shape a chat's prompt"):
        engine.tokenize("hi", tools=[{"type": "function", "function": {"name": "f"}}])
    assert engine.tokenize("hi", options=ChatOptions())[0] == llm.tokenizer.encode("hi")
    options = ChatOptions(chat_template_kwargs={"enable_thinking": False})
    assert engine.tokenize(messages=ASK, options=options)[0] == engine.chat_prompt(ASK, options=options)


# Shows each message's role and its participant's name, and knows the developer role by name
NAMING_TEMPLATE = ("{% for m in messages %}{{ '[' ~ ('dev' if m.role == 'developer' else m.role) }}"
                   "{% if m.name %}{{ ' ' ~ m.name }}{% endif %}{{ '] ' ~ m.content ~ '\n' }}{% endfor %}")


@pytest.fixture
def naming(embedded_dir):
    from transformers import AutoTokenizer

    from pagedserve.chat.template import ChatTemplate

    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    tokenizer.chat_template = NAMING_TEMPLATE
    template = ChatTemplate(tokenizer)
    return lambda messages: tokenizer.decode(template.render(messages, []))


def test_names_reach_a_template_that_shows_them(llm, naming):
    named = [{"role": "system", "content": "Be brief.", "name": "ops"},
             {"role": "user", "content": "hi", "name": "alice"}, {"role": "user", "content": "hello", "name": "bob"}]
    assert naming(named) == "[system ops] Be brief.\n[user alice] hi\n[user bob] hello\n"
    # a template with no place for names (SmolLM2's) renders as without them, as transformers' does
    unnamed = [{k: v for k, v in m.items() if k != "name"} for m in named]
    assert text(llm, named) == text(llm, unnamed)
    for bad in ("", 7):
        with pytest.raises(ValueError, match=r"messages\[1\]\.name must be a non-empty string"):
            llm.llm_engine.inputs.chat_prompt([named[0], {**named[1], "name": bad}])


def test_a_developer_message_is_the_system_message_unless_the_template_knows_the_role(llm, naming):
    developer = [{"role": "developer", "content": "Answer in French."}] + ASK
    system = [{"role": "system", "content": "Answer in French."}] + ASK
    # SmolLM2's template writes any role as given, and adds its own system turn before a first non-system one
    assert text(llm, developer) == text(llm, system)
    assert "developer" not in text(llm, developer)
    assert naming(developer) == "[dev] Answer in French.\n[user] What is the capital of France?\n"
    # with tools on a template that ignores them, the instructions join the developer's system turn
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    with_tools = llm.tokenizer.decode(llm.llm_engine.inputs.chat_prompt(developer, tools=tools))
    assert with_tools.startswith("<|im_start|>system\nAnswer in French.\n\n# Tools")


def test_a_chat_too_long_for_its_context_loses_its_oldest_messages_whole(tiny_random):
    with LLM(tiny_random, max_model_len=128) as llm:
        turns = [{"role": "system", "content": "Be brief."}]
        for i in range(12):
            turns += [{"role": "user", "content": f"Question {i}: what is {i} + {i}?"},
                      {"role": "assistant", "content": f"{i + i}."}]
        turns.append({"role": "user", "content": "And 7 + 7?"})
        with pytest.raises(ValueError, match="more than max_model_len|positions"):
            llm.chat(turns, SamplingParams(max_tokens=8))
        out = llm.chat(turns, SamplingParams(max_tokens=8, truncate_prompt_tokens=-1))[0]
        kept = next(turns[:1] + turns[i:] for i in range(1, len(turns), 2)  # whole turns: user, then answer
                    if len(llm.llm_engine.inputs.chat_prompt(turns[:1] + turns[i:])) <= 128 - 8)
        # the system message and the latest turns
        assert out.prompt_token_ids == llm.llm_engine.inputs.chat_prompt(kept)
        assert kept[1]["role"] == "user" and len(kept) < len(turns)
