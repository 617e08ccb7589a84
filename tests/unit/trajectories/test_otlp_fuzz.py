"""Property tests (hypothesis) of the OTLP/JSON reader (`iter_raw_spans`: the C, typed and tolerant readers
together): on files of valid spans, spans with one mutation, and damaged lines, it never raises, yields every
valid span (ids normalised) and quarantines every invalid span or line exactly once."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from marft_lg.trajectories.otlp import iter_raw_spans
from marft_lg.trajectories.quarantine import Quarantine

_TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
_ATTR_VALUE = st.one_of(
    _TEXT.map(lambda s: {"stringValue": s}),
    st.integers(-2**62, 2**62).map(lambda i: {"intValue": str(i)}),
    st.integers(-2**31, 2**31).map(lambda i: {"intValue": i}),
    st.floats(allow_nan=False, allow_infinity=False).map(lambda f: {"doubleValue": f}),
    st.booleans().map(lambda b: {"boolValue": b}),
    st.lists(_TEXT, max_size=3).map(lambda v: {"arrayValue": {"values": [{"stringValue": s} for s in v]}}),
)
_ATTRS = st.lists(st.tuples(st.sampled_from(["gen_ai.operation.name", "marft.agent.role", "app.x", "k", "é"]),
                            _ATTR_VALUE), max_size=4)

# how a valid span is broken, and the quarantine reason that must follow
_MUTATIONS = {
    "no_trace_id": "missing_id", "zero_span_id": "missing_id", "bad_hex_trace_id": "missing_id",
    "start_not_int": "bad_time", "no_end": "bad_time", "end_before_start": "end_before_start",
    "not_an_object": "not_otlp", "status_not_object": "not_otlp", "double_not_number": "not_otlp",
}


@st.composite
def _span(draw, n: int):
    start = draw(st.integers(0, 2**62))
    out = {"traceId": f"{draw(st.integers(1, 2**128 - 1)):032x}", "spanId": f"{n + 1:016x}",
           "parentSpanId": draw(st.sampled_from(["", f"{n + 7:016x}"])), "name": draw(_TEXT),
           "startTimeUnixNano": str(start), "endTimeUnixNano": str(start + draw(st.integers(0, 10**9))),
           "attributes": [{"key": k, "value": v} for k, v in draw(_ATTRS)],
           "status": draw(st.sampled_from([{}, {"code": 1}, {"code": 2, "message": "boom"}]))}
    if draw(st.booleans()):
        out["traceId"] = out["traceId"].upper()  # hex in any case is accepted and normalised
    if draw(st.booleans()):
        out["startTimeUnixNano"] = start  # numbers as well as strings
    return out


@st.composite
def _line(draw, first_id: int):
    """(raw line, expected (trace, span) ids kept, quarantine count, whether it holds non-UTF-8 bytes)."""
    kind = draw(st.sampled_from(["spans", "spans", "spans", "garbage", "truncated", "json_not_otlp", "bad_container"]))
    spans = [draw(_span(first_id + i)) for i in range(draw(st.integers(1, 4)))]
    body = {"resourceSpans": [{"resource": {"attributes": []}, "scopeSpans": [{"scope": {"name": "t"}, "spans": []}]}]}
    if kind == "garbage":
        return ("#" + draw(_TEXT).replace("\n", " ")).encode(), [], 1, False  # one line: a newline would make two
    if kind == "json_not_otlp":
        return json.dumps(draw(st.one_of(st.integers(), st.lists(st.integers(), max_size=3),
                                         st.just({"spans": []})))).encode(), [], 1, False
    if kind == "bad_container":
        return json.dumps({"resourceSpans": [{"scopeSpans": 7}]}).encode(), [], 1, False
    kept, bad = [], 0
    for s in spans:
        mutation = draw(st.sampled_from([None] * len(_MUTATIONS) + list(_MUTATIONS)))  # half stay valid
        if mutation is None:
            kept.append((s["traceId"].lower(), s["spanId"]))
        else:
            bad += 1
            s = _mutate(s, mutation)
        body["resourceSpans"][0]["scopeSpans"][0]["spans"].append(s)
    raw = json.dumps(body, ensure_ascii=draw(st.booleans())).encode()
    if kind == "truncated":  # a cut inside a multi-byte character leaves bytes that are not UTF-8: counted as such
        cut = raw[:draw(st.integers(1, len(raw) - 1))]
        return cut, [], 1, not _is_utf8(cut)
    non_utf8 = False
    if kept and draw(st.booleans()) and b'"name": "' in raw:  # a stray Latin-1 byte inside a span name
        raw = raw.replace(b'"name": "', b'"name": "\xe9', 1)
        non_utf8 = True
    return raw, kept, bad, non_utf8


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _mutate(span: dict, how: str):
    s = dict(span)
    if how == "no_trace_id":
        del s["traceId"]
    elif how == "zero_span_id":
        s["spanId"] = "0" * 16
    elif how == "bad_hex_trace_id":
        s["traceId"] = "xyz" + s["traceId"][3:]
    elif how == "start_not_int":
        s["startTimeUnixNano"] = "soon"
    elif how == "no_end":
        del s["endTimeUnixNano"]
    elif how == "end_before_start":
        s["startTimeUnixNano"], s["endTimeUnixNano"] = "200", "100"
    elif how == "not_an_object":
        return [s["spanId"]]
    elif how == "status_not_object":
        s["status"] = "bad"
    elif how == "double_not_number":
        s["attributes"] = [*s["attributes"], {"key": "d", "value": {"doubleValue": "abc"}}]
    return s


@st.composite
def _file(draw):
    lines, first = [], 0
    for _ in range(draw(st.integers(1, 6))):
        item = draw(_line(first))
        lines.append(item)
        first += 8
    return lines


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(_file())
def test_reader_keeps_every_valid_span_and_quarantines_every_invalid_one(lines):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.jsonl"
        path.write_bytes(b"".join(raw + b"\n" for raw, *_ in lines))
        q, stats = Quarantine(None), {}
        got = [(s.trace_id, s.span_id) for s in iter_raw_spans(path, q, stats=stats)]
    assert got == [ids for _, kept, _, _ in lines for ids in kept]
    assert q.total == sum(bad for _, _, bad, _ in lines), dict(q.counts)
    assert stats.get("non_utf8_lines", 0) == sum(1 for *_, non_utf8 in lines if non_utf8)


@settings(max_examples=60, deadline=None, database=None)
@given(st.lists(st.binary(max_size=200), max_size=8))
def test_reader_never_raises_on_random_bytes(chunks):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.jsonl"
        path.write_bytes(b"\n".join(chunks))
        q, stats = Quarantine(None), {}
        spans = list(iter_raw_spans(path, q, stats=stats))
    non_empty = sum(1 for c in b"\n".join(chunks).split(b"\n") if c.strip())
    assert not spans and q.total <= non_empty
