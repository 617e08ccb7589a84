"""Fields of the wrong shape (which used to stop the whole run with an exception) are quarantined with their
file:line; the rest of the line and file is still mined."""

from __future__ import annotations

import json

import pytest
from trajectory_spans import line, own_episode, write

from marft_lg.trajectories.mining import mine_with_report


def _with(i: int, **over):
    spans = json.loads(json.dumps(own_episode(1, "e1")))
    spans[i] = {**spans[i], **over}
    return spans


def _attr(i: int, value):
    spans = json.loads(json.dumps(own_episode(1, "e1")))
    spans[i]["attributes"].append({"key": "app.x", "value": value})
    return spans


MALFORMED_SPANS = {
    "status not an object": _with(1, status="bad"),
    "double value not a number": _attr(1, {"doubleValue": "abc"}),
    "array value not an object": _attr(1, {"arrayValue": [1]}),
    "event attributes not key-values": _with(1, events=[{"name": "x", "attributes": [5]}]),
}


@pytest.mark.parametrize("name", list(MALFORMED_SPANS))
def test_a_malformed_span_is_quarantined_and_its_line_mined(tmp_path, name):
    src = write(tmp_path / "t.jsonl", [line(MALFORMED_SPANS[name]), line(own_episode(2, "e2", base=10))])
    q = tmp_path / "q.jsonl"
    dataset, report = mine_with_report(src, quarantine=q)
    records = [json.loads(x) for x in q.read_text().splitlines()]
    assert [(r["reason"], r["source"]) for r in records] == [("not_otlp", f"{src}:1")]
    assert "malformed span" in records[0]["detail"] and records[0]["span"]["spanId"] == f"{2:016x}"
    assert dataset.episode_ids == ["e1", "e2"] and report.spans_kept == 11  # the planner's agent span is lost


@pytest.mark.parametrize("body", [
    {"resourceSpans": [5]}, {"resourceSpans": [{"scopeSpans": 7}]}, {"resourceSpans": [{"scopeSpans": ["x"]}]},
    {"resourceSpans": [{"scopeSpans": [{"spans": True}]}]},
])
def test_malformed_containers_are_quarantined(tmp_path, body):
    src = write(tmp_path / "t.jsonl", [json.dumps(body), line(own_episode(2, "e2"))])
    q = tmp_path / "q.jsonl"
    dataset, _ = mine_with_report(src, quarantine=q)
    assert [(r["reason"], r["source"]) for r in map(json.loads, q.read_text().splitlines())] == [("not_otlp", f"{src}:1")]
    assert dataset.episode_ids == ["e2"]
