"""Bad input: crashes inside nodes, failing exporters, privacy (opt-out and redaction)."""

from __future__ import annotations

import json
import logging

import pytest
from graph_apps import agents, by_episode, chats, linear, spans
from graph_fakes import FakeEngine
from langgraph.graph import END, START, StateGraph
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from marft_lg.graph import TeamChatModel, wrap
from marft_lg.tracing import attributes as A


def test_crash_in_node_still_produces_error_spans(tmp_path):
    eng = FakeEngine()
    llm = TeamChatModel()

    def planner(state):
        return {"msgs": [llm.invoke("plan").content]}

    def writer(state):
        llm.invoke("draft")
        raise KeyError("missing field 'topic'")

    g = StateGraph(dict)
    g.add_node("planner", planner)
    g.add_node("writer", writer)
    g.add_edge(START, "planner")
    g.add_edge("planner", "writer")
    g.add_edge("writer", END)
    app = wrap(g.compile(), team=eng, trace_dir=tmp_path)
    with pytest.raises(KeyError, match="topic"):
        app.invoke({"msgs": []}, episode_id="boom")
    got = by_episode(spans(app, tmp_path), "boom")
    root = [s for s in got if s["parent_span_id"] is None][0]
    assert root["status_code"] == 2 and "topic" in root["status_message"]
    assert root["attributes"][A.ERROR_TYPE] == "KeyError"
    assert A.MARFT_OUTCOME not in root["attributes"]
    assert any(e["name"] == "exception" for e in root["events"])
    nodes = {s["attributes"][A.MARFT_AGENT_NODE]: s for s in agents(got)}
    assert nodes["planner"]["status_code"] == 1
    assert nodes["writer"]["status_code"] == 2
    assert len(chats(got)) == 2 and all(c["status_code"] == 1 for c in chats(got))


def test_engine_failure_marks_the_chat_span(tmp_path):
    app = wrap(linear(TeamChatModel(), names=("planner",)), team=FakeEngine(fail=True), trace_dir=tmp_path)
    with pytest.raises(RuntimeError, match="exploded"):
        app.invoke({"msgs": ["x"]}, episode_id="e")
    call = chats(spans(app, tmp_path))[0]
    assert call["status_code"] == 2 and call["attributes"][A.ERROR_TYPE] == "RuntimeError"


class _Broken(SpanExporter):
    def __init__(self):
        self.calls = 0

    def export(self, spans):
        self.calls += 1
        raise ConnectionError("collector is down")

    def shutdown(self):
        pass


class _Refusing(_Broken):
    def export(self, spans):
        self.calls += 1
        return SpanExportResult.FAILURE


def test_export_failures_never_break_the_app(tmp_path, caplog):
    broken, refusing = _Broken(), _Refusing()
    eng = FakeEngine()
    app = wrap(linear(TeamChatModel()), team=eng, trace_dir=tmp_path, exporters=[broken, refusing])
    plain = linear(TeamChatModel(team=eng)).invoke({"msgs": ["x"]})
    with caplog.at_level(logging.WARNING, logger="marft_lg.tracing"):
        for _ in range(3):
            assert app.invoke({"msgs": ["x"]}) == plain
            app.flush()
    assert broken.calls >= 3 and refusing.calls >= 3
    assert app.export_failures == broken.calls + refusing.calls
    warnings = [r for r in caplog.records if "span export" in r.getMessage()]
    assert len(warnings) == 2  # once per exporter, not once per batch
    assert "collector is down" in warnings[0].getMessage()
    assert len(chats(spans(app, tmp_path))) == 9  # the healthy file exporter still got everything


def test_unwritable_trace_dir_does_not_break_the_app(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    app = wrap(linear(TeamChatModel(), names=("planner",)), team=FakeEngine(), trace_dir=blocker / "traces")
    assert app.invoke({"msgs": ["x"]})["msgs"][0] == "x"
    app.flush()
    assert app.export_failures == 1


def test_capture_messages_off_keeps_tokens_only(tmp_path):
    app = wrap(linear(TeamChatModel()), team=FakeEngine(), trace_dir=tmp_path, capture_messages=False)
    app.invoke({"msgs": ["secret plan"]}, episode_id="priv")
    got = spans(app, tmp_path)
    text = json.dumps(got)
    assert "secret plan" not in text
    call = chats(got)[0]["attributes"]
    assert A.GEN_AI_INPUT_MESSAGES not in call and A.GEN_AI_OUTPUT_MESSAGES not in call
    assert A.decode_ints(call[A.MARFT_COMPLETION_TOKEN_IDS])
    root = [s for s in got if s["parent_span_id"] is None][0]
    assert A.MARFT_OUTCOME not in root["attributes"]


def test_redaction_hook_applies_to_every_recorded_text(tmp_path):
    def redact(text: str) -> str:
        return text.replace("alice@example.com", "[email]")

    eng = FakeEngine(script={"planner": ["mail alice@example.com now"]})
    app = wrap(linear(TeamChatModel(), names=("planner",)), team=eng, trace_dir=tmp_path, redact=redact)
    out = app.invoke({"msgs": ["contact alice@example.com"]}, episode_id="red")
    assert out["msgs"] == ["contact alice@example.com", "mail alice@example.com now"]  # the app's data is untouched
    got = spans(app, tmp_path)
    assert "alice@example.com" not in json.dumps(got)
    call = chats(got)[0]["attributes"]
    assert "[email]" in call[A.GEN_AI_INPUT_MESSAGES] and "[email]" in call[A.GEN_AI_OUTPUT_MESSAGES]


def test_private_provider_leaves_the_global_one_alone(tmp_path):
    before = otel_trace.get_tracer_provider()
    app = wrap(linear(TeamChatModel(), names=("planner",)), team=FakeEngine(), trace_dir=tmp_path)
    app.invoke({"msgs": ["x"]})
    assert otel_trace.get_tracer_provider() is before
    assert app.sink.provider is not before


def test_a_raising_redaction_hook_does_not_break_the_app(tmp_path, caplog):
    def redact(text: str) -> str:
        raise RuntimeError("redactor bug")

    app = wrap(linear(TeamChatModel(), names=("planner",)), team=FakeEngine(), trace_dir=tmp_path, redact=redact)
    with caplog.at_level(logging.WARNING):
        out = app.invoke({"msgs": ["x"]}, episode_id="rr")
    assert out["msgs"][0] == "x" and len(out["msgs"]) == 2
    got = by_episode(spans(app, tmp_path), "rr")
    root = [s for s in got if s["parent_span_id"] is None][0]
    assert A.MARFT_OUTCOME not in root["attributes"]  # nothing unredacted is written
    assert "redactor bug" not in json.dumps(got) and "closing the trace" in caplog.text
