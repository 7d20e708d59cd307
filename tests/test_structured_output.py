"""Structured outputs in the engine, with the embedded model: every constraint kind gives output that
matches it, mixed into batches with unconstrained requests that stay token for token what they are alone,
under n > 1 and preemption; constraints that cannot compile are refused by name."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import jsonschema
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.sampling_params import StructuredOutputs
from pagedserve.structured_output import grammars as grammars_module
from pagedserve.structured_output.grammars import GrammarManager
from pagedserve.structured_output.lark_grammar import looks_like_lark

ASK = [{"role": "user", "content": "Describe a person as JSON."}]
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                               "minItems": 1, "maxItems": 3},
                                      "score": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["tags", "score"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["name", "zip"], "additionalProperties": False},
        "ok": {"type": "boolean"}}, "required": ["city", "ok"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def smol(embedded_dir):
    llm = LLM(str(embedded_dir))
    yield llm
    llm.shutdown()


def constrained(so: StructuredOutputs, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.8, "seed": 7, "max_tokens": 120, **kw}, structured_outputs=so)


def test_json_schemas_mixed_with_unconstrained_requests(smol):
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [smol.llm_engine.inputs.chat_prompt(ASK)] * (len(SCHEMAS) + 2)
    alone = smol.generate(prompts[:2], [plain, plain])
    params = [plain, plain] + [constrained(StructuredOutputs(json=s)) for s in SCHEMAS]
    mixed = smol.generate(prompts, params)
    for a, m in zip(alone, mixed[:2], strict=True):
        assert a.outputs[0].token_ids == m.outputs[0].token_ids  # the neighbours' masks touch nothing else
    for schema, out in zip(SCHEMAS, mixed[2:], strict=True):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    assert smol.stats()["num_free_blocks"] == smol.stats()["num_total_blocks"]


def assorted_schema(i: int) -> dict:
    """One of many bounded schemas: nested objects, arrays, enums, numbers with bounds (bounded strings and
    arrays, so that a finished answer is always reachable within max_tokens)."""
    word = {"type": "string", "maxLength": 8 + i % 5}
    number = {"type": "number", "minimum": -i, "maximum": 10 + i}
    integer = {"type": "integer", "minimum": i % 3, "maximum": 100 + i}
    enum = {"enum": [f"v{j}" for j in range(1 + i % 4)]}
    array = {"type": "array", "items": [word, integer, enum][i % 3], "minItems": i % 2, "maxItems": 1 + i % 3}
    inner = {"type": "object", "properties": {"x": number, "flag": {"type": "boolean"}},
             "required": ["x", "flag"] if i % 2 else ["x"], "additionalProperties": False}
    fields = [("name", word), ("count", integer), ("kind", enum), ("items", array), ("inner", inner),
              ("score", number)]
    chosen = [fields[(i + k) % len(fields)] for k in range(2 + i % 4)]
    return {"type": "object", "properties": dict(chosen), "required": [name for name, _ in chosen],
            "additionalProperties": False}


def test_fifty_assorted_schemas_in_one_batch(smol):
    schemas = [assorted_schema(i) for i in range(50)]
    prompt = smol.llm_engine.inputs.chat_prompt(ASK)
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    params = [constrained(StructuredOutputs(json=s), seed=i, max_tokens=160) for i, s in enumerate(schemas)]
    outs = smol.generate([prompt] * 52, [plain] + params + [plain])
    alone = smol.generate([prompt], plain)[0].outputs[0].token_ids
    assert outs[0].outputs[0].token_ids == outs[-1].outputs[0].token_ids == alone
    for schema, out in zip(schemas, outs[1:-1], strict=True):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), schema)


def test_choice_regex_grammar_and_json_object(smol):
    out = smol.chat(ASK, constrained(StructuredOutputs(choice=["alpha", "beta", "gamma"])))[0].outputs[0]
    assert out.text in ("alpha", "beta", "gamma") and out.finish_reason == "stop"
    out = smol.generate("Phone:", constrained(StructuredOutputs(regex=r"[0-9]{3}-[0-9]{4}")))[0].outputs[0]
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", out.text) and out.finish_reason == "stop"
    grammar = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-z]+'
    out = smol.generate("A tuple:", constrained(StructuredOutputs(grammar=grammar), max_tokens=40))[0].outputs[0]
    assert re.fullmatch(r"\([a-z]+(,[a-z]+)*\)", out.text), out.text
    ask = [{"role": "user", "content": 'Give a JSON object with one key "a" whose value is 1.'}]
    out = smol.chat(ask, constrained(StructuredOutputs(json_object=True), temperature=0))[0].outputs[0]
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict)


def test_no_step_compiles_a_grammar(smol):
    """A request's grammar is compiled when it is made (on the served engine's preparing thread) and kept with
    it: its steps never compile, even when a burst of other schemas has pushed it out of the compile cache
    meanwhile (a compile on the step loop would hold every running stream)."""
    engine = smol.llm_engine
    schema = SCHEMAS[0]
    request = engine.inputs.make_request(engine.inputs.chat_prompt(ASK), constrained(StructuredOutputs(json=schema)))
    assert request.grammar is not None
    grammars = engine.grammars
    compile_ = grammars.compile
    empty_cache(grammars)  # as if a burst of other schemas had filled the cache since

    def no_compile(constraint):
        raise AssertionError("a step compiled a grammar")

    grammars.compile = no_compile
    try:
        engine.enqueue(request)
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        grammars.compile = compile_
    out = engine.output(request).outputs[0]
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), schema)


def empty_cache(grammars: GrammarManager) -> None:
    grammars._compiled.clear()
    grammars._compiled_bytes = 0


def test_compiled_grammars_are_cached_within_a_byte_bound(smol, monkeypatch):
    """The compile cache is bounded by the grammars' size, not their count: past the bound the least recently
    used are dropped (and compiled again when asked for), and one larger than the bound is not kept."""
    engine = smol.llm_engine.inputs
    grammars = GrammarManager(engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids)
    compiles = []
    grammars._make_compiler()
    compile_json = grammars._compiler.compile_json_schema

    def counted(schema, **kw):
        compiles.append(schema)
        return compile_json(schema, **kw)

    grammars._compiler = SimpleNamespace(compile_json_schema=counted)
    first, second, third = (StructuredOutputs(json=s) for s in SCHEMAS)
    s1, s2, s3 = (grammars.compile(c).memory_size_bytes + len(c.key()[1]) for c in (first, second, third))
    assert len(compiles) == 3 and grammars._compiled_bytes == s1 + s2 + s3
    bound = max(s1 + s2, s1 + s3)  # room for first and either other, not for all three
    monkeypatch.setattr(grammars_module, "_CACHE_BYTES", bound)
    empty_cache(grammars)
    for c in (first, second, first, third):  # first used again before third comes: second is dropped
        grammars.compile(c)
    assert len(compiles) == 6 and grammars._compiled_bytes == s1 + s3
    grammars.compile(first)
    grammars.compile(third)
    assert len(compiles) == 6  # both still cached
    grammars.compile(second)
    assert len(compiles) == 7  # compiled again
    monkeypatch.setattr(grammars_module, "_CACHE_BYTES", s1 - 1)
    empty_cache(grammars)
    grammars.compile(first)
    grammars.compile(first)
    assert len(compiles) == 9 and grammars._compiled_bytes == 0  # larger than the bound: never kept


def test_n_samples_under_preemption_stay_valid(embedded_dir):
    """A pool of 5 blocks for 3 samples of a 36-token prompt: preemption by recompute must not disturb the
    grammar state."""
    blocks = 5
    llm = LLM(str(embedded_dir), kv_cache_memory=blocks * 16 * 30 * 2 * 3 * 64 * 4, block_size=16)  # SmolLM2's KV
    try:
        room = blocks * 16 - len(llm.llm_engine.inputs.chat_prompt(ASK))
        outs = llm.chat(ASK, constrained(StructuredOutputs(json=SCHEMAS[0]), n=3, max_tokens=room))[0].outputs
        assert len(outs) == 3
        for out in outs:
            jsonschema.validate(json.loads(out.text), SCHEMAS[0])
        assert llm.stats()["num_preemptions"] > 0
        assert llm.stats()["num_free_blocks"] == llm.stats()["num_total_blocks"]
    finally:
        llm.shutdown()


def test_bad_constraints_are_refused_by_name(smol):
    with pytest.raises(ValueError, match="structured_outputs.regex does not compile"):
        smol.generate("x", SamplingParams(structured_outputs=StructuredOutputs(regex="(")))
    with pytest.raises(ValueError, match="structured_outputs.grammar does not compile"):
        smol.generate("x", SamplingParams(structured_outputs=StructuredOutputs(grammar="root ::= undefined_rule")))
    with pytest.raises(ValueError, match="structured_outputs.json does not compile"):
        smol.generate("x", SamplingParams(structured_outputs=StructuredOutputs(json="{not json")))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs()
    with pytest.raises(ValueError, match="unknown keys"):
        SamplingParams(structured_outputs={"jsonschema": {}})
    assert smol.stats()["num_free_blocks"] == smol.stats()["num_total_blocks"]


# vLLM's OpenAI tests' SQL grammar (`sample_sql_lark`, `sample_sql_ebnf`): one language in Lark and in EBNF.
SQL_LARK = """
start: select_statement
select_statement: "SELECT" column "from" table "where" condition
column: "col_1" | "col_2"
table: "table_1" | "table_2"
condition: column "=" number
number: "1" | "2"
"""
SQL_EBNF = """
root ::= select_statement
select_statement ::= "SELECT" column "from" table "where" condition
column ::= "col_1" | "col_2"
table ::= "table_1" | "table_2"
condition ::= column "=" number
number ::= "1" | "2"
"""
SQL_TEXT = r"SELECTcol_[12]fromtable_[12]wherecol_[12]=[12]"
# Lark with what a conversion must get right: modifiers, aliases, a multi-line rule with comments, a regex
# terminal, common terminals, case-insensitive strings, repetition counts, and whitespace ignored between tokens.
SETTINGS_LARK = r"""
// settings, as name = value pairs
start: setting ("," setting)~0..2
setting: NAME "=" value
?value: NUMBER          -> number
      | "yes"i | "no"i  // either case
      | ESCAPED_STRING
NAME: /[a-z_][a-z0-9_]{0,7}/
NUMBER: /[0-9]{1,3}/
%import common (ESCAPED_STRING, WS_INLINE)
%ignore WS_INLINE
"""
_PAIR = r'[ \t]*[a-z_][a-z0-9_]{0,7}[ \t]*=[ \t]*([0-9]{1,3}|[yY][eE][sS]|[nN][oO]|"([^"\\\n]|\\.)*")[ \t]*'
SETTINGS_TEXT = rf"{_PAIR}(,{_PAIR}){{0,2}}"


def test_lark_grammar_constrains_as_its_ebnf_twin(smol):
    """vLLM's SQL grammar in Lark gives the same masks as its EBNF twin, hence the same draws."""
    prompt = smol.llm_engine.inputs.chat_prompt([{"role": "user", "content": "Write a SQL query."}])
    lark, ebnf = (smol.generate(prompt, constrained(StructuredOutputs(grammar=g), n=2, max_tokens=40))[0].outputs
                  for g in (SQL_LARK, SQL_EBNF))
    for a, b in zip(lark, ebnf, strict=True):
        assert re.fullmatch(SQL_TEXT, a.text) and a.finish_reason == "stop", a.text
        assert a.token_ids == b.token_ids


def test_lark_grammar_with_ignored_whitespace_constrains_generation(smol):
    ask = [{"role": "user", "content": "Give two settings as name = value pairs, separated by a comma."}]
    outs = smol.chat(ask, constrained(StructuredOutputs(grammar=SETTINGS_LARK), n=3, max_tokens=80))[0].outputs
    for out in outs:
        assert re.fullmatch(SETTINGS_TEXT, out.text) and out.finish_reason == "stop", out.text


def lark_accepts(grammars: GrammarManager, grammar: str, text: str) -> bool:
    """Whether the compiled grammar takes `text` whole."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(grammars.compile(StructuredOutputs(grammar=grammar)))
    return matcher.accept_string(text) and matcher.is_completed()


# (grammar, texts Lark takes, texts it refuses), as Lark's own parser (Earley) answers them.
LARK_CASES = [
    (SQL_LARK, ["SELECTcol_1fromtable_2wherecol_2=1"], ["SELECT col_1 from table_2 where col_2=1", "SELECT"]),
    (SETTINGS_LARK, [' a = 1 ,b=YES,c="x\\"y" ', "x=nO"], ["a=1,b=2,c=3,d=4", 'a="x"y"', "A=1", "a=1234"]),
    ('start: "a" "b"\n%ignore " "\n%ignore /\\t+/', ["ab", " a \t b ", "\ta  b\t"], ["a_b", " "]),
    ('start: "a"~2..3 "b"~2 C\nC: "c".."e"', ["aabbd", "aaabbe"], ["abbc", "aaaabbc", "aabbf"]),
    ('start: A B\nA: /\\d+/\nB: /[^\\W\\d]+/', ["٣4é", "1x"], ["1", "12", "x1"]),  # Unicode classes, as `re`
    ('start: /./ /./s', ["a\n", "ab"], ["\na", "\n\n"]),
    ('start: "\\x41\\"\\\\" "\\d"', ['A"\\\\d'], ['A"\\d']),  # Lark's escapes; \d in a string is a backslash, d
    ("start: C_COMMENT\n%import common.C_COMMENT", ["/* a * / **/"], ["/* a */ b */", "/* a"]),
    ("start: SIGNED_NUMBER\n%import common.SIGNED_NUMBER", ["-1.5e3", "+.5", "7."], ["1e", "."]),
    ('?start: root | other\n!root.2: "r"  # a rule named root\nother: "o"\n  | start start', ["r", "rro"], ["", "x"]),
]


@pytest.mark.parametrize("grammar, taken, refused", LARK_CASES)
def test_lark_conversion_takes_what_lark_takes(smol, grammar, taken, refused):
    grammars = smol.llm_engine.grammars
    for text in taken:
        assert lark_accepts(grammars, grammar, text), text
    for text in refused:
        assert not lark_accepts(grammars, grammar, text), text


@pytest.mark.parametrize("grammar, construct", [
    ('start: NAME\nNAME: /[a-z]+(?=;)/', r"/\[a-z\]\+\(\?=;\)/ in NAME uses lookahead"),
    ('start: /^a/', "anchors"),
    ('start: /(a)\\1/', "backreferences"),
    ('start: /ab/i', "case-insensitive"),
    ('start: _list{"a"}\n_list{x}: x ("," x)*', "templates are not supported"),
    ('_list{x}: x ("," x)*\nstart: _list{"a"}', "templates are not supported"),
    ('%declare INDENT\nstart: "a" INDENT', "%declare is not supported"),
    ('start: NAME\n%import python.NAME', "only terminals of Lark's common module"),
    ('start: X\n%import common.X', "common.X is not supported"),
    ('start: value\n', "value is used in start but never defined"),
])
def test_lark_that_cannot_be_converted_is_refused_by_name(smol, grammar, construct):
    with pytest.raises(ValueError, match=r"structured_outputs\.grammar \(Lark syntax\), line \d+: .*" + construct):
        smol.generate("x", SamplingParams(structured_outputs=StructuredOutputs(grammar=grammar)))
    assert smol.stats()["num_free_blocks"] == smol.stats()["num_total_blocks"]


def test_ebnf_is_not_read_as_lark(smol):
    """An EBNF grammar compiles as written, even with what Lark also uses: `:` in strings, `#` comments."""
    grammar = '# pairs\nroot ::= pair ("," pair){0,2}\npair ::= [a-z]{1,6} ":" [0-9]{1,3}  # key: value'
    assert not looks_like_lark(grammar) and looks_like_lark(SQL_LARK) and looks_like_lark("%ignore WS\n")
    out = smol.generate("Pairs:", constrained(StructuredOutputs(grammar=grammar), max_tokens=40))[0].outputs[0]
    assert re.fullmatch(r"[a-z]{1,6}:[0-9]{1,3}(,[a-z]{1,6}:[0-9]{1,3}){0,2}", out.text), out.text
    assert out.finish_reason == "stop"
    with pytest.raises(ValueError, match="structured_outputs.grammar does not compile"):
        smol.generate("x", SamplingParams(structured_outputs=StructuredOutputs(grammar="root ::= x:")))
