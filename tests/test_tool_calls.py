"""Tool calls parsed from text (no model): each format, the content around calls, and that a stream's deltas
joined are exactly the whole text's parse, however the text is cut."""

from __future__ import annotations

import json

import jsonschema
import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.chat.tool_calls import (
    Tool,
    ToolCallStream,
    ToolChoice,
    ToolParsing,
    parse_tool_choice,
    parse_tools,
    plan,
    split,
)

HERMES = ToolParsing("auto", "hermes")
LLAMA = ToolParsing("auto", "llama3_json")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def hermes_call(name: str, args: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def test_hermes_content_and_calls():
    text = "Let me look.\n" + hermes_call("get_weather", {"city": "Paris"}) + "\n" + hermes_call("f", {})
    assert split(HERMES, text, True) == ("Let me look.", [("get_weather", '{"city": "Paris"}'), ("f", "{}")])
    assert split(HERMES, "just words\n", True) == ("just words\n", [])
    # an answer cut before its closing tag still counts once it is final
    assert split(HERMES, '<tool_call>\n{"name": "f", "arguments": {"a": 1}}', True) == ("", [("f", '{"a": 1}')])
    # what does not parse as a call stays text, tags and all
    bad = "<tool_call>\nnot json\n</tool_call>"
    assert split(HERMES, "Hi " + bad, True) == ("Hi " + bad, [])


def test_hermes_holds_back_what_may_open_a_call():
    assert split(HERMES, "Sure <tool_c", False) == ("Sure", [])
    assert split(HERMES, "Sure <tool_call>\n{\"name\": ", False) == ("Sure", [])
    assert split(HERMES, "a < b", False) == ("a < b", [])


def test_llama3_json():
    one = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    assert split(LLAMA, one, True) == ("", [("get_weather", '{"city": "Oslo"}')])
    assert split(LLAMA, "<|python_tag|>" + one + "; " + one, True)[1] == [("get_weather", '{"city": "Oslo"}')] * 2
    assert split(LLAMA, one[:20], False) == ("", [])  # still being written
    assert split(LLAMA, "It is sunny.", True) == ("It is sunny.", [])
    assert split(LLAMA, '{"answer": 42}', True) == ('{"answer": 42}', [])  # JSON, but not a call


def test_required_array_and_named_function():
    required = ToolParsing("required", "hermes")
    text = '[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]'
    assert split(required, text, True) == ("", [("a", '{"x": 1}'), ("b", "{}")])
    assert split(required, text[:40], False) == ("", [("a", '{"x": 1}')])  # each call once complete
    assert split(ToolParsing("required", "hermes", max_calls=1), text, True)[1] == [("a", '{"x": 1}')]
    assert split(required, '[{"name": "a", "argu', True) == ('[{"name": "a", "argu', [])  # cut: shown as is
    named = ToolParsing("function", function="get_weather")
    assert split(named, '{"city": "Pa', False) == ("", [])  # taken once whole, as each required call
    assert split(named, '{"city": "Paris"}', False) == ("", [("get_weather", '{"city": "Paris"}')])
    assert split(named, '{"city": "Pa', True) == ('{"city": "Pa', [])  # cut short (max_tokens): no half call


def test_stream_deltas_and_finish_reason():
    stream = ToolCallStream(HERMES)
    text = "Ok. " + hermes_call("get_weather", {"city": "Rome"})
    content, deltas = stream.update(text[:10], final=False)
    assert content == "Ok." and deltas == []
    content, deltas = stream.update(text, final=True)
    assert content == "" and len(deltas) == 1
    assert (deltas[0].index, deltas[0].name, deltas[0].arguments) == (0, "get_weather", '{"city": "Rome"}')
    assert deltas[0].id.startswith("call_") and stream.finish_reason("stop") == "tool_calls"
    assert stream.finish_reason("length") == "length"
    named = ToolCallStream(ToolParsing("function", function="f"))
    named.update("{}", True)
    assert named.finish_reason("stop") == "stop"  # OpenAI's: a forced call ends as "stop"


def _piece():
    word = st.text(alphabet="ab <>{}\"\n;_:tool", max_size=8)
    call = st.builds(lambda n, v: hermes_call(n, {"v": v}), st.sampled_from(["f", "g_1"]), st.integers(-5, 5))
    llama = st.builds(lambda n: json.dumps({"name": n, "parameters": {"q": n}}), st.sampled_from(["f", "h"]))
    return st.one_of(word, call, llama, st.sampled_from(["\n", "  ", "; ", "<tool_call>", "</tool_call>",
                                                          "<tool_call>\n{\"name\": \"f\""]))


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(_piece(), max_size=6), cuts=st.lists(st.integers(0, 200), max_size=8),
       parsing=st.sampled_from([HERMES, LLAMA, ToolParsing("required", "hermes"),
                                ToolParsing("auto", "hermes", max_calls=1)]))
def test_streamed_deltas_join_to_the_whole_parse(pieces, cuts, parsing):
    text = "".join(pieces)
    whole_content, whole_calls = split(parsing, text, True)
    stream = ToolCallStream(parsing)
    content, calls = "", []
    for end in sorted({min(c, len(text)) for c in cuts}) + [None]:
        new, deltas = stream.update(text if end is None else text[:end], final=end is None)
        content += new
        for d in deltas:
            if d.index == len(calls):
                assert d.name is not None and d.id is not None
                calls.append([d.name, d.arguments])
            else:
                calls[d.index][1] += d.arguments
    assert content == whole_content
    assert [tuple(c) for c in calls] == whole_calls


@settings(max_examples=100, deadline=None)
@given(arguments=st.dictionaries(st.text(max_size=4), st.one_of(st.integers(), st.text(max_size=6)), max_size=3),
       cuts=st.lists(st.integers(0, 80), max_size=6), cut_short=st.integers(0, 80))
def test_a_named_call_streams_once_whole_and_never_half(arguments, cuts, cut_short):
    """What the grammar writes for a named function: a JSON object, then nothing; the call is taken whole,
    and a text cut short before its end (max_tokens) is content, never a call."""
    text = json.dumps(arguments)
    written = text[:cut_short] if cut_short < len(text) else text
    stream = ToolCallStream(ToolParsing("function", function="f"))
    content, calls = "", []
    for end in sorted({min(c, len(written)) for c in cuts}) + [None]:
        new, deltas = stream.update(written if end is None else written[:end], final=end is None)
        content += new
        calls += [(d.name, d.arguments) for d in deltas]
    assert (content, calls) == (("", [("f", text)]) if written == text else (written, []))


def test_tools_and_tool_choice_are_checked_by_name():
    tools = parse_tools([WEATHER])
    assert tools == [Tool("get_weather", WEATHER["function"]["parameters"], "Weather now")]
    assert parse_tools([{"type": "function", "function": {"name": "noop"}}])[0].parameters["type"] == "object"
    cases = [
        ([{"type": "retrieval"}], "tools[0] must be"),
        ([{"type": "function", "function": {"name": "has space"}}], "tools[0].function.name='has space'"),
        ([WEATHER, WEATHER], "tools[1].function.name='get_weather' is given twice"),
        ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], "tools[0].function.parameters"),
        ([{"type": "function", "function": {"name": "f", "strict": True, "examples": []}}], "function.examples"),
        ("get_weather", "tools must be a list"),
    ]
    for value, message in cases:
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            parse_tools(value)
    assert parse_tool_choice(None, tools) == ToolChoice("auto")
    assert parse_tool_choice(None, []) == ToolChoice("none")
    assert parse_tool_choice({"type": "function", "function": {"name": "get_weather"}}, tools) == \
        ToolChoice("function", "get_weather")
    for value, message in [("always", "tool_choice='always' must be one of"), ("required", None),
                           ({"type": "function", "function": {"name": "nope"}}, "not among tools")]:
        if message is None:
            with pytest.raises(ValueError, match="needs tools"):
                parse_tool_choice(value, [])
            continue
        with pytest.raises(ValueError, match=message):
            parse_tool_choice(value, tools)


def test_required_schema_accepts_calls_and_only_calls():
    tools = parse_tools([WEATHER, {"type": "function", "function": {"name": "noop"}}])
    constraint, parsing = plan(tools, ToolChoice("required"), None, "hermes")
    schema = constraint.json
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Lima"}}, {"name": "noop", "arguments": {}}],
                        schema)
    for wrong in ([], [{"name": "get_weather", "arguments": {}}], [{"name": "other", "arguments": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    single, _ = plan(tools, ToolChoice("required"), False, "llama3_json")
    assert single.json["maxItems"] == 1 and "parameters" in single.json["items"]["anyOf"][0]["required"]
    with pytest.raises(ValueError, match="format pagedserve cannot parse"):
        plan(tools, ToolChoice("auto"), None, None)
    assert plan(tools, ToolChoice("none"), None, "hermes") == (None, None)


# Tools whose parameters refer to their own definitions, as pydantic writes them: nested models under "$defs",
# two tools each with an "Address" of its own shape, a recursive model, and a schema recursive through "#".
class Address(pydantic.BaseModel):
    street: str = pydantic.Field(max_length=20)
    city: str = pydantic.Field(max_length=12)


class Contact(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    home: Address


def _parcel() -> type[pydantic.BaseModel]:
    class Address(pydantic.BaseModel):  # noqa: F811 - the same name, another shape, in the other tool
        zip: str = pydantic.Field(pattern=r"^[0-9]{5}$")

    class Parcel(pydantic.BaseModel):
        to: Address
        grams: int = pydantic.Field(ge=1, le=5000)

    return Parcel


class Folder(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    children: list[Folder] = pydantic.Field(max_length=2)


TREE = {"type": "object", "properties": {"label": {"type": "string", "maxLength": 8},
                                         "kids": {"type": "array", "maxItems": 2, "items": {"$ref": "#"}}},
        "required": ["label", "kids"], "additionalProperties": False}


def function_tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


REF_TOOLS = [function_tool("add_contact", Contact.model_json_schema()),
             function_tool("send_parcel", _parcel().model_json_schema()),
             function_tool("make_folder", Folder.model_json_schema()), function_tool("tree", TREE)]
REF_PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in REF_TOOLS}


def xgrammar_takes(schema: dict, text: str) -> bool:
    """Whether the schema's grammar, as the engine compiles it, takes `text` whole (no vocabulary needed)."""
    import xgrammar as xgr

    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo(["a"])).compile_json_schema(json.dumps(schema),
                                                                                 any_whitespace=False)
    matcher = xgr.GrammarMatcher(compiled)
    return matcher.accept_string(text) and matcher.is_completed()


def test_required_keeps_each_tools_definitions_apart():
    """Local references resolve within their own tool once the tools share one schema: the two Addresses
    stay two, and recursion through "$defs" or "#" still recurses."""
    assert REF_PARAMETERS["add_contact"]["$defs"]["Address"] != REF_PARAMETERS["send_parcel"]["$defs"]["Address"]
    schema = plan(parse_tools(REF_TOOLS), ToolChoice("required"), None, "hermes")[0].json
    args = {"add_contact": [{"name": "Ann", "home": {"street": "Main St", "city": "Oslo"}}],
            "send_parcel": [{"to": {"zip": "01234"}, "grams": 300}],
            "make_folder": [{"name": "a", "children": [{"name": "b", "children": []}]}],
            "tree": [{"label": "a", "kids": [{"label": "b", "kids": [{"label": "c", "kids": []}]}]}]}
    wrong = {"add_contact": [{"name": "Ann", "home": {"zip": "01234"}}],  # the other tool's Address
             "send_parcel": [{"to": {"street": "Main St", "city": "Oslo"}, "grams": 300}],
             "make_folder": [{"name": "a", "children": [{"name": "b"}]}],
             "tree": [{"label": "a", "kids": [{"label": "b"}]}]}
    for cases, good in ((args, True), (wrong, False)):
        for name, values in cases.items():
            for value in values:
                text = json.dumps([{"name": name, "arguments": value}])
                assert jsonschema.Draft202012Validator(REF_PARAMETERS[name]).is_valid(value) is good
                assert jsonschema.Draft202012Validator(schema).is_valid(json.loads(text)) is good, text
                assert xgrammar_takes(schema, text) is good, text


def test_required_rewrites_only_local_references():
    parameters = {"type": "object", "$defs": {"N": {"type": "integer"}}, "properties": {
        "enum": {"$ref": "#/$defs/N"},  # a property named like a keyword is still a schema
        "x": {"$ref": "#/$defs/N", "default": {"$ref": "#/data"}, "enum": [{"$ref": "#"}]},  # data is data
        "y": {"$ref": "#anchor"}, "z": {"$ref": "other.json#/$defs/N"}}}  # not paths from this root
    plain = {"type": "object", "properties": {"a": {"type": "string"}}}
    tools = parse_tools([function_tool("f", parameters), function_tool("g", plain)])
    schema = plan(tools, ToolChoice("required"), None, "llama3_json")[0].json
    f, g = (call["properties"]["parameters"] for call in schema["items"]["anyOf"])
    assert f == {"$ref": "#/$defs/f"} and g == plain  # parameters without references stay in place
    props = schema["$defs"]["f"]["properties"]
    assert props["enum"] == {"$ref": "#/$defs/f/$defs/N"}
    assert props["x"] == {"$ref": "#/$defs/f/$defs/N", "default": {"$ref": "#/data"}, "enum": [{"$ref": "#"}]}
    assert props["y"] == {"$ref": "#anchor"} and props["z"] == {"$ref": "other.json#/$defs/N"}
    assert set(schema["$defs"]) == {"f"}
