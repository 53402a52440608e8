"""Structured outputs on the real SmolLM2-135M-Instruct: JSON schemas, regexes, choices and grammars.

Every constrained output must parse (and validate) whatever the model would rather say, at
temperature 0 and 1; unconstrained rows in the same batches must keep exactly their solo
tokens. The engine is small and its KV cache tight, so the batches below also chunk prompts
and preempt requests.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from jaxengine import LLM, SamplingParams
from jaxengine.grammar import _no_additional_properties
from jaxengine.structured_outputs import GuidedDecodingParams, StructuredOutputsParams

S = StructuredOutputsParams

# 39 tokens of KV per request would fit 16 at once; these prompts and outputs need more, so
# the corpus batches preempt.
ENGINE_KW = dict(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=64, num_kv_blocks=40, block_size=16)

NAME = {"type": "string", "minLength": 1, "maxLength": 20}
SCHEMAS: list[tuple[str, dict]] = [
    ("a person", {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0,
                                                                         "maximum": 120}},
                  "required": ["name", "age"], "additionalProperties": False}),
    ("a boolean flag", {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}),
    ("a colour", {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
                  "required": ["colour"]}),
    ("a number between 0 and 1", {"type": "object", "properties": {"p": {"type": "number", "minimum": 0,
                                                                          "maximum": 1}}, "required": ["p"]}),
    ("a list of fruits", {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1,
                          "maxItems": 4}),
    ("three integers", {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50},
                        "minItems": 3, "maxItems": 3}),
    ("a city and its country", {"type": "object", "properties": {"city": NAME, "country": NAME},
                                "required": ["city", "country"], "additionalProperties": False}),
    ("a book", {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 30}, "year": {"type": "integer", "minimum": 1450, "maximum": 2030},
        "author": {"type": "object", "properties": {"first": NAME, "last": NAME}, "required": ["first", "last"],
                   "additionalProperties": False}},
        "required": ["title", "year", "author"], "additionalProperties": False}),
    ("a US zip code", {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                       "required": ["zip"]}),
    ("a date", {"type": "object", "properties": {"date": {"type": "string",
                                                          "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
                "required": ["date"]}),
    ("a status", {"type": "string", "enum": ["active", "inactive", "pending"]}),
    ("a constant", {"type": "object", "properties": {"version": {"const": 2}}, "required": ["version"]}),
    ("an integer or null", {"type": "object", "properties": {"x": {"anyOf": [{"type": "integer", "minimum": 0,
                                                                                "maximum": 9},
                                                                               {"type": "null"}]}},
                            "required": ["x"]}),
    ("tags", {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                        "maxItems": 3}},
              "required": ["tags"]}),
    ("a point", {"type": "object", "properties": {"x": {"type": "integer", "minimum": -100, "maximum": 100},
                                                  "y": {"type": "integer", "minimum": -100, "maximum": 100}},
                 "required": ["x", "y"], "additionalProperties": False}),
    ("a rating", {"type": "integer", "minimum": 1, "maximum": 5}),
    ("a short word", {"type": "string", "pattern": "^[a-z]{1,8}$"}),
    ("an order", {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "items": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                                             "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"], "additionalProperties": False}}},
        "required": ["id", "items"], "additionalProperties": False}),
    ("a user with an optional email", {"type": "object", "properties": {
        "user": NAME, "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}},
        "required": ["user"], "additionalProperties": False}),
    ("a temperature reading", {"type": "object", "properties": {
        "celsius": {"type": "number", "minimum": -90, "maximum": 60}, "unit": {"const": "C"}},
        "required": ["celsius", "unit"]}),
    ("a key-value map of counts", {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0,
                                                                              "maximum": 999},
                                   "maxProperties": 3}),
    ("a matrix", {"type": "array", "maxItems": 2, "minItems": 1, "items": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}),
    ("a yes/no answer with a reason", {"type": "object", "properties": {
        "answer": {"enum": ["yes", "no"]}, "reason": {"type": "string", "maxLength": 40}},
        "required": ["answer", "reason"], "additionalProperties": False}),
    ("a shape", {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "integer", "minimum": 1,
                                                                             "maximum": 9}},
         "required": ["kind", "r"], "additionalProperties": False},
        {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1,
                                                                                "maximum": 9}},
         "required": ["kind", "side"], "additionalProperties": False}]}),
    ("a tree node", {"$defs": {"leaf": {"type": "object", "properties": {"value": {"type": "integer",
                                                                                    "minimum": 0, "maximum": 9}},
                                        "required": ["value"], "additionalProperties": False}},
                     "type": "object", "properties": {"left": {"$ref": "#/$defs/leaf"},
                                                      "right": {"$ref": "#/$defs/leaf"}},
                     "required": ["left", "right"], "additionalProperties": False}),
    ("an HTTP status", {"type": "object", "properties": {"code": {"enum": [200, 404, 500]}, "ok": {"type": "boolean"}},
                        "required": ["code", "ok"]}),
    ("a hex colour", {"type": "string", "pattern": "^#[0-9a-f]{6}$"}),
    ("a pair", {"type": "array", "prefixItems": [NAME, {"type": "integer", "minimum": 0, "maximum": 99}],
                "items": False, "minItems": 2}),
    ("a price", {"type": "object", "properties": {"amount": {"type": "number", "minimum": 0, "maximum": 1000},
                                                  "currency": {"enum": ["USD", "EUR"]}},
                 "required": ["amount", "currency"], "additionalProperties": False}),
    ("a nested config", {"type": "object", "properties": {"server": {"type": "object", "properties": {
        "host": {"type": "string", "pattern": "^[a-z]{1,10}$"}, "port": {"type": "integer", "minimum": 1,
                                                                        "maximum": 65535}},
        "required": ["host", "port"], "additionalProperties": False},
        "debug": {"type": "boolean"}}, "required": ["server", "debug"], "additionalProperties": False}),
    ("a percentage", {"type": "object", "properties": {"pct": {"type": "integer", "minimum": 0, "maximum": 100,
                                                               "multipleOf": 5}}, "required": ["pct"]}),
    ("a list of people", {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["name", "age"], "additionalProperties": False}}),
]


# Objects that do not say otherwise admit no extra keys: under JSON schema's default (any extra
# key allowed) a small model can write keys forever, and the output is cut off by max_tokens.
SCHEMAS = [(what, _no_additional_properties(schema)) for what, schema in SCHEMAS]


def _prompt(what: str) -> str:
    return (f"<|im_start|>user\nReply with JSON only: {what}.<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def llm(xla_cache_dir) -> LLM:
    return LLM(compilation_cache_dir=xla_cache_dir, **ENGINE_KW)


def _valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_parse_and_validate(llm, temperature):
    assert len(SCHEMAS) >= 30
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=200, structured_outputs=S(json=schema))
              for i, (_, schema) in enumerate(SCHEMAS)]
    outs = llm.generate([_prompt(what) for what, _ in SCHEMAS], params)
    bad = [(what, o.outputs[0].text, o.outputs[0].finish_reason) for (what, schema), o in zip(SCHEMAS, outs)
           if not (_valid(o.outputs[0].text, schema) and o.outputs[0].finish_reason == "stop")]
    assert not bad, bad


def test_preempted_constrained_requests_resume_their_grammar(llm):
    """16 long prompts outgrow the cache together: requests are preempted and recomputed, and
    each still gives the output it gives in a small batch."""
    filler = " Points are pairs of coordinates on a plane, and they are written as x and y."
    cases = [(_prompt(what + filler * 3), schema) for what, schema in SCHEMAS[:16]]
    params = [SamplingParams(temperature=0, max_tokens=120, structured_outputs=S(json=schema)) for _, schema in cases]
    preempted = llm.llm_engine.scheduler.num_preemptions
    crowded = [o.outputs[0].text for o in llm.generate([p for p, _ in cases], params)]
    assert llm.llm_engine.scheduler.num_preemptions > preempted
    calm = []
    for i in range(0, len(cases), 4):
        calm += [o.outputs[0].text for o in llm.generate([p for p, _ in cases[i:i + 4]], params[i:i + 4])]
    assert crowded == calm
    assert all(_valid(t, schema) for t, (_, schema) in zip(crowded, cases))


def test_regex_choice_and_grammars(llm):
    regexes = [r"[0-9]{3}-[0-9]{4}", r"(yes|no)", r"[A-Z][a-z]{2,8}", r"[a-z]+@[a-z]+\.(com|org)", r"-?[0-9]{1,3}"]
    lark = 'start: "(" num ("," num)* ")"\nnum: /[0-9]{1,2}/'
    gbnf = 'root ::= term (("+" | "-") term){0,3}\nterm ::= [0-9] | [0-9] [0-9]'
    prompts = ["A phone number:", "Is the sky blue?", "A name:", "An email address:", "A number:",
               "Pick a fruit:", "A tuple of numbers:", "An arithmetic expression:"]
    constraints = [S(regex=r) for r in regexes] + [S(choice=["apple", "banana", "cherry pie"]), S(grammar=lark),
                                                    GuidedDecodingParams(grammar=gbnf)]
    for temperature in (0.0, 1.0):
        outs = llm.generate(prompts, [SamplingParams(temperature=temperature, seed=3, max_tokens=40,
                                                     structured_outputs=c) for c in constraints])
        texts = [o.outputs[0].text for o in outs]
        for r, t in zip(regexes, texts):
            assert re.fullmatch(r, t), (r, t)
        assert texts[5] in ("apple", "banana", "cherry pie")
        assert re.fullmatch(r"\([0-9]{1,2}(,[0-9]{1,2})*\)", texts[6]), texts[6]
        assert re.fullmatch(r"[0-9]{1,2}([+-][0-9]{1,2}){0,3}", texts[7]), texts[7]
        unfinished = [(t, o.outputs[0].finish_reason) for t, o in zip(texts, outs) if o.outputs[0].finish_reason != "stop"]
        assert not unfinished, unfinished


def test_free_rows_keep_their_solo_tokens_in_a_mixed_batch(llm):
    free = SamplingParams(temperature=0, max_tokens=24)
    prompts = ["The capital of France is", _prompt("a person"), "def fibonacci(n):", _prompt("a colour")]
    schema_p, schema_c = SCHEMAS[0][1], SCHEMAS[2][1]
    params = [free, SamplingParams(temperature=0, max_tokens=100, structured_outputs=S(json=schema_p)),
              SamplingParams(temperature=0.8, seed=7, max_tokens=24),
              SamplingParams(temperature=0, max_tokens=100, structured_outputs=S(json=schema_c))]
    mixed = [o.outputs[0].text for o in llm.generate(prompts, params)]
    solo = [llm.generate([p], [sp])[0].outputs[0].text for p, sp in zip(prompts, params)]
    assert mixed == solo
    assert _valid(mixed[1], schema_p) and _valid(mixed[3], schema_c)


def test_n_stop_strings_max_tokens_and_raw_logprobs(llm):
    schema = SCHEMAS[0][1]
    [out] = llm.generate([_prompt("a person")], SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=200,
                                                               structured_outputs=S(json=schema)))
    assert len(out.outputs) == 3 and all(_valid(c.text, schema) for c in out.outputs)
    # a stop string inside the constrained output trims it there, as for free text
    [out] = llm.generate([_prompt("a person")], SamplingParams(temperature=0, max_tokens=200, stop=['"age"'],
                                                               structured_outputs=S(json=schema)))
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == '"age"'
    assert out.outputs[0].text.startswith('{"name":') and '"age"' not in out.outputs[0].text
    # cut off by max_tokens: "length", and the output is a prefix of the unconstrained-length one
    [cut] = llm.generate([_prompt("a person")], SamplingParams(temperature=0, max_tokens=4,
                                                               structured_outputs=S(json=schema)))
    assert cut.outputs[0].finish_reason == "length" and len(cut.outputs[0].token_ids) == 4
    # logprobs are the model's raw ones, before the mask: the first token's top logprobs equal an
    # unconstrained request's
    prompt = "Is the sky blue? Answer:"
    [a] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=5,
                                                structured_outputs=S(choice=["zebra"])))
    [b] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=5))
    tok = a.outputs[0].token_ids[0]
    assert llm.get_tokenizer().decode([tok]).strip() in "zebra"
    top_a = {t: lp.logprob for t, lp in a.outputs[0].logprobs[0].items() if lp.rank <= 5}
    top_b = {t: lp.logprob for t, lp in b.outputs[0].logprobs[0].items() if lp.rank <= 5}
    assert top_a == pytest.approx(top_b, abs=1e-5)
    assert a.outputs[0].logprobs[0][tok].logprob < max(top_b.values())


def test_prefix_cache_and_chunked_prefill_with_constraints(llm):
    schema = SCHEMAS[6][1]
    long_prompt = _prompt("a city and its country. " + "Cities are places where many people live. " * 30)
    params = SamplingParams(temperature=0, max_tokens=100, structured_outputs=S(json=schema))
    assert len(llm.get_tokenizer().encode(long_prompt)) > ENGINE_KW["max_num_batched_tokens"]  # chunked
    [first] = llm.generate([long_prompt], params)
    [second] = llm.generate([long_prompt], params)
    assert second.num_cached_tokens > 0
    assert first.outputs[0].text == second.outputs[0].text and _valid(first.outputs[0].text, schema)


def test_invalid_constraints_are_value_errors_and_lose_no_work(llm):
    for bad, field in ((S(regex="a("), "regex"), (S(json={"type": "nonsense"}), "json"),
                       (S(grammar="start: undefined_rule"), "grammar")):
        with pytest.raises(ValueError, match=f"structured_outputs.{field}"):
            llm.generate(["x"], SamplingParams(max_tokens=2, structured_outputs=bad))
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_outputs=S(regex="a", choice=["b"]))
    with pytest.raises(ValueError, match="not both"):
        SamplingParams(structured_outputs=S(regex="a"), guided_decoding=GuidedDecodingParams(regex="b"))
    [ok] = llm.generate(["A number:"], SamplingParams(temperature=0, max_tokens=8, structured_outputs=S(regex="[0-9]{3}")))
    assert re.fullmatch("[0-9]{3}", ok.outputs[0].text)


def test_a_rejected_token_fails_its_request_alone(llm):
    engine = llm.llm_engine
    engine.add_request("bad", "A number:", SamplingParams(temperature=0, max_tokens=8,
                                                          structured_outputs=S(regex="[0-9]{3}")))
    engine.add_request("good", "A number:", SamplingParams(temperature=0, max_tokens=8,
                                                           structured_outputs=S(regex="[0-9]{3}")))

    # The matcher is put in its error state (a letter where the regex wants a digit), as a
    # grammar backend failure would leave it: its next token is rejected.
    matcher = engine.scheduler.get_request("bad").grammar
    assert not matcher.consume_token(llm.get_tokenizer().encode("x", add_special_tokens=False)[0])
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["bad"].outputs[0].finish_reason == "error"
    assert "structured outputs: the grammar rejected token" in engine.request_errors.pop("bad")
    assert finals["good"].outputs[0].finish_reason == "stop"
    assert re.fullmatch("[0-9]{3}", finals["good"].outputs[0].text)
