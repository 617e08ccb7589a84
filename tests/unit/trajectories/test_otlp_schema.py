"""The typed decoder (`otlp_schema.typed_spans`) gives exactly what the tolerant reader gives on the lines it
accepts, and leaves every other line (damage, unusual shapes, numbers orjson reads differently) to it."""

from __future__ import annotations

import json

import pytest
from trajectory_spans import line, own_episode, span

from marft_lg.trajectories.otlp import DEFAULT_MAX_ATTRIBUTE_BYTES, tolerant_spans_of_line
from marft_lg.trajectories.otlp_schema import typed_spans
from marft_lg.trajectories.quarantine import Quarantine


def _tolerant(raw: bytes):
    q, stats = Quarantine(None), {}
    spans = list(tolerant_spans_of_line(raw, "f.jsonl:3", q, DEFAULT_MAX_ATTRIBUTE_BYTES, stats))
    return spans, stats.get("spans_read", 0), dict(q.counts)


def _line(spans, **request) -> bytes:
    body = json.loads(line(spans))
    body["resourceSpans"][0].update(request)
    return json.dumps(body).encode()


def _with(i: int, **over):
    spans = own_episode(1, "e1")
    spans[i] = {**spans[i], **over}
    return spans


def _attr(value: dict):
    spans = own_episode(1, "e1")
    spans[2] = {**spans[2], "attributes": [*spans[2]["attributes"], {"key": "extra", "value": value}]}
    return spans


GOOD = {
    "own episode": own_episode(1, "e1") + own_episode(2, "e2", base=10, tool_error=True),
    "typed values": _attr({"arrayValue": {"values": [{"intValue": "3"}, {"doubleValue": 2}, {"boolValue": False},
                                                     {"kvlistValue": {"values": [{"key": "k", "value": {}}]}}]}}),
    "int value as number": _attr({"intValue": 12}),
    "int value not a number": _attr({"intValue": "twelve"}),
    "bytes value": _attr({"bytesValue": "AAE="}),
    "string wins over other keys": _attr({"stringValue": "s", "intValue": "1"}),
    "empty value": _attr({}),
    "integer times": _with(2, startTimeUnixNano=5, endTimeUnixNano=9),
    "zero parent": _with(2, parentSpanId="0" * 16),
    "no status, null events and name": _with(2, status=None, events=None, name=None),
    "status code as text": _with(2, status={"code": "STATUS_CODE_ERROR", "message": "boom"}),
    "standard optional fields": _with(2, kind=3, traceState="", flags=256, links=[], droppedAttributesCount=0,
                                      droppedEventsCount=0, droppedLinksCount=0),
}


@pytest.mark.parametrize("name", list(GOOD))
def test_typed_decoding_equals_the_tolerant_reader(name):
    raw = _line(GOOD[name], resource={"attributes": [{"key": "service.name", "value": {"stringValue": "app"}}]},
                schemaUrl="https://opentelemetry.io/schemas/1.26.0")
    typed = typed_spans(raw, "f.jsonl:3")
    assert typed is not None
    spans, n, quarantined = _tolerant(raw)
    assert quarantined == {}
    assert typed == (spans, n)


REJECTED = {
    "upper-case span id": _with(2, spanId="B7AD6B7169203331"),
    "base64 span id": _with(2, spanId="t61rcWkgMzE="),
    "upper-case parent": _with(2, parentSpanId="00000000000000AB"),
    "no parent key": [{k: v for k, v in s.items() if k != "parentSpanId"} for s in own_episode(1, "e1")],
    "null parent": _with(2, parentSpanId=None),
    "zero trace id": _with(2, traceId="0" * 32),
    "snake_case ids": _with(2, trace_id=f"{1:032x}"),
    "end before start": _with(2, endTimeUnixNano="1"),
    "time not a number": _with(2, startTimeUnixNano="soon"),
    "time beyond 64 bits": _with(2, startTimeUnixNano=2**64, endTimeUnixNano=2**64 + 1),
    "int value beyond 64 bits": _attr({"intValue": 2**64}),
    "status not an object": _with(2, status="bad"),
    "name not a string": _with(2, name=5),
    "key without value": _with(2, attributes=[{"key": "k"}]),
    "unknown span field": _with(2, vendorField=1),
}


@pytest.mark.parametrize("name", list(REJECTED))
def test_unusual_lines_are_left_to_the_tolerant_reader(name):
    assert typed_spans(_line(REJECTED[name]), "f.jsonl:3") is None


@pytest.mark.parametrize("raw", [
    b"not json", b"[1, 2]", b'{"resource_spans": []}', b'{"resourceSpans": [{"scope_spans": []}]}',
    b'{"resourceSpans": [{"resource": {"x": 1e400}, "scopeSpans": []}]}',  # orjson refuses the number
    b'{"resourceSpans": [{"scopeSpans": [{"spans": [5]}]}]}',
    line(own_episode(1, "e1")).encode()[:-10],
])
def test_damaged_or_other_shapes_are_left_to_the_tolerant_reader(raw):
    assert typed_spans(raw, "f.jsonl:1") is None


def test_trace_id_strings_are_shared_within_a_line():
    spans, _ = typed_spans(line([span(7, i, None, "x", 0, 1) for i in range(1, 4)]).encode(), "f:1")
    assert len({id(s.trace_id) for s in spans}) == 1


GENAI_MESSAGES = [
    [{"role": "system", "parts": [{"type": "text", "content": "be brief"}]}, {"role": "user", "parts": []}],
    [{"role": "assistant", "parts": [{"type": "tool_call", "id": "c1", "name": "lookup", "arguments": {"n": 2**70}}]}],
    [{"role": "assistant", "parts": [{"type": "text", "content": "a"}, {"type": "tool_call", "id": "c", "name": "f"},
                                     {"type": "text", "content": "b"}]}],
    [{"parts": [{"type": "tool_call", "arguments": None}]}],
]


@pytest.mark.parametrize("data", GENAI_MESSAGES)
def test_typed_genai_messages_equal_the_general_path(data):
    import orjson

    from marft_lg.tracing.attributes import from_genai_messages
    from marft_lg.trajectories.formats.genai import _typed_messages

    raw = json.dumps(data)
    parsed = orjson.loads(raw)  # what the general path reads them with (big integers become floats)
    assert _typed_messages(raw) == from_genai_messages(parsed)


@pytest.mark.parametrize("raw", [
    "[]", "not json", '[{"role": "user", "parts": [{"type": "text", "content": 3}]}]',
    '[{"role": "user", "parts": [], "content": "plain"}]',
    '[{"role": "tool", "parts": [{"type": "tool_call_response", "id": "c", "response": "r"}]}]',
    '[{"role": "assistant", "parts": [{"type": "tool_call", "arguments": {"x": 1e400}}]}]',
])
def test_other_genai_messages_are_left_to_the_general_path(raw):
    from marft_lg.trajectories.formats.genai import _typed_messages

    assert _typed_messages(raw) is None


OPENINFERENCE_MESSAGES = [
    ({"llm.input_messages.1.message.content": "q", "llm.input_messages.0.message.role": "system",
      "llm.input_messages.0.message.content": "be brief", "llm.input_messages.1.message.role": "user",
      "llm.output_messages.0.message.role": "assistant", "llm.output_messages.0.message.content": 7, "session.id": "s"},
     ([{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"}],
      [{"role": "assistant", "content": "7"}])),
    ({"llm.output_messages.0.message.tool_calls.0.tool_call.function.name": "lookup",
      "llm.output_messages.0.message.tool_calls.0.tool_call.id": "c1",
      "llm.output_messages.0.message.tool_calls.0.tool_call.function.arguments": '{"t": 1}',
      "llm.input_messages.0.message.tool_call_id": "c0", "llm.input_messages.0.message.content": "result"},
     ([{"role": "user", "content": "result", "tool_call_id": "c0"}],
      [{"role": "user", "content": "", "tool_calls": [{"id": "c1", "name": "lookup", "args": {"t": 1}}]}])),
    ({"llm.input_messages.0.message.role": "user", "llm.input_messages.00.message.role": "system"},  # one field twice
     ([{"role": "system", "content": ""}], [])),
    ({"llm.input_messages.0.message.content": "a", "llm.input_messages.0.message.contents.0.message_content.text": "b"},
     ([{"role": "user", "content": "ab"}], [])),
    ({"llm.input_messages.2.message.content": "c", "llm.input_messages.10.message.content": "k"},  # numeric order
     ([{"role": "user", "content": "c"}, {"role": "user", "content": "k"}], [])),
    ({"llm.model_name": "m"}, ([], [])),
]


@pytest.mark.parametrize(("attrs", "expected"), OPENINFERENCE_MESSAGES)
def test_openinference_flattened_messages(attrs, expected):
    from marft_lg.trajectories.formats.openinference import io_messages

    for _ in range(2):  # the second time with the keys remembered
        assert io_messages(dict(attrs)) == expected


def _reference_episode_key(spans):
    """Reference: own episode id > session > trace id, taken from the earliest span (by start, then span id) naming one."""
    ordered = sorted(spans, key=lambda s: (s.start_ns, s.span_id))
    for s in ordered:
        if s.episode_id:
            return s.episode_id
    for s in ordered:
        if s.session:
            return str(s.session)
    return ordered[0].trace_id


def test_episode_key_takes_the_earliest_span_naming_an_episode_then_a_session():
    import random

    from marft_lg.trajectories.assembly import episode_key
    from marft_lg.trajectories.formats.base import SpanInfo

    rng = random.Random(0)
    for _ in range(500):
        spans = []
        for i in range(rng.randint(1, 8)):
            s = SpanInfo("t", f"{rng.randint(0, 5):015x}{i}", None, "n", rng.randint(0, 3), 5, "f:1")
            s.episode_id, s.session = rng.choice([None, "", "e1", "e2"]), rng.choice([None, "", "s1", 5])
            spans.append(s)
        rng.shuffle(spans)
        assert episode_key(spans) == _reference_episode_key(spans)


def test_interned_shares_one_copy_per_string():
    from marft_lg.trajectories.pipeline import interned

    values = ["".join(["plan", "ner"]), None, "planner", 3, True]
    out = interned(values)
    assert out == values and out[0] is out[2] and [type(v) for v in out] == [str, type(None), str, int, bool]
    assert interned([["unhashable"], "x"]) == [["unhashable"], "x"]
