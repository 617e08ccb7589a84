"""OTLP/JSON-lines exporter, reader, rotation and record_feedback."""

from __future__ import annotations

import json

import pytest
from opentelemetry.trace import SpanKind, Status, StatusCode

from marft_lg.tracing import attributes as A
from marft_lg.tracing import read_spans, record_feedback
from marft_lg.tracing.provider import make_sink


def test_lines_are_otlp_export_requests_with_hex_ids(tmp_path):
    sink = make_sink(tmp_path, service_name="svc")
    root = sink.tracer.start_span("root", attributes={"i": 3, "f": 0.5, "b": True, "s": "x", "l": ["a", "b"]})
    from opentelemetry import trace

    child = sink.tracer.start_span("child", context=trace.set_span_in_context(root), kind=SpanKind.CLIENT)
    child.set_status(Status(StatusCode.ERROR, "bad"))
    child.end()
    root.end()
    assert sink.flush()
    files = list(tmp_path.glob("*.jsonl"))
    assert len(files) == 1
    lines = files[0].read_text().splitlines()
    request = json.loads(lines[0])
    rs = request["resourceSpans"][0]
    assert {"key": "service.name", "value": {"stringValue": "svc"}} in rs["resource"]["attributes"]
    scope = rs["scopeSpans"][0]
    assert scope["scope"]["name"] == "marft_lg"
    by_name = {s["name"]: s for line in lines for s in json.loads(line)["resourceSpans"][0]["scopeSpans"][0]["spans"]}
    c, r = by_name["child"], by_name["root"]
    assert len(c["traceId"]) == 32 and len(c["spanId"]) == 16 and c["traceId"] == r["traceId"]
    assert c["parentSpanId"] == r["spanId"] and r["parentSpanId"] == ""
    assert c["kind"] == 3 and r["kind"] == 1  # OTLP enum: CLIENT=3, INTERNAL=1
    assert c["status"] == {"code": 2, "message": "bad"}
    attrs = {kv["key"]: kv["value"] for kv in r["attributes"]}
    assert attrs["i"] == {"intValue": "3"} and attrs["f"] == {"doubleValue": 0.5} and attrs["b"] == {"boolValue": True}
    assert attrs["l"] == {"arrayValue": {"values": [{"stringValue": "a"}, {"stringValue": "b"}]}}
    assert int(r["endTimeUnixNano"]) >= int(r["startTimeUnixNano"]) > 0
    back = {s["name"]: s for s in read_spans(tmp_path)}
    assert back["root"]["attributes"] == {"i": 3, "f": 0.5, "b": True, "s": "x", "l": ["a", "b"]}
    assert back["child"]["parent_span_id"] == back["root"]["span_id"] and back["child"]["status_code"] == 2


def test_rotation_by_size(tmp_path):
    sink = make_sink(tmp_path, batch=False, max_file_bytes=2000)
    for i in range(30):
        sink.tracer.start_span(f"s{i}", attributes={"pad": "x" * 200}).end()
    sink.flush()
    files = sorted(tmp_path.glob("*.jsonl"))
    assert len(files) > 3
    assert all(f.stat().st_size < 2000 + 1000 for f in files)
    assert sorted(s["name"] for s in read_spans(tmp_path)) == sorted(f"s{i}" for i in range(30))


def test_reader_names_file_and_line_of_a_bad_line(tmp_path):
    good = tmp_path / "a.jsonl"
    good.write_text('{"resourceSpans": []}\n{"resourceSpans": [\n')
    with pytest.raises(ValueError, match=r"a\.jsonl:2: not a JSON line"):
        read_spans(tmp_path)


def test_token_encodings_round_trip():
    ids = [0, 1, 49151, 2**31 - 1]
    assert A.decode_ints(A.encode_ints(ids)) == ids
    lps = [-0.5, -12.25, 0.0]
    assert A.decode_floats(A.encode_floats(lps)) == lps


def test_record_feedback_is_joinable_by_episode(tmp_path):
    record_feedback("ep-42", "thumbs_up", True, trace_dir=tmp_path)
    record_feedback("ep-42", "csat", 4.5, trace_dir=tmp_path, comment="fast", metadata={"ticket": 7})
    got = [s for s in read_spans(tmp_path) if s["name"] == A.FEEDBACK_SPAN_NAME]  # on disk without any flush call
    assert [(s["attributes"][A.MARFT_FEEDBACK_NAME], s["attributes"][A.MARFT_FEEDBACK_VALUE]) for s in got] == [
        ("thumbs_up", True), ("csat", 4.5)]
    assert all(s["attributes"][A.MARFT_EPISODE_ID] == "ep-42" and s["parent_span_id"] is None for s in got)
    assert got[1]["attributes"][A.MARFT_FEEDBACK_COMMENT] == "fast"
    assert json.loads(got[1]["attributes"][A.MARFT_FEEDBACK_METADATA]) == {"ticket": 7}
    assert got[0]["attributes"][A.MARFT_FEEDBACK_TIME].endswith("+00:00")
    with pytest.raises(TypeError, match="must be a number, bool or string"):
        record_feedback("ep-42", "blob", {"a": 1}, trace_dir=tmp_path)
    with pytest.raises(ValueError, match="episode_id"):
        record_feedback("", "x", 1, trace_dir=tmp_path)
