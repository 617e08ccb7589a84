"""A 200 "stop" answer under a JSON schema always satisfies it: what xgrammar's grammar cannot hold, and schemas
no value satisfies, are a 400 naming the request field; strings never carry raw control characters.

Which keywords xgrammar 0.2.8 enforces is measured here, not assumed: each row matches a violating and a valid
instance against the grammar built from the schema.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from marft_lg.constraints import (
    ConstraintError,
    check_constraint,
    constraint_for,
    grammar_ebnf,
    unsatisfiable,
    unsupported_keywords,
)
from marft_lg.serving.http.server import create_app
from marft_lg.serving.registry.lora import LoraSettings
from marft_lg.serving.team import Team

USER = [{"role": "user", "content": "Answer in JSON."}]
OBJ = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}

# (name, schema, an instance the schema forbids, one it allows)
DROPPED = [
    ("allOf", {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                         {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}]},
     {"a": 1}, {"a": 1, "b": "x"}),
    ("allOf beside", {**OBJ, "allOf": [{"required": ["a"]}]}, {}, {"a": 1}),
    ("anyOf beside", {**OBJ, "anyOf": [{"required": ["a"]}]}, {}, {"a": 1}),
    ("not", {"type": "integer", "not": {"const": 3}}, 3, 4),
    ("if", {**OBJ, "if": {"required": ["a"]}, "then": {"required": ["b"]}}, {"a": 1}, {"a": 1, "b": 2}),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 1], [1, 2]),
    ("contains", {"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}}, [1], [3]),
    ("dependentRequired", {**OBJ, "dependentRequired": {"a": ["b"]}}, {"a": 1}, {"a": 1, "b": 1}),
    ("dependentSchemas", {**OBJ, "dependentSchemas": {"a": {"required": ["b"]}}}, {"a": 1}, {"a": 1, "b": 1}),
    ("multipleOf", {"type": "number", "multipleOf": 0.5}, 0.3, 1.5),
    ("$ref beside", {"$defs": {"x": {"type": "integer"}}, "$ref": "#/$defs/x", "minimum": 5}, 1, 6),
]
HELD = [
    ("multipleOf", {"type": "integer", "multipleOf": 3}, 4, 3),
    ("minimum", {"type": "integer", "minimum": 3, "maximum": 9}, 10, 5),
    ("exclusiveMaximum", {"type": "number", "exclusiveMaximum": 2.5}, 2.5, 2.0),
    ("pattern", {"type": "string", "pattern": "^a+$"}, "b", "aa"),
    ("maxLength", {"type": "string", "minLength": 2, "maxLength": 3}, "abcd", "ab"),
    ("patternProperties", {"type": "object", "patternProperties": {"^x": {"type": "integer"}},
                           "additionalProperties": False}, {"y": 1}, {"x": 1}),
    ("minProperties", {**OBJ, "minProperties": 1}, {}, {"a": 1}),
    ("maxItems", {"type": "array", "items": {"type": "integer"}, "maxItems": 3}, [1, 2, 3, 4], [1, 2]),
    ("prefixItems", {"type": "array", "prefixItems": [{"type": "integer"}], "items": False}, [1, 2], [1]),
    ("unevaluatedProperties", {**OBJ, "unevaluatedProperties": False}, {"a": 1, "z": 1}, {"a": 1}),
    ("anyOf", {"anyOf": [{"type": "string"}, {"type": "integer"}]}, True, 1),
    ("$ref", {"$defs": {"x": {"type": "integer"}}, "$ref": "#/$defs/x"}, "s", 1),
    ("allOf of one", {"allOf": [{"type": "integer"}]}, "x", 1),
]
UNSATISFIABLE = [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]},  # strict: no other property
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"], "additionalProperties": False},
    {"$ref": "#"},
    {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}},
     "$ref": "#/$defs/n"},
]


def _accepts(schema: dict, instance: object) -> bool:
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True)
    return _is_grammar_accept_string(grammar, json.dumps(instance))


@pytest.mark.parametrize(("name", "schema", "bad", "good"), DROPPED, ids=[d[0] for d in DROPPED])
def test_keywords_the_grammar_drops_are_found(name, schema, bad, good):
    assert _accepts(schema, bad) and _accepts(schema, good)  # xgrammar really lets the violation through
    assert [k.split()[0] for _, k in unsupported_keywords(schema)][:1] == [name.split()[0]]
    with pytest.raises(ConstraintError) as e:
        check_constraint(constraint_for(response_format={"type": "json_schema", "json_schema": {"schema": schema}}))
    assert e.value.field == "response_format" and name.split()[0] in str(e.value)


@pytest.mark.parametrize(("name", "schema", "bad", "good"), HELD, ids=[h[0] for h in HELD])
def test_keywords_the_grammar_holds_pass(name, schema, bad, good):
    assert not _accepts(schema, bad) and _accepts(schema, good)
    assert unsupported_keywords(schema) == [] and unsatisfiable(schema) is None
    check_constraint(constraint_for(response_format={"type": "json_schema", "json_schema": {"schema": schema}}))


def test_nested_keywords_are_named_by_json_pointer():
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                        "uniqueItems": True}}}
    assert unsupported_keywords(schema) == [("/properties/tags", "uniqueItems")]


def test_unsatisfiable_schemas_are_found_and_a_recursion_with_a_way_out_is_not():
    assert all(unsatisfiable(s) for s in UNSATISFIABLE)
    assert "disjoint" in unsatisfiable({"allOf": [{"type": "string"}, {"type": "integer"}]})
    linked = {"$defs": {"n": {"type": "object", "required": ["next"], "properties": {
        "next": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}}}}, "$ref": "#/$defs/n"}
    assert unsatisfiable(linked) is None and unsupported_keywords(linked) == []


def test_json_strings_never_take_raw_control_characters():
    """xgrammar writes length-bounded strings with a character class that lets U+0000-U+001F through raw."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    for bounds in ({"maxLength": 8}, {"minLength": 1}, {"pattern": "^[\\s\\S]*$"}, {}):
        schema = {"type": "object", "properties": {"s": {"type": "string", **bounds}}, "required": ["s"]}
        grammar = xgr.Grammar.from_ebnf(grammar_ebnf({"type": "json_schema", "schema": schema}))
        assert _is_grammar_accept_string(grammar, '{"s": "a\u00e9b"}')
        for ch in ["\x00", "\x01", "\x1f", "\n", "\t"]:
            assert not _is_grammar_accept_string(grammar, '{"s": "a' + ch + 'b"}'), (bounds, ch)


# ---- through the server, on the tiny model -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(tiny_model_dir):
    torch.set_num_threads(1)
    with Team(tiny_model_dir, ["planner"], lora=LoraSettings(r=4), versions=None, model_name="tiny") as team, \
            TestClient(create_app(team)) as c:
        yield c


def _ask(client, schema: dict, **extra):
    return client.post("/v1/chat/completions", json={
        "model": "planner", "messages": USER, "max_tokens": 48,
        "response_format": {"type": "json_schema", "json_schema": {"name": "A", "schema": schema}}, **extra})


@pytest.mark.parametrize("schema", [DROPPED[0][1], DROPPED[3][1], *UNSATISFIABLE,
                                    {"allOf": [{"type": "string"}, {"type": "integer"}]}])
def test_the_server_refuses_what_the_grammar_cannot_hold_with_a_400_naming_response_format(client, schema):
    r = _ask(client, schema, seed=0)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "response_format" and "response_format" in r.json()["error"]["message"]


def test_forced_tool_arguments_name_the_tool_field(client):
    bad = {"type": "object", "properties": {"x": {"type": "integer", "not": {"const": 1}}}}
    tools = [{"type": "function", "function": {"name": "ok", "parameters": OBJ}},
             {"type": "function", "function": {"name": "bad", "parameters": bad}}]
    body = {"model": "planner", "messages": USER, "max_tokens": 8, "tools": tools}
    r = client.post("/v1/chat/completions", json={**body, "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[1]"
    r = client.post("/v1/chat/completions", json={**body, "tool_choice": {"type": "function", "function": {"name": "bad"}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "/properties/x" in r.json()["error"]["message"]


def test_decoded_strings_parse_for_every_seed(client):
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 24}}, "required": ["s"]}
    for seed in range(6):
        r = _ask(client, schema, seed=seed, temperature=1.5, max_tokens=64)
        assert r.status_code == 200
        choice = r.json()["choices"][0]
        if choice["finish_reason"] == "stop":
            value = json.loads(choice["message"]["content"])
            jsonschema.validate(value, schema)
            assert not any(ord(c) < 0x20 for c in choice["message"]["content"])


_leaf = st.one_of(
    st.just({"type": "string", "maxLength": 8}), st.just({"type": "integer"}), st.just({"type": "boolean"}),
    st.lists(st.sampled_from(["x", "y", "z", 1, 2]), min_size=1, max_size=3, unique=True).map(lambda e: {"enum": e}),
    st.just({"type": "array", "items": {"type": "integer"}, "maxItems": 2}),
    st.sampled_from([{"type": "integer", "not": {"const": 0}}, {"type": "array", "uniqueItems": True},
                     {"allOf": [{"type": "string"}, {"type": "integer"}]}]),
)


@st.composite
def _schemas(draw):
    names = draw(st.lists(st.sampled_from(["a", "b", "c", "d"]), min_size=1, max_size=3, unique=True))
    props = {n: draw(_leaf) for n in names}
    required = draw(st.lists(st.sampled_from([*names, "zz"]), max_size=3, unique=True))
    schema = {"type": "object", "properties": props, "required": required}
    if draw(st.booleans()):
        schema["additionalProperties"] = False
    return schema


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=_schemas(), seed=st.integers(0, 2**16))
def test_every_stop_answer_satisfies_its_schema_and_every_refusal_names_response_format(client, schema, seed):
    r = _ask(client, schema, seed=seed)
    if r.status_code == 400:
        assert r.json()["error"]["param"] == "response_format"
        return
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)


def test_a_recursive_ref_under_a_forced_tool_builds_and_each_tool_keeps_its_own_defs():
    import json

    import xgrammar as xgr

    from marft_lg.constraints import check_constraint, grammar_ebnf, tool_constraint
    from marft_lg.tool_calls import CLOSE, OPEN

    tree = {"type": "object", "properties": {"node": {"$ref": "#/$defs/Node"}}, "required": ["node"],
            "$defs": {"Node": {"type": "object", "required": ["name"], "properties": {
                "name": {"type": "string"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}}}}}}
    num = {"type": "object", "properties": {"n": {"$ref": "#/definitions/Node"}}, "required": ["n"],
           "definitions": {"Node": {"type": "integer"}}}  # the same name, another meaning
    constraint = tool_constraint([{"type": "function", "function": {"name": "tree", "parameters": tree}},
                                  {"type": "function", "function": {"name": "num", "parameters": num}}], "required")
    check_constraint(constraint)  # was: "Cannot find field $defs in #/$defs/Node"
    grammar = xgr.Grammar.from_ebnf(grammar_ebnf(constraint))

    def accepts(call: dict) -> bool:
        return xgr.testing._is_grammar_accept_string(grammar, OPEN + json.dumps(call) + CLOSE)

    assert accepts({"name": "tree", "arguments": {"node": {"name": "a", "kids": [{"name": "b"}]}}})
    assert accepts({"name": "num", "arguments": {"n": 3}})
    assert not accepts({"name": "num", "arguments": {"n": {"name": "x"}}})
    assert not accepts({"name": "tree", "arguments": {"node": 3}})
