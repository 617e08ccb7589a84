"""The fast paths of mining give what the general code gives, and step aside for anything unusual."""

from __future__ import annotations

import gc
import json
import os
import random

import pytest

from marft_lg.tracing import attributes as A
from marft_lg.tracing.attributes import from_genai_messages
from marft_lg.trajectories.formats import openinference as oi
from marft_lg.trajectories.formats import own
from marft_lg.trajectories.formats.base import intern_strings
from marft_lg.trajectories.formats.genai import _text_messages
from marft_lg.trajectories.formats.openinference import flat_messages, io_messages
from marft_lg.trajectories.otlp import _fast_raw_span, _raw_span
from marft_lg.trajectories.pipeline import gc_paused
from marft_lg.trajectories.quarantine import Quarantine
from marft_lg.trajectories.raw_span import RawSpan

TRACE = "0af7651916cd43dd8448eb211c80319c"


def _span(**over):
    span = {"traceId": TRACE, "spanId": "b7ad6b7169203331", "parentSpanId": "00f067aa0ba902b7", "name": "chat",
            "startTimeUnixNano": "1790000000000000000", "endTimeUnixNano": "1790000000500000000",
            "attributes": [{"key": "a", "value": {"stringValue": "x"}}, {"key": "n", "value": {"intValue": "7"}},
                           {"key": "l", "value": {"arrayValue": {"values": [{"stringValue": "p"}]}}}],
            "status": {"code": 2, "message": "boom"},
            "events": [{"name": "exception", "attributes": [{"key": "exception.type", "value": {"stringValue": "E"}}]}]}
    span.update(over)
    return span


@pytest.mark.parametrize("over", [{}, {"parentSpanId": ""}, {"status": {}}, {"events": []}, {"name": 5},
                                  {"startTimeUnixNano": 5, "endTimeUnixNano": 9}])
def test_fast_path_equals_the_checking_path(over):
    q = Quarantine(None)
    trace_ids: dict = {}
    slow = _raw_span(_span(**over), "f:1", q, None, trace_ids)
    assert _fast_raw_span(_span(**over), "f:1", None, trace_ids) == slow


@pytest.mark.parametrize("over", [{"spanId": "B7AD6B7169203331"}, {"spanId": "t61rcWkgMzE="},
                                  {"parentSpanId": "00F067AA0BA902B7"}, {"traceId": ["x"]},
                                  {"endTimeUnixNano": "1"}, {"startTimeUnixNano": "soon"},
                                  {"attributes": [{"key": "a"}]}, {"status": "bad"}])
def test_fast_path_steps_aside_for_unusual_spans(over):
    trace_ids = {TRACE: TRACE}
    assert _fast_raw_span(_span(**over), "f:1", None, trace_ids) is None
    assert _fast_raw_span(_span(), "f:1", 1000, trace_ids) is None  # size checks belong to the checking path


def test_openinference_key_cache_gives_flat_messages():
    a = {"llm.input_messages.1.message.content": "q", "llm.input_messages.0.message.role": "system",
         "llm.input_messages.0.message.contents.0.message_content.text": "be brief",
         "llm.output_messages.0.message.tool_calls.0.tool_call.function.name": "lookup",
         "llm.output_messages.0.message.tool_calls.0.tool_call.function.arguments": '{"t": 1}',
         "llm.input_messages.x.message.role": "ignored", "session.id": "s"}
    for _ in range(2):  # second pass: keys come from the cache
        assert io_messages(a) == (flat_messages(a, "llm.input_messages."), flat_messages(a, "llm.output_messages."))


@pytest.mark.parametrize("data", [
    [{"role": "user", "parts": [{"type": "text", "content": "hi"}]}, {"role": "assistant", "parts": []}],
    [{"parts": [{"type": "text", "content": 3}]}],
])
def test_text_messages_equal_the_general_converter(data):
    assert _text_messages(data) == from_genai_messages(data)


@pytest.mark.parametrize("data", [
    [{"role": "assistant", "parts": [{"type": "tool_call", "id": "c", "name": "f", "arguments": {}}]}],
    [{"role": "user", "parts": [{"type": "text", "content": "a"}, {"type": "text", "content": "b"}]}],
    [{"role": "user", "content": "plain"}], [],
])
def test_text_messages_leave_other_messages_to_the_converter(data):
    assert _text_messages(data) is None


def test_gc_paused_restores_the_collector():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_gc_paused_hands_its_survivors_to_the_oldest_generation_and_still_collects_cycles():
    import weakref

    class Node:
        pass

    collections: list[int] = []

    def record(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    gc.collect()
    gc.callbacks.append(record)
    try:
        with gc_paused():
            kept = [[i] for i in range(50_000)]
            cycle = Node()
            cycle.me = cycle
            alive = weakref.ref(cycle)
            del cycle
        ran = list(collections)
    finally:
        gc.callbacks.remove(record)
    assert ran == []  # leaving the pause did not walk the 50,000 young objects
    assert gc.get_count()[0] < 1000 and gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None and len(kept) == 50_000  # the cycle made in the pause is still found and freed


def test_gc_paused_leaves_a_callers_frozen_objects_frozen():
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with gc_paused():
            [[i] for i in range(100)]
        assert gc.get_freeze_count() > frozen // 2  # not unfrozen (frozen objects may still be freed meanwhile)
    finally:
        gc.unfreeze()


# -- own / OpenInference: the one-pass reader of the usual span (no error, no feedback) ----------
N_RANDOM = 3000  # random attribute sets per format: right and wrong types, JSON and non-JSON text



def _both(parse_fast, parse_general, make):
    results = []
    for parse in (lambda: intern_strings(parse_general(make())), lambda: parse_fast(make())):
        try:
            results.append((parse(), None))
        except Exception as exc:  # noqa: BLE001 - the exception type is what is compared
            results.append((None, type(exc)))
    return results


def _assert_same(general, fast, attrs):
    (old, old_exc), (new, new_exc) = general, fast
    assert old_exc == new_exc, (attrs, old_exc, new_exc)
    if old is not None:
        for name in old.__slots__:
            x, y = getattr(old, name), getattr(new, name)
            assert x == y and type(x) is type(y), (name, x, y, attrs)


def _use(module, usual: str, monkeypatch) -> None:
    """Run the one-pass reader of `module` in C (as imported) or in Python (`_parse_usual`)."""
    if usual == "python":
        monkeypatch.setattr(module, "_usual", module._parse_usual)
    elif os.environ.get("MARFT_MINING_C_READER") == "0":
        pytest.skip("C reader switched off")
    else:
        assert module._usual is not module._parse_usual, "the C version is not in use (module not built?)"


@pytest.mark.parametrize("usual", ["c", "python"])
def test_own_fast_path_matches_general_path(usual, monkeypatch):
    _use(own, usual, monkeypatch)
    rng = random.Random(1)
    keys = [own._EPISODE_ID, own._SCENARIO_ID, own._ROLE, own._NODE, own._STEP, own._TRIGGERS, own._TASK_ID,
            own._CHECKPOINT_NS, own._PROMPT_TOKEN_IDS, own._COMPLETION_TOKEN_IDS, own._COMPLETION_LOGPROBS,
            own._ADAPTER_VERSION, own._LATENCY_S, own._TOOL_CALLS, own._OUTCOME, own._EPISODE_METADATA,
            "gen_ai.conversation.id", "gen_ai.agent.name", "gen_ai.input.messages", "gen_ai.output.messages",
            "gen_ai.system_instructions", "gen_ai.usage.input_tokens", "gen_ai.usage.prompt_tokens",
            "gen_ai.usage.output_tokens", "gen_ai.usage.completion_tokens", "gen_ai.response.model",
            "gen_ai.request.model", "gen_ai.tool.name", "gen_ai.tool.call.id", "gen_ai.tool.call.arguments",
            "gen_ai.tool.call.result", "gen_ai.prompt.0.role", "gen_ai.prompt.0.content", "gen_ai.completion.0.content"]
    values = [None, "", "x", "unknown", 0, 1, 7, True, 2.5, -1.0, "12", "[1,2]", '{"a": 1}',
              '[{"name": "t", "id": "c"}]', ["a", "b"], [], "i32:AQAAAA==",
              A.to_genai_messages([{"role": "user", "content": "hi"}]), "not json {"]
    ops = ["chat", "text_completion", "execute_tool", "invoke_agent", "create_agent", "invoke_workflow", "other", "", 5,
           None]
    fast_taken = 0
    for _ in range(N_RANDOM):
        attrs = {k: rng.choice(values) for k in rng.sample(keys, rng.randint(0, len(keys)))}
        if rng.random() < 0.95:
            attrs["gen_ai.operation.name"] = rng.choice(ops)
        if not own.detect(attrs):
            attrs[own._EPISODE_ID] = rng.choice(values)
        parent = rng.choice([None, "00000000000000aa"])
        name = rng.choice(["n", "invoke_agent x", ""])
        fast_taken += type(attrs.get("gen_ai.operation.name")) is str

        def make(attrs=attrs, parent=parent, name=name):
            return RawSpan("t" * 32, "s" * 16, parent, name, 1, 2, dict(attrs), False, "", [], "f:1")

        general, fast = _both(own.parse, own._parse, make)
        _assert_same(general, fast, attrs)
    assert fast_taken > N_RANDOM // 2  # the fast path was exercised, not only the fallback


@pytest.mark.parametrize("usual", ["c", "python"])
def test_openinference_fast_path_matches_general_path(usual, monkeypatch):
    _use(oi, usual, monkeypatch)
    rng = random.Random(2)
    metas = [None, "", "{}", "not json",
             json.dumps({"langgraph_node": "a", "langgraph_step": 2, "thread_id": "t1", "scenario_id": "s",
                         "langgraph_checkpoint_ns": "a:1", "langgraph_triggers": ["x"], "ls_x": 1, "user": "u"}),
             json.dumps({"langgraph_node": "b", "checkpoint_ns": "outer:1|b:2", "session_id": 5}), json.dumps([1]),
             json.dumps({"langgraph_node": 3, "langgraph_step": "x"})]
    keys = ["session.id", "llm.model_name", "llm.token_count.prompt", "llm.token_count.completion", "tool.name",
            "tool_call.id", "tool.parameters", "input.value", "output.value", "llm.input_messages.0.message.role",
            "llm.input_messages.0.message.content", "llm.input_messages.1.message.content",
            "llm.output_messages.0.message.content", "llm.output_messages.0.message.role",
            "llm.output_messages.0.message.tool_calls.0.tool_call.id",
            "llm.output_messages.0.message.tool_calls.0.tool_call.function.name",
            "llm.output_messages.0.message.tool_calls.0.tool_call.function.arguments",
            "llm.input_messages.0.message.contents.0.message_content.text", "llm.input_messages.0.message.tool_call_id"]
    values = [None, "", "x", "a", "b", 0, 3, True, 2.5, "12", '{"a": 1}', '{"output": {"kwargs": {"content": "r"}}}', [],
              ["q"]]
    kinds = ["LLM", "llm", "TOOL", "AGENT", "CHAIN", "chain", "RETRIEVER", "", 5, None]
    for _ in range(N_RANDOM):
        attrs = {"openinference.span.kind": rng.choice(kinds)}
        for k in rng.sample(keys, rng.randint(0, len(keys))):
            attrs[k] = rng.choice(values)
        attrs["metadata"] = rng.choice(metas)
        if rng.random() < 0.1:
            del attrs["metadata"]
        name = rng.choice(["a", "b", "ChatModel", ""])
        parent = rng.choice([None, "00000000000000aa"])

        def make(attrs=attrs, parent=parent, name=name):
            return RawSpan("t" * 32, "s" * 16, parent, name, 1, 2, dict(attrs), False, "", [], "f:1")

        general, fast = _both(oi.parse, oi._parse, make)
        _assert_same(general, fast, attrs)


def test_parquet_batches_skip_string_sharing_and_hold_the_same_values(tmp_path):
    from collections import Counter

    from trajectory_spans import line, own_episode, write

    from marft_lg.trajectories.pipeline import assemble_batches, read_traces

    path = write(tmp_path / "t.jsonl", [line(own_episode(e, f"e{e}", base=10 * e)) for e in range(1, 6)])

    def batches(share: bool):
        traces = read_traces([path], Quarantine(None), max_attribute_bytes=1 << 20, stats={}, formats=Counter())
        episodes = {m[next(iter(m))].episode_id: list(m.values()) for m in traces.values()}
        return list(assemble_batches(episodes, Quarantine(None), {}, {}, None, set(), 100, Counter(),
                                     share_strings=share))

    shared, plain = batches(True), batches(False)
    assert shared == plain
    system = [m[0]["content"] for m in shared[0][1]["messages"] if m[0]["role"] == "system"]
    assert len(system) == 5 and len({id(s) for s in system}) == 1  # one copy of the repeated system prompt
    system = [m[0]["content"] for m in plain[0][1]["messages"] if m[0]["role"] == "system"]
    assert len({id(s) for s in system}) == 5


def test_parsed_json_columns_encode_the_same_values_as_the_general_encoder():
    from marft_lg.trajectories.columns import json_texts

    rng = random.Random(5)

    def value(depth=0):
        kind = rng.randrange(8 if depth < 3 else 5)
        if kind == 0:
            return "".join(rng.choice("ab \"\\\n\té€😀\u2028\x00") for _ in range(rng.randrange(8)))
        if kind == 1:
            return rng.choice([0, -1, 2**63 - 1, 2**64 + 5, -(2**70)])  # over 64 bits: the general encoder
        if kind == 2:
            return rng.choice([0.1, -2.5e-300, 1e16, 123456.789])
        if kind == 3:
            return rng.choice([True, False, None])
        if kind == 4:
            return {}
        if kind == 5:
            return [value(depth + 1) for _ in range(rng.randrange(4))]
        return {str(value(3)) + str(i): value(depth + 1) for i in range(rng.randrange(4))}

    values = [value() for _ in range(3000)] + [None, [], {}]
    fast, general = json_texts(values, parsed=True), json_texts(values)
    assert [None if t is None else json.loads(t) for t in fast] == [None if t is None else json.loads(t) for t in general]
    assert any(f != g for f, g in zip(fast, general, strict=True))  # the fast texts are compact: it did take them
