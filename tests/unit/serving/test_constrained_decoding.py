"""Constrained decoding in the embedded engine and through every client: forced tool calls and JSON formats hold.

The tiny model has random weights, so whatever it writes without a grammar is noise: every valid answer below
comes from the grammar, not from the model. One batch mixes constrained and free rows on two adapters.
"""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import pytest
import torch
from fastapi.testclient import TestClient
from langchain_core.messages import AIMessageChunk
from pydantic import BaseModel

from marft_lg.constraints import (
    ConstraintError,
    Grammars,
    constraint_for,
    forced_tool,
    grammar_ebnf,
    label,
    load_constraint,
    vllm_fields,
)
from marft_lg.graph import TeamChatModel
from marft_lg.serving.http.server import create_app
from marft_lg.serving.registry.lora import LoraSettings
from marft_lg.serving.team import Team
from marft_lg.serving.types import ChatRequest
from marft_lg.tool_calls import parse_completion, render_messages

ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
HANDOFF = {"type": "function", "function": {"name": "transfer_to_writer", "description": "Hand over to the writer.",
                                            "parameters": {"type": "object", "properties": {}}}}
VERDICT = {"type": "object", "properties": {"accept": {"type": "boolean"}, "label": {"enum": ["good", "bad"]},
                                            "score": {"type": "integer"}},
           "required": ["accept", "label", "score"]}
USER = [{"role": "user", "content": "Add 2 and 3."}]


class Verdict(BaseModel):
    accept: bool
    label: Literal["good", "bad"]
    score: int


@pytest.fixture(scope="module")
def team(tiny_model_dir):
    torch.set_num_threads(1)
    with Team(tiny_model_dir, ["planner", "writer"], lora=LoraSettings(r=4), versions=None, model_name="tiny") as t:
        yield t


@pytest.fixture(scope="module")
def client(team):
    with TestClient(create_app(team)) as c:
        yield c


# ---- requests -> constraints -> grammars (no model) --------------------------------------------------------
def test_constraint_for_reads_tool_choice_response_format_and_structured_outputs():
    assert constraint_for([ADD], "auto") is None and constraint_for([ADD], None) is None
    assert constraint_for(None, "required") is None  # nothing to force without tools
    req = constraint_for([ADD, HANDOFF], "required")
    assert req["type"] == "tool_calls" and req["choice"] == "required" and not req["parallel"]  # one call
    assert constraint_for([ADD, HANDOFF], "required", parallel_tool_calls=True)["parallel"]  # several: asked for
    assert [t["name"] for t in req["tools"]] == ["add", "transfer_to_writer"]
    named = constraint_for([ADD, HANDOFF], {"type": "function", "function": {"name": "transfer_to_writer"}})
    assert named["choice"] == "transfer_to_writer" and [t["name"] for t in named["tools"]] == ["transfer_to_writer"]
    assert named["tools"][0]["parameters"] == {"type": "object", "properties": {}}
    assert constraint_for([ADD], "any", parallel_tool_calls=False)["parallel"] is False
    assert constraint_for(response_format={"type": "json_object"}) == {"type": "json_object"}
    assert constraint_for(response_format={"type": "json_mode"}) == {"type": "json_object"}  # LangChain's name
    js = constraint_for(response_format={"type": "json_schema", "json_schema": {"name": "V", "schema": VERDICT}})
    assert js == {"type": "json_schema", "name": "V", "schema": VERDICT}
    assert constraint_for(response_format={"type": "text"}) is None
    assert constraint_for(structured_outputs={"grammar": 'root ::= "x"'}) == {"type": "grammar", "ebnf": 'root ::= "x"'}
    assert constraint_for(structured_outputs={"json": json.dumps(VERDICT)})["schema"] == VERDICT
    # a forced call wins over a response format, as OpenAI orders them
    assert constraint_for([ADD], "required", response_format={"type": "json_object"})["type"] == "tool_calls"
    assert forced_tool(named) == "transfer_to_writer" and forced_tool(req) is None and forced_tool(js) is None
    assert label(named) == "tool_choice=transfer_to_writer" and label(js) == "json_schema=V"
    assert load_constraint(json.dumps(js)) == js and load_constraint("not json") is None and load_constraint(None) is None


@pytest.mark.parametrize("bad, field", [
    ({"type": "xml"}, "response_format"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format"),
    ("json", "response_format"),
])
def test_bad_response_formats_name_the_field(bad, field):
    with pytest.raises(ConstraintError) as err:
        constraint_for(response_format=bad)
    assert err.value.field == field


def test_unsupported_structured_outputs_are_refused():
    with pytest.raises(ConstraintError, match="regex"):
        constraint_for(structured_outputs={"regex": "a+"})


def test_grammar_accepts_the_tool_call_format_and_rejects_free_text(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    g = Grammars(tok, len(tok), [tok.eos_token_id])
    c = constraint_for([ADD, HANDOFF], "required", parallel_tool_calls=True)
    assert '"<tool_call>"' in grammar_ebnf(c)

    def accepts(text: str) -> bool:
        m = g.matcher(c)
        return all(m.accept(t) for t in tok.encode(text)) and m.accept(tok.eos_token_id) and m.done

    good = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    two = good + '\n<tool_call>{"name": "transfer_to_writer", "arguments": {}}</tool_call>'
    assert accepts(good) and accepts(two)
    assert not accepts("The answer is 5.")
    assert not accepts('<tool_call>{"name": "mul", "arguments": {"a": 2, "b": 3}}</tool_call>')  # unknown tool
    assert not accepts('<tool_call>{"name": "add", "arguments": {"a": "2", "b": 3}}</tool_call>')  # schema
    three = two + "\n" + good  # at most one call per tool: a small model cannot loop on calls
    assert not accepts(three)
    single = constraint_for([ADD, HANDOFF], "required")
    m = g.matcher(single)
    assert all(m.accept(t) for t in tok.encode(good)) and not m.accept(tok.encode("\n")[0])


def test_allowed_bits_hold_the_recorded_tokens_and_free_the_rest_after_a_rejected_token(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    g = Grammars(tok, len(tok), [tok.eos_token_id])
    c = constraint_for(response_format={"type": "json_schema", "json_schema": {"name": "V", "schema": VERDICT}})
    ids = tok.encode('{"accept": true, "label": "good", "score": 7}') + [tok.eos_token_id]
    allowed = g.allowed(c, ids)
    assert allowed.shape == (len(ids), len(tok))
    assert all(bool(allowed[t, i]) for t, i in enumerate(ids))
    assert int(allowed[0].sum()) < 5 and int(allowed[-1].sum()) == 1  # '{' first; only the stop token at the end
    noise = tok.encode('{"accept": maybe}') + [tok.eos_token_id]  # not decoded under this grammar (re-tokenised)
    free = g.allowed(c, noise)
    rejected = next(t for t in range(len(noise)) if bool(free[t].all()))
    assert 0 < rejected < len(noise) - 1 and bool(free[rejected:].all())  # from the rejected token on: free
    assert all(int(free[t].sum()) < len(tok) for t in range(rejected))


# ---- the embedded engine ------------------------------------------------------------------------------------
def _request(constraint=None, tools=None, choice=None, **kw):
    return ChatRequest(messages=render_messages(USER, tools, choice), max_tokens=kw.pop("max_tokens", 96),
                       temperature=kw.pop("temperature", 1.0), constraint=constraint, **kw)


def test_one_batch_mixes_constrained_and_free_rows_on_two_adapters(team):
    required = constraint_for([ADD, HANDOFF], "required")
    named = constraint_for([ADD, HANDOFF], {"type": "function", "function": {"name": "add"}})
    schema = constraint_for(response_format={"type": "json_schema", "json_schema": {"name": "V", "schema": VERDICT}})
    obj = constraint_for(response_format={"type": "json_object"})
    reqs = []
    for seed in range(3):
        reqs += [
            _request(required, [ADD, HANDOFF], "required", agent="planner", seed=seed, max_tokens=256),
            _request(named, [ADD, HANDOFF], "add", agent="writer", seed=seed),
            _request(schema, agent="planner", seed=seed),
            _request(obj, agent="writer", seed=seed, max_tokens=12),
            _request(None, agent="planner", seed=seed, max_tokens=12),
            _request(None, agent="writer", seed=seed, max_tokens=12),
        ]
    outs = team.chat(reqs)
    before = team.engine.stats["constrained_tokens"]
    assert before > 0
    for k in range(3):
        req_out, named_out, schema_out, obj_out, free_a, free_b = outs[6 * k: 6 * k + 6]
        parsed = parse_completion(req_out.text, ["add", "transfer_to_writer"])
        assert parsed.tool_calls and not parsed.invalid_tool_calls and req_out.finish_reason == "stop", req_out.text
        one = parse_completion(named_out.text, ["add", "transfer_to_writer"])
        assert [c["name"] for c in one.tool_calls] == ["add"] and not one.invalid_tool_calls, named_out.text
        jsonschema.validate(one.tool_calls[0]["args"], ADD["function"]["parameters"])
        jsonschema.validate(json.loads(schema_out.text), VERDICT)
        assert obj_out.text.startswith("{")  # may be cut by max_tokens, but it is an object from the first token
        for c in (req_out, named_out, schema_out, obj_out):
            assert c.extra.get("logprobs_masked") is True
            assert all(lp <= 0 and lp > float("-inf") for lp in c.logprobs)
        for c in (free_a, free_b):
            assert "logprobs_masked" not in c.extra
    # a seeded constrained row samples the same tokens alone as in the mixed batch
    again = team.chat([reqs[0]])[0]
    assert again.completion_token_ids == outs[0].completion_token_ids


def test_a_grammar_forces_what_the_free_model_would_not_write(team):
    free = team.chat([_request(None, [ADD], "auto", agent="planner", seed=s, max_tokens=24) for s in range(4)])
    assert not any(parse_completion(c.text, ["add"]).tool_calls for c in free)  # random weights write noise
    forced = team.chat([_request(constraint_for([ADD], "required"), [ADD], "required", agent="planner", seed=s)
                        for s in range(4)])
    assert all(parse_completion(c.text, ["add"]).tool_calls for c in forced)


def test_a_bad_schema_is_refused_before_anything_is_queued(team):
    bad = {"type": "json_schema", "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}
    with pytest.raises(ConstraintError):
        team.chat([_request(bad, agent="planner")])


# ---- the OpenAI server ------------------------------------------------------------------------------------
def _post(client, **body):
    r = client.post("/v1/chat/completions", json={"model": "planner", "messages": USER, "max_tokens": 256,
                                                  "logprobs": True, "seed": 1, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_server_tool_choice_required_and_named_come_back_as_tool_calls(client):
    for choice, names in (("required", {"add", "transfer_to_writer"}),
                          ({"type": "function", "function": {"name": "transfer_to_writer"}}, {"transfer_to_writer"})):
        for seed in range(3):
            out = _post(client, tools=[ADD, HANDOFF], tool_choice=choice, seed=seed)
            choice0 = out["choices"][0]
            calls = choice0["message"].get("tool_calls") or []
            assert calls and {c["function"]["name"] for c in calls} <= names, choice0["message"]
            assert choice0["finish_reason"] == "tool_calls" and not choice0["message"].get("invalid_tool_calls")
            assert out["marft"]["logprobs_masked"] is True


def test_server_response_format_json_schema_and_streaming(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "Verdict", "schema": VERDICT, "strict": True}}
    for seed in range(3):
        out = _post(client, response_format=fmt, seed=seed)
        jsonschema.validate(json.loads(out["choices"][0]["message"]["content"]), VERDICT)
    body = {"model": "planner", "messages": USER, "max_tokens": 96, "seed": 4, "stream": True, "response_format": fmt}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                       for line in r.iter_lines() if line.startswith("data: {") and '"choices": [{' in line)
    jsonschema.validate(json.loads(text), VERDICT)


def test_server_structured_outputs_grammar_as_vllm_takes_it(client):
    out = _post(client, structured_outputs={"grammar": 'root ::= "yes" | "no"'})
    assert out["choices"][0]["message"]["content"] in ("yes", "no")
    fields = vllm_fields(constraint_for([ADD], "required"))
    out = _post(client, **fields)
    assert parse_completion(out["choices"][0]["message"]["content"], ["add"]).tool_calls


@pytest.mark.parametrize("body, field", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/no"}}}},
     "response_format"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "structured_outputs"),
])
def test_server_bad_formats_are_400_naming_the_field(client, body, field):
    r = client.post("/v1/chat/completions", json={"model": "planner", "messages": USER, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert field in r.text


# ---- TeamChatModel ------------------------------------------------------------------------------------------
def test_team_chat_model_forced_tools_and_structured_output(team):
    from langchain_core.tools import tool

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    for seed in range(3):
        llm = TeamChatModel(team=team, agent="planner", max_tokens=96, seed=seed)
        msg = llm.bind_tools([add], tool_choice="any").invoke("Add 2 and 3.")
        assert [c["name"] for c in msg.tool_calls] == ["add"] and not msg.invalid_tool_calls, msg.content
        assert msg.response_metadata["marft"]["constraint"]["choice"] == "required"
        assert msg.response_metadata["marft"]["logprobs"] is not None  # masked by the engine: usable as behaviour
        for method in ("json_schema", "function_calling"):
            out = llm.with_structured_output(Verdict, method=method).invoke("Judge: 2 + 3 = 5.")
            assert isinstance(out, Verdict), (method, out)
        chunks = list(llm.bind_tools([add], tool_choice="add").stream("Add 2 and 3."))
        full = chunks[0]
        for c in chunks[1:]:
            full = full + c
        assert isinstance(full, AIMessageChunk) and [c["name"] for c in full.tool_calls] == ["add"]


# ---- langchain_openai.ChatOpenAI against the server ----------------------------------------------------------
def test_chat_openai_with_structured_output_returns_the_model(http_url):
    from langchain_openai import ChatOpenAI

    for seed in range(3):
        llm = ChatOpenAI(base_url=http_url, api_key="none", model="planner", max_retries=0, seed=seed, max_tokens=96)
        for method in ("json_schema", "function_calling"):
            out = llm.with_structured_output(Verdict, method=method).invoke("Judge: 2 + 3 = 5. Answer in JSON.")
            assert isinstance(out, Verdict), (method, out)
        streamed = list(llm.with_structured_output(Verdict, method="json_schema").stream("Judge: 2 + 3 = 5."))
        assert streamed and isinstance(streamed[-1], Verdict)
        forced = llm.bind_tools([ADD], tool_choice="required").invoke("Add 2 and 3.")
        assert [c["name"] for c in forced.tool_calls] == ["add"]
