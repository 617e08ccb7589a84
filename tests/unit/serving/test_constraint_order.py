"""A constraint is recorded and compiled exactly as the client sent it: a JSON schema's property order is part of
its grammar, so a schema re-sorted on the way would be another grammar than the one the engine decoded under."""

from __future__ import annotations

import json

from marft_lg.constraints import Grammars, check_constraint, constraint_hash, constraint_key, load_constraint

SCHEMA = {"type": "object", "properties": {"zeta": {"type": "string", "enum": ["x"]}, "alpha": {"type": "boolean"}},
          "required": ["zeta", "alpha"], "additionalProperties": False}
SENT = {"type": "json_schema", "name": "Extract", "schema": SCHEMA}


def test_the_key_keeps_the_order_and_the_hash_tells_orders_apart():
    text = constraint_key(SENT)
    assert list(load_constraint(text)["schema"]["properties"]) == ["zeta", "alpha"]
    resorted = json.loads(json.dumps(SENT, sort_keys=True))
    assert constraint_hash(SENT) == constraint_hash(text) != constraint_hash(resorted)
    check_constraint(SENT)


def test_each_order_compiles_its_own_grammar_and_the_wrong_one_names_the_rejected_token(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    g = Grammars(tok, len(tok), [tok.eos_token_id])
    ids = tok('{"zeta": "x", "alpha": true}', add_special_tokens=False)["input_ids"]
    resorted = load_constraint(json.dumps(SENT, sort_keys=True))  # a record written before the fix
    assert g.compiled(SENT) is not g.compiled(resorted)
    _, rejected = g.checked_bits(SENT, ids)
    assert rejected is None
    _, rejected = g.checked_bits(resorted, ids)
    assert rejected is not None and "z" in tok.decode(ids[: rejected + 1])[-5:]
