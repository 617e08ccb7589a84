"""The fast paths of mining give what the general code gives, and step aside for anything unusual."""

from __future__ import annotations

import gc

import pytest

from marft_lg.tracing.attributes import from_genai_messages
from marft_lg.trajectories.formats.genai import _text_messages
from marft_lg.trajectories.formats.openinference import flat_messages, io_messages
from marft_lg.trajectories.otlp import _fast_raw_span, _raw_span
from marft_lg.trajectories.pipeline import gc_paused
from marft_lg.trajectories.quarantine import Quarantine

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
