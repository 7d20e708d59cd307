"""Tool calling in the engine and the offline `LLM.chat`: tools rendered through the chat template (native
Hermes and Llama 3 templates, and the Hermes instructions for a template that ignores tools), `required`
and named calls enforced by the grammar, calls parsed from the output, and history with calls and results."""

from __future__ import annotations

import copy
import json
import shutil

import jsonschema
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.chat.template import ChatTemplate
from pagedserve.chat.tool_calls import parse_tools
from tests.test_tool_calls import REF_PARAMETERS, REF_TOOLS
from tests.tools_data import ASK, HERMES_CALL, PARAMETERS, TOOLS

HISTORY = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
]

# The shape of Qwen2.5's template: tools in the system turn, calls as <tool_call> JSON, results as user turns.
HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
You are helpful.

# Tools

<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object within <tool_call></tool_call> XML tags.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}<|im_start|>assistant
{{ message.content }}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# The shape of Llama 3.1's: the ipython environment, calls as {"name", "parameters"} JSON.
LLAMA3_TEMPLATE = """\
<|start_header_id|>system<|end_header_id|>

Environment: ipython<|eot_id|>
{%- if tools %}<|start_header_id|>user<|end_header_id|>

Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|eot_id|>{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{% for call in message.tool_calls %}{"name": "{{ call.function.name }}", "parameters": \
{{ call.function.arguments | tojson }}}{% endfor %}<|eom_id|>
{%- elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

# Renders tools, in a format nothing here parses.
OTHER_TEMPLATE = """\
{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
{%- for message in messages %}[{{ message.role }}]{{ message.content }}{% endfor %}"""


@pytest.fixture(scope="module")
def smol(embedded_dir):
    llm = LLM(str(embedded_dir))
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def tokenizer(embedded_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_dir)


def template(tokenizer, source: str) -> ChatTemplate:
    """The embedded tokenizer under another chat template."""
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = source
    return ChatTemplate(tokenizer)


def text_of(t: ChatTemplate, messages, tools) -> str:
    return t.tokenizer.decode(t.render(messages, parse_tools(tools)))


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 200, **kw})


def check_calls(calls, names=None):
    assert calls, "no tool call"
    for call in calls:
        assert names is None or call.name in names
        jsonschema.validate(json.loads(call.arguments), PARAMETERS[call.name])
        assert call.id.startswith("call_")


def test_template_formats_are_told_apart(tokenizer):
    native = template(tokenizer, HERMES_TEMPLATE)
    assert (native.renders_tools, native.tool_format) == (True, "hermes")
    text = text_of(native, HISTORY, TOOLS)
    assert '"name": "get_weather"' in text and "<tools>" in text
    # the history's arguments reach the template as an object (its tojson), not as JSON text quoted again
    assert '"arguments": {"city": "Paris", "unit": "celsius"}' in text
    assert "<tool_response>\n{\"temperature\": 21}" in text
    llama = template(tokenizer, LLAMA3_TEMPLATE)
    assert (llama.renders_tools, llama.tool_format) == (True, "llama3_json")
    assert '"parameters": {"city": "Paris", "unit": "celsius"}' in text_of(llama, HISTORY, TOOLS)
    assert template(tokenizer, OTHER_TEMPLATE).tool_format is None


def test_a_template_without_tools_gets_hermes_instructions(smol):
    t = smol.llm_engine.inputs.chat_template()
    assert (t.renders_tools, t.tool_format) == (False, "hermes")
    text = smol.tokenizer.decode(smol.llm_engine.inputs.chat_prompt(HISTORY, tools=TOOLS))
    assert text.index("<tools>") < text.index('{"type": "function", "function": {"name": "get_weather"')
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' \
        in text
    assert '<|im_start|>user\n<tool_response>\n{"temperature": 21}\n</tool_response>' in text
    # without tools offered, the history is still written out
    assert "<tool_call>" in smol.tokenizer.decode(smol.llm_engine.inputs.chat_prompt(HISTORY))
    assert "<tools>" not in smol.tokenizer.decode(smol.llm_engine.inputs.chat_prompt(HISTORY))


def test_required_and_named_calls_follow_the_parameters(smol):
    required = smol.chat(ASK, greedy(), tools=TOOLS, tool_choice="required", parallel_tool_calls=False)[0].outputs[0]
    assert required.finish_reason == "stop"
    check_calls(required.tool_calls)
    assert len(required.tool_calls) == 1
    named = smol.chat(ASK, greedy(), tools=TOOLS,
                      tool_choice={"type": "function", "function": {"name": "get_time"}})[0].outputs[0]
    assert named.finish_reason == "stop" and [c.name for c in named.tool_calls] == ["get_time"]
    check_calls(named.tool_calls)
    assert named.tool_calls[0].arguments == named.text  # the whole output is the arguments
    # a follow-up turn with the call and its result in the history
    after = smol.chat(HISTORY, greedy(max_tokens=20), tools=TOOLS, tool_choice="none")[0].outputs[0]
    assert after.text and after.tool_calls is None


def test_auto_parses_a_forced_hermes_call_and_keeps_the_text(smol):
    """"auto" parses a Hermes-format call out of the model's text. The text is forced by a regex (HERMES_CALL):
    this checks the parsing of such a text, not that the model calls a tool on its own. Unforced, its short
    answer holds no call and is left as text."""
    out = smol.chat(ASK, greedy(structured_outputs={"regex": HERMES_CALL}), tools=TOOLS)[0].outputs[0]
    check_calls(out.tool_calls, ["get_weather"])
    assert out.text.startswith("Checking.\n<tool_call>")  # the offline output keeps what the model wrote
    plain = smol.chat(ASK, greedy(max_tokens=12), tools=TOOLS)[0].outputs[0]
    assert plain.tool_calls == [] and plain.text


def test_calls_stay_valid_with_n_3_under_preemption(embedded_dir, smol):
    """3 samples in a pool with room for the prompt and 3 more blocks: preemption by recompute must not
    disturb the grammar that enforces the calls."""
    prompt_len = len(smol.llm_engine.inputs.chat_plan(ASK, greedy(), TOOLS, "required").prompt_token_ids)
    blocks = -(-prompt_len // 16) + 3
    llm = LLM(str(embedded_dir), kv_cache_memory=blocks * 16 * 30 * 2 * 3 * 64 * 4, block_size=16)  # SmolLM2's KV
    try:
        params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=blocks * 16 - prompt_len)
        out = llm.chat(ASK, params, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)[0]
        assert llm.stats()["num_preemptions"] > 0
        assert len(out.outputs) == 3
        for c in out.outputs:
            check_calls(c.tool_calls)
        assert llm.stats()["num_free_blocks"] == llm.stats()["num_total_blocks"]
    finally:
        llm.shutdown()


def test_a_llama3_template_gets_llama3_calls(tmp_path, embedded_dir, tiny_random):
    model_dir = tmp_path / "llama3_tools"
    shutil.copytree(tiny_random.removeprefix("random:").rsplit("/", 1)[0], model_dir)
    (model_dir / "chat_template.jinja").write_text(LLAMA3_TEMPLATE)
    with LLM(f"random:{model_dir / 'config.json'}") as llm:
        assert llm.llm_engine.inputs.chat_template().tool_format == "llama3_json"
        plan = llm.llm_engine.inputs.chat_plan(ASK, greedy(), TOOLS, "required")
        assert "parameters" in plan.params.structured_outputs.json["items"]["anyOf"][0]["required"]
        out = llm.chat(ASK, greedy(max_tokens=150), tools=TOOLS, tool_choice="required",
                       parallel_tool_calls=False)[0].outputs[0]
        check_calls(out.tool_calls)


def test_required_calls_of_tools_with_definitions_follow_each_tools_schema(smol):
    """Tools from pydantic models (nested models under "$defs", an "Address" in two tools with two shapes):
    `required` compiles them into one grammar, and each call the model writes is valid against its own tool's
    schema, whether the tool is offered alone or beside the other. (The recursive tools are checked without
    the model in test_tool_calls.py: a greedy small model nests folders without end.)"""
    ask = [{"role": "user", "content": "Send a parcel to Ann, and add her to the contacts."}]
    tools = REF_TOOLS[:2]
    sampled = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=200)
    for offered, params in [([tools[0]], greedy()), ([tools[1]], greedy()), (tools, sampled)]:
        outs = smol.chat(ask, params, tools=offered, tool_choice="required", parallel_tool_calls=False)[0].outputs
        for out in outs:
            assert out.finish_reason == "stop" and len(out.tool_calls) == 1, out.text
            call = out.tool_calls[0]
            assert call.name in [t["function"]["name"] for t in offered]
            jsonschema.validate(json.loads(call.arguments), REF_PARAMETERS[call.name])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_replaces_the_response_format(smol, tool_choice):
    """A forced call writes no message text: the format asked beside it has nothing to shape, and the call's
    own constraint is the one the request runs under (OpenAI and vLLM accept the pair)."""
    formatted = greedy(max_tokens=150, structured_outputs={"json": {"type": "object", "properties": {
        "answer": {"type": "string"}}, "required": ["answer"]}})
    plan = smol.llm_engine.inputs.chat_plan(ASK, formatted, TOOLS, tool_choice)
    assert plan.params.structured_outputs == smol.llm_engine.inputs.chat_plan(ASK, greedy(max_tokens=150), TOOLS,
                                                                   tool_choice).params.structured_outputs
    out = smol.chat(ASK, formatted, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False)[0].outputs[0]
    check_calls(out.tool_calls)


@pytest.mark.parametrize("kwargs, message", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "no-such-type"}}}],
      "tool_choice": "required"}, "tools: the parameters schema of tool_choice='required' does not compile"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, r"messages\[0\].tool_calls: only assistant"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": "{not json"}}]}]}, r"messages\[1\].tool_calls\[0\].function.arguments is not valid"),
    ({"messages": [{"role": "user", "content": "hi", "tool_call_id": "x"}]}, r"messages\[0\].tool_call_id"),
    ({"messages": [{"role": "user", "content": "hi", "function_call": {}}]}, r"unknown fields \['function_call'\]"),
    ({"messages": [{"role": "assistant", "content": None}]}, r"messages\[0\].content must be a string"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls='yes'"),
])
def test_bad_tool_requests_are_refused_by_name(smol, kwargs, message):
    kwargs = {"messages": ASK, "params": greedy(), "tools": TOOLS, **kwargs}
    with pytest.raises(ValueError, match=message):
        smol.llm_engine.inputs.chat_plan(kwargs.pop("messages"), kwargs.pop("params"), **kwargs)


def test_auto_is_refused_where_the_format_is_unknown(smol, tokenizer):
    engine = smol.llm_engine.inputs
    saved = engine._template
    engine._template = template(tokenizer, OTHER_TEMPLATE)
    try:
        with pytest.raises(ValueError, match="tool_choice='auto'.*cannot parse"):
            engine.chat_plan(ASK, greedy(), TOOLS)
        plan = engine.chat_plan(ASK, greedy(), TOOLS, "required")  # the grammar does not need the format
        assert plan.tool_parsing.mode == "required"
    finally:
        engine._template = saved
