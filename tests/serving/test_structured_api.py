"""Structured outputs through the OpenAI routes (the official client's `parse`, `response_format`, vLLM's
`structured_outputs` and `guided_*`) and gRPC, on the embedded SmolLM2 ("smol" application)."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pydantic
import pytest

from tests.serving.app import GRPC, HTTP
from tests.test_structured_output import SQL_LARK, SQL_TEXT

ASK = [{"role": "user", "content": "Describe a person as JSON."}]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=16)
    age: int = pydantic.Field(ge=0, le=120)
    languages: list[str] = pydantic.Field(max_length=3)


@pytest.fixture(scope="module")
def oai(app):
    return openai.OpenAI(base_url=f"{HTTP}/smol/v1", api_key="unused", max_retries=0)


def test_parse_returns_a_parsed_object(oai):
    done = oai.chat.completions.parse(model="", messages=ASK, response_format=Person, temperature=0, max_tokens=120)
    person = done.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 120
    assert done.choices[0].finish_reason == "stop"


def test_response_format_json_object_and_schema_streamed_and_unary_agree(oai):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0}},
              "required": ["city", "population"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}
    kw = dict(model="", messages=[{"role": "user", "content": "A city as JSON."}], temperature=0, max_tokens=100,
              response_format=fmt)
    unary = oai.chat.completions.create(**kw).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(**kw, stream=True)
                       if c.choices)
    assert unary == streamed
    jsonschema.validate(json.loads(unary), schema)
    obj = oai.chat.completions.create(model="", messages=[{"role": "user", "content": 'Give {"a": 1} as JSON.'}],
                                      temperature=0, max_tokens=60, response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_vllm_extras_regex_choice_grammar_on_both_routes(oai):
    out = oai.chat.completions.create(model="", messages=ASK, max_tokens=20,
                                      extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert out.choices[0].message.content in ("yes", "no")
    out = oai.completions.create(model="", prompt="Phone:", max_tokens=20,
                                 extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", out.choices[0].text)
    out = oai.completions.create(model="", prompt="A tuple:", max_tokens=30,
                                 extra_body={"structured_outputs": {"grammar": 'root ::= "(" [a-z]+ ")"'}})
    assert re.fullmatch(r"\([a-z]+\)", out.choices[0].text)


def test_a_lark_grammar_constrains_a_completion(oai):
    """vLLM's SQL grammar in Lark syntax (its OpenAI tests' `sample_sql_lark`), in `structured_outputs` and in
    the older `guided_grammar`; Lark that cannot be converted is a 400 naming the field and the construct."""
    for extra in ({"structured_outputs": {"grammar": SQL_LARK}}, {"guided_grammar": SQL_LARK}):
        out = oai.completions.create(model="", prompt="A SQL query:", max_tokens=40, temperature=0.8, seed=3,
                                     extra_body=extra).choices[0]
        assert re.fullmatch(SQL_TEXT, out.text) and out.finish_reason == "stop", out.text
    with pytest.raises(openai.BadRequestError, match=r"guided_grammar \(Lark syntax\), line 2: .*lookahead"):
        oai.completions.create(model="", prompt="x", max_tokens=5,
                               extra_body={"guided_grammar": "start: A\nA: /a(?=b)/"})


def test_bad_constraints_are_400_naming_the_field(oai):
    with pytest.raises(openai.BadRequestError, match="response_format"):
        oai.chat.completions.create(model="", messages=ASK, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": "many"}}})
    with pytest.raises(openai.BadRequestError, match="guided_regex"):
        oai.completions.create(model="", prompt="x", max_tokens=5, extra_body={"guided_regex": "("})
    with pytest.raises(openai.BadRequestError, match="give one output constraint"):
        oai.completions.create(model="", prompt="x", max_tokens=5,
                               extra_body={"guided_regex": "a", "guided_choice": ["b"]})


def test_grpc_and_sdk_take_the_same_constraint(app):
    from pagedserve.client import Client, InvalidArgument

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    with Client(GRPC, application="smol", timeout=120) as c:
        out = c.chat(ASK, temperature=0, max_tokens=40, structured_outputs={"json": schema})
        jsonschema.validate(json.loads(out.text), schema)
        assert out.finish_reason == "stop"
        assert c.generate("Pick:", max_tokens=10, structured_outputs={"choice": ["left", "right"]}).text in (
            "left", "right")
        with pytest.raises(InvalidArgument) as info:
            c.generate("x", structured_outputs={"regex": "("})
        assert info.value.field_violations[0][0] == "structured_outputs.regex"
