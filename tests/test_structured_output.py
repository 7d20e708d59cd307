"""Structured outputs in the engine, with the embedded model: every constraint kind gives output that
matches it, mixed into batches with unconstrained requests that stay token for token what they are alone,
under n > 1 and preemption; constraints that cannot compile are refused by name."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import jsonschema
import pytest

from pagedserve import LLM, SamplingParams, structured_output
from pagedserve.sampling_params import StructuredOutputs
from pagedserve.structured_output import GrammarManager

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
    prompts = [smol.engine.chat_prompt(ASK)] * (len(SCHEMAS) + 2)
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
    prompt = smol.engine.chat_prompt(ASK)
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
    engine = smol.engine
    schema = SCHEMAS[0]
    request = engine.make_request(engine.chat_prompt(ASK), constrained(StructuredOutputs(json=schema)))
    assert request.grammar is not None
    grammars = engine.grammars()
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
    engine = smol.engine
    grammars = GrammarManager(engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids)
    compiles = []
    compile_json = grammars._compiler.compile_json_schema

    def counted(schema, **kw):
        compiles.append(schema)
        return compile_json(schema, **kw)

    grammars._compiler = SimpleNamespace(compile_json_schema=counted)
    first, second, third = (StructuredOutputs(json=s) for s in SCHEMAS)
    s1, s2, s3 = (grammars.compile(c).memory_size_bytes + len(c.key()[1]) for c in (first, second, third))
    assert len(compiles) == 3 and grammars._compiled_bytes == s1 + s2 + s3
    bound = max(s1 + s2, s1 + s3)  # room for first and either other, not for all three
    monkeypatch.setattr(structured_output, "_CACHE_BYTES", bound)
    empty_cache(grammars)
    for c in (first, second, first, third):  # first used again before third comes: second is dropped
        grammars.compile(c)
    assert len(compiles) == 6 and grammars._compiled_bytes == s1 + s3
    grammars.compile(first)
    grammars.compile(third)
    assert len(compiles) == 6  # both still cached
    grammars.compile(second)
    assert len(compiles) == 7  # compiled again
    monkeypatch.setattr(structured_output, "_CACHE_BYTES", s1 - 1)
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
        room = blocks * 16 - len(llm.engine.chat_prompt(ASK))
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
