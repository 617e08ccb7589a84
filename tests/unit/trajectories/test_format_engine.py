"""The format engine: a format declared as data is recognised and read; the pick and landing rules mean what they
say; a bad declaration fails when it is made; spans whose attributes have any type never crash mining."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest

from marft_lg.trajectories.formats import FORMATS, interpret
from marft_lg.trajectories.formats.base import LLM, OTHER, TOOL, as_int
from marft_lg.trajectories.formats.engine import SPAN_NAME, Attr, Derive, Format, Kind, Member, as_name
from marft_lg.trajectories.mining import mine, mine_to_parquet
from marft_lg.trajectories.raw_span import RawSpan

SAMPLES = Path(__file__).resolve().parents[3] / "traces" / "samples"


def _raw(attrs, name="span", parent="00f067aa0ba902b7"):
    return RawSpan("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331", parent, name, 1, 2, attrs, source="f:1")


# A made-up emitter: `acme.kind` says llm/tool, the agent sits in a JSON document `acme.ctx`.
ACME = Format(
    "acme",
    detect=lambda a: "acme.kind" in a,
    context=lambda a: json.loads(a.get("acme.ctx") or "{}"),
    kind=Kind("acme.kind", {"llm": LLM, "tool": TOOL}),
    fields=(Attr("agent", Member("who"), as_name), Attr("step", ("acme.step", "acme.turn"), as_int, pick="present")),
    by_kind={LLM: (Derive(("completion",), lambda info, a, ctx: (str(a.get("acme.out", "")).upper(),)),),
             TOOL: (Attr("tool_name", ("acme.tool", SPAN_NAME)),)},
)


def test_a_declared_format_is_recognised_and_read():
    info = interpret(_raw({"acme.kind": "llm", "acme.ctx": '{"who": "planner"}', "acme.turn": "3", "acme.out": "hi"}),
                     (ACME, *FORMATS))
    assert (info.fmt, info.kind, info.agent, info.step, info.completion) == ("acme", LLM, "planner", 3, "HI")
    tool = interpret(_raw({"acme.kind": "tool"}, name="lookup"), (ACME,))
    assert (tool.kind, tool.tool_name) == (TOOL, "lookup")
    assert interpret(_raw({"other": 1}), (ACME,)).kind == OTHER
    assert "def interpret(raw):" in ACME.source  # what runs per span can be read


@pytest.mark.parametrize(("pick", "attrs", "expected"), [
    ("or", {"a": "", "b": "x"}, "x"), ("or", {"a": "", "b": ""}, ""), ("or", {"a": "y", "b": "x"}, "y"),
    ("present", {"a": "", "b": "x"}, ""), ("present", {"b": "x"}, "x"), ("present", {}, None),
    ("not_none", {"a": None, "b": "x"}, "x"), ("not_none", {"a": "", "b": "x"}, ""),
])
def test_pick_rules(pick, attrs, expected):
    fmt = Format("t", detect=lambda a: True, kind=Kind("k", {}), fields=(Attr("agent", ("a", "b"), pick=pick),))
    assert fmt.interpret(_raw(attrs)).agent == expected


def test_landing_rules_keep_or_replace_earlier_values():
    fmt = Format("t", detect=lambda a: True, kind=Kind("k", {"llm": LLM}),
                 fields=(Attr("agent", "role"), Attr("completion", "text")),
                 by_kind={LLM: (Attr("agent", ("name", SPAN_NAME), mode="fill"),
                                Attr("completion", "better", mode="replace"))})
    info = fmt.interpret(_raw({"k": "llm", "role": "critic", "name": "other", "text": "a"}, name="span"))
    assert (info.agent, info.completion) == ("critic", "a")
    info = fmt.interpret(_raw({"k": "llm", "text": "a", "better": "b"}, name="span"))
    assert (info.agent, info.completion) == ("span", "b")


def test_a_declaration_naming_no_field_fails_when_made():
    with pytest.raises(ValueError, match="no field 'agnet'"):
        Attr("agnet", "x")
    with pytest.raises(ValueError, match="no field 'mesages'"):
        Derive(("mesages",), lambda info, a, ctx: (None,))


@pytest.mark.parametrize("op", [["chat"], {"op": "chat"}, 3, None])
def test_an_operation_name_of_another_type_names_no_kind(op):
    info = interpret(_raw({"gen_ai.operation.name": op, "gen_ai.agent.name": ["a"]}))
    assert (info.fmt, info.kind) == ("genai", OTHER)


VALUES = [{"stringValue": ""}, {"stringValue": "x"}, {"intValue": "3"}, {"intValue": 0}, {"doubleValue": 1.5},
          {"boolValue": True}, {"boolValue": False}, {"arrayValue": {"values": [{"stringValue": "a"}, {"intValue": "2"}]}},
          {"kvlistValue": {"values": [{"key": "k", "value": {"stringValue": "v"}}]}}, {"stringValue": "[1, 2]"},
          {"stringValue": '{"a": 1}'}, {"stringValue": "null"}, {"stringValue": "('a', 'b')"},
          {"stringValue": '[{"role": "user", "parts": [{"type": "text", "content": 5}]}]'},
          {"stringValue": '{"langgraph_node": 5, "langgraph_step": "2", "langgraph_checkpoint_ns": ["a"]}'},
          {"stringValue": '[{"role": "assistant", "parts": [{"type": "tool_call", "name": 3, "arguments": [1]}]}]'}]


def _damaged(seed: int) -> str:
    """The sample traces with attribute values swapped for values of every other type, keys dropped, errors added."""
    rng = random.Random(seed)
    out = []
    for path in sorted(SAMPLES.glob("*.jsonl")):
        for text in path.read_text().splitlines():
            request = json.loads(text)
            for rs in request["resourceSpans"]:
                for ss in rs["scopeSpans"]:
                    for span in ss["spans"]:
                        attrs = span.get("attributes") or []
                        for kv in attrs:
                            if rng.random() < 0.2:
                                kv["value"] = copy.deepcopy(rng.choice(VALUES))
                        if attrs and rng.random() < 0.2:
                            del attrs[rng.randrange(len(attrs))]
                        if rng.random() < 0.05:
                            span["status"] = {"code": 2, "message": ""}
            out.append(json.dumps(request))
    return "\n".join(out) + "\n"


@pytest.mark.parametrize("seed", range(6))
def test_attributes_of_any_type_never_stop_mining(tmp_path, seed):
    path = tmp_path / "damaged.jsonl"
    path.write_text(_damaged(seed))
    dataset = mine(path)
    assert len(dataset.actions) > 0
    report = mine_to_parquet(path, tmp_path / "out")  # the parquet columns take what `mine` gives
    assert report.actions == len(dataset.actions)
    for column in ("agent", "model", "adapter_version", "episode_id"):
        assert all(isinstance(v, str) for v in dataset.actions[column].dropna())
    assert all(isinstance(c, dict) for calls in dataset.actions["tool_calls"] for c in calls)
