"""The fast recording path: SpanRecords encode to the same OTLP/JSON bytes as SDK spans, and reach SDK exporters."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from marft_lg.tracing import attributes as A
from marft_lg.tracing import read_spans
from marft_lg.tracing.otlp_json import dumps_records, dumps_request, encode_record
from marft_lg.tracing.records import (
    KIND_CLIENT,
    KIND_INTERNAL,
    STATUS_ERROR,
    STATUS_OK,
    SpanRecord,
    to_readable,
)
from marft_lg.tracing.sink import INSTRUMENTATION_NAME, make_record_sink

TRICKY = 'quote " backslash \\ newline \n tab \t nul \x00 é 漢字 \U0001f600 \u2028'


def _records():
    root = SpanRecord(2**127 + 5, 0, "invoke_workflow g", KIND_INTERNAL, {
        "s": TRICKY, "i": 3, "neg": -7, "big": 2**62, "f": 0.1, "tiny": 1e-7, "huge": 1e300, "inf": math.inf,
        "b": True, "nb": False, "l": ["a", TRICKY], "li": [1, 2], "empty": "", "none": None})
    root.set_status(STATUS_OK)
    child = SpanRecord(root.trace_id, root.span_id, "chat \u00e9", KIND_CLIENT, {A.MARFT_EPISODE_ID: "e"})
    try:
        raise KeyError("missing 'topic'")
    except KeyError as exc:
        child.record_exception(exc)
    child.set_status(STATUS_ERROR, "KeyError: " + TRICKY)
    child.end()
    root.end()
    return [child, root]


def test_record_encoding_is_byte_identical_to_the_sdk_span_encoding():
    sink = make_record_sink(None, service_name="svc")
    records = _records()
    fast = dumps_records([encode_record(r) for r in records], sink._frame)
    slow = dumps_request([to_readable(r, sink.resource, sink.scope) for r in records])
    assert fast == slow
    request = json.loads(fast)
    spans = request["resourceSpans"][0]["scopeSpans"][0]["spans"]
    assert request["resourceSpans"][0]["scopeSpans"][0]["scope"]["name"] == INSTRUMENTATION_NAME
    assert spans[0]["parentSpanId"] == spans[1]["spanId"] and spans[1]["parentSpanId"] == ""
    assert spans[0]["kind"] == 3 and spans[0]["status"]["code"] == 2 and spans[0]["events"][0]["name"] == "exception"
    assert "none" not in {kv["key"] for kv in spans[1]["attributes"]}  # None values are dropped, as the SDK does
    sink.shutdown()


def test_status_ok_is_final_and_only_errors_keep_a_message():
    rec = SpanRecord(1, 0, "x", KIND_INTERNAL, {})
    rec.set_status(STATUS_OK, "ignored")
    rec.set_status(STATUS_ERROR, "late")
    assert (rec.status_code, rec.status_message) == (STATUS_OK, "")


def test_fast_genai_messages_equal_the_generic_encoding():
    cases = [
        [{"role": "user", "content": TRICKY}],
        [{"role": "system", "content": ""}, {"role": "assistant", "content": None}, {"role": "user", "content": "x"}],
        [],
    ]
    for messages in cases:
        generic = json.dumps([{"role": m.get("role", "user"), "parts": [{"type": "text", "content": m["content"]}]
                               if m.get("content") else []} for m in messages], ensure_ascii=False)
        assert A.to_genai_messages(messages) == generic
        assert A.from_genai_messages(A.to_genai_messages(messages))[0:1] == [
            {"role": m["role"], "content": m["content"] or ""} for m in messages][0:1]
    tool = [{"role": "assistant", "content": "", "tool_calls": [{"id": "1", "name": "add", "args": {"a": 1}}]},
            {"role": "tool", "content": "2", "tool_call_id": "1"}]
    assert json.loads(A.to_genai_messages(tool))[1]["parts"][0]["type"] == "tool_call_response"


def test_token_packing_equals_numpy_and_rejects_what_numpy_rejects():
    ids = [0, 1, 7, 49151, 2**31 - 1, -5]
    lps = [-0.1, -12.25, 0.0, -1e-9, -3.4e38]
    assert A.encode_ints(ids) == "i32:" + __import__("base64").b64encode(np.asarray(ids, "<i4").tobytes()).decode()
    assert A.encode_floats(lps) == "f32:" + __import__("base64").b64encode(np.asarray(lps, "<f4").tobytes()).decode()
    assert A.encode_ints(np.arange(4)) == A.encode_ints([0, 1, 2, 3])  # numpy input takes the numpy path
    with pytest.raises(OverflowError):
        A.encode_ints([2**31])


def test_sdk_exporters_get_the_same_spans_as_the_file(tmp_path):
    from langgraph.graph import END, START, StateGraph

    from marft_lg.graph import TeamChatModel, wrap
    from marft_lg.serving.types import Completion

    class Engine:
        model_name = "m"

        def agents(self):
            return ["planner"]

        def chat(self, requests):
            return [Completion(text="ok", prompt_token_ids=[1, 2], completion_token_ids=[3], logprobs=[-0.5],
                               agent=r.agent, adapter_version="v1", model="m") for r in requests]

    llm = TeamChatModel()
    g = StateGraph(dict)
    g.add_node("planner", lambda s: {"out": llm.invoke(s["msgs"][-1]).content})
    g.add_edge(START, "planner")
    g.add_edge("planner", END)
    memory = InMemorySpanExporter()
    app = wrap(g.compile(), team=Engine(), trace_dir=tmp_path, exporters=[memory])
    app.invoke({"msgs": ["hi"]}, episode_id="ep")
    assert app.flush()
    on_file = {s["span_id"]: s for s in read_spans(tmp_path)}
    exported = memory.get_finished_spans()
    assert len(exported) == len(on_file) == 3
    for span in exported:
        mine = on_file[format(span.context.span_id, "016x")]
        assert span.name == mine["name"]
        assert {k: list(v) if isinstance(v, tuple) else v for k, v in span.attributes.items()} == mine["attributes"]
        assert span.kind == (SpanKind.CLIENT if mine["kind"] == 3 else SpanKind.INTERNAL)
        assert span.status.status_code.value == mine["status_code"]
        assert (span.start_time, span.end_time) == (mine["start_ns"], mine["end_ns"])
    app.close()


def test_spans_made_on_the_sdk_tracer_reach_the_file_and_the_writer_flushes_by_itself(tmp_path):
    sink = make_record_sink(tmp_path)
    sink.tracer.start_span("sdk-made", attributes={"k": "v"}).end()
    rec = SpanRecord(9, 0, "recorded", KIND_INTERNAL, {"k": 1})
    rec.end()
    sink.submit(rec)
    # no flush(): the background writer drains every 0.5 s; wait for it (generously, machines are slow)
    deadline = time.monotonic() + 30
    names: set[str] = set()
    while time.monotonic() < deadline and names != {"sdk-made", "recorded"}:
        time.sleep(0.1)
        names = {s["name"] for s in read_spans(tmp_path)} if list(tmp_path.glob("*.jsonl")) else set()
    assert names == {"sdk-made", "recorded"}
    sink.shutdown()
    sink.submit(rec)  # after shutdown: nothing is raised
