"""Typed one-pass decoding of well-formed OTLP/JSON lines (msgspec): the fast path of `otlp`'s reader.

`typed_spans(line, source)` decodes a whole ``ExportTraceServiceRequest`` line straight into span
structs, in C, and returns its `RawSpan`s; it returns None for any line that does not fit the schema
exactly (unknown or snake_case keys, other types, nulls where OTLP has values) or that holds a span the
tolerant reader would treat specially (ids that are not lower-case hex, bad times, numbers orjson would
read as floats). `otlp` then reads that line with its tolerant orjson path, so every quarantine reason,
`file:line` source and kept span is decided in one place.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, Struct, UnsetType

from marft_lg.trajectories.raw_span import RawSpan

_LOWER_HEX = "0123456789abcdef"
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16
_ERROR_CODES = (2, "2", "STATUS_CODE_ERROR", "ERROR")
_INT_MIN, _INT_END = -(2**63), 2**64  # outside this orjson reads a JSON integer as a float


class _Reject(Exception):
    """The line is left to the tolerant reader."""


class _KeyValue(Struct, forbid_unknown_fields=True, gc=False):
    key: str
    value: _AnyValue


class _ArrayValue(Struct, forbid_unknown_fields=True, gc=False):
    values: list[_AnyValue] = []


class _KeyValueList(Struct, forbid_unknown_fields=True, gc=False):
    values: list[_KeyValue] = []


class _AnyValue(Struct, forbid_unknown_fields=True, gc=False, rename="camel"):
    string_value: str | UnsetType = UNSET
    int_value: int | str | UnsetType = UNSET
    double_value: float | UnsetType = UNSET
    bool_value: bool | UnsetType = UNSET
    array_value: _ArrayValue | UnsetType = UNSET
    kvlist_value: _KeyValueList | UnsetType = UNSET
    bytes_value: str | UnsetType = UNSET


class _Status(Struct, forbid_unknown_fields=True, gc=False):
    code: int | str | UnsetType = UNSET
    message: str | UnsetType = UNSET


class _Event(Struct, forbid_unknown_fields=True, gc=False, rename="camel"):
    name: str | None = None
    attributes: list[_KeyValue] | None = None
    time_unix_nano: Any = None
    dropped_attributes_count: Any = None


class _Span(Struct, forbid_unknown_fields=True, gc=False, rename="camel"):
    trace_id: str
    span_id: str
    parent_span_id: str
    start_time_unix_nano: int | str
    end_time_unix_nano: int | str
    name: str | None = None
    attributes: list[_KeyValue] | None = None
    status: _Status | None = None
    events: list[_Event] | None = None
    kind: Any = None
    trace_state: Any = None
    flags: Any = None
    links: Any = None
    dropped_attributes_count: Any = None
    dropped_events_count: Any = None
    dropped_links_count: Any = None


class _ScopeSpans(Struct, forbid_unknown_fields=True, gc=False, rename="camel"):
    spans: list[_Span]
    scope: Any = None
    schema_url: Any = None


class _ResourceSpans(Struct, forbid_unknown_fields=True, gc=False, rename="camel"):
    scope_spans: list[_ScopeSpans]
    resource: Any = None
    schema_url: Any = None


class _Request(Struct, forbid_unknown_fields=True, gc=False, rename="camel"):
    resource_spans: list[_ResourceSpans]


_decode = msgspec.json.Decoder(_Request).decode
_DECODE_ERRORS = (msgspec.MsgspecError, ValueError, RecursionError)


def typed_spans(line: bytes, source: str) -> tuple[list[RawSpan], int] | None:
    """(the line's spans, how many spans it holds) when every span is well-formed; None: read it tolerantly."""
    try:
        request = _decode(line)
        out: list[RawSpan] = []
        trace_ids: dict[str, str] = {}  # one string per trace id of the line
        n = 0
        for rs in request.resource_spans:
            for ss in rs.scope_spans:
                n += len(ss.spans)
                for span in ss.spans:
                    out.append(_raw_span(span, source, trace_ids))
        return out, n
    except (_Reject, *_DECODE_ERRORS):
        return None


def _raw_span(span: _Span, source: str, trace_ids: dict[str, str]) -> RawSpan:
    trace_id = trace_ids.get(span.trace_id)
    if trace_id is None:
        trace_id = span.trace_id
        if len(trace_id) != 32 or trace_id.strip(_LOWER_HEX) or trace_id == _ZERO_TRACE:
            raise _Reject
        trace_ids[trace_id] = trace_id
    span_id = span.span_id
    if len(span_id) != 16 or span_id.strip(_LOWER_HEX) or span_id == _ZERO_SPAN:
        raise _Reject
    parent: str | None = span.parent_span_id
    if parent:
        if len(parent) != 16 or parent.strip(_LOWER_HEX):
            raise _Reject
        if parent == _ZERO_SPAN:
            parent = None
    else:
        parent = None
    start, end = span.start_time_unix_nano, span.end_time_unix_nano
    if type(start) is not str or type(end) is not str:
        start, end = _time(start), _time(end)
    else:  # OTLP/JSON writes 64-bit integers as strings
        try:
            start, end = int(start), int(end)
        except ValueError:
            raise _Reject from None
    if end < start:
        raise _Reject
    attributes: dict[str, Any] = {}
    if span.attributes:
        for kv in span.attributes:
            v = kv.value
            s = v.string_value
            if s is UNSET:
                s = v.int_value  # `_value`, inlined for the usual non-negative integer written as a string
                s = int(s) if type(s) is str and s.isdigit() and s.isascii() else _value(v)
            attributes[kv.key] = s
    status = span.status
    events = [{"name": e.name, "attributes": _attributes(e.attributes)} for e in span.events] if span.events else []
    if status is None:
        return RawSpan(trace_id, span_id, parent, span.name or "", start, end, attributes, False, "", events, source)
    return RawSpan(trace_id, span_id, parent, span.name or "", start, end, attributes, status.code in _ERROR_CODES,
                   status.message or "", events, source)


def _time(value: int | str) -> int:
    if type(value) is int:
        if not _INT_MIN <= value < _INT_END:
            raise _Reject
        return value
    try:
        return int(value)
    except ValueError:
        raise _Reject from None


def _attributes(kvs: list[_KeyValue] | None) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs} if kvs else {}


def _value(v: _AnyValue) -> Any:
    """`otlp.any_value` of a typed ``AnyValue`` (same order of precedence)."""
    if v.string_value is not UNSET:
        return v.string_value
    if v.int_value is not UNSET:
        i = v.int_value
        if type(i) is int:
            if not _INT_MIN <= i < _INT_END:
                raise _Reject
            return i
        try:
            return int(i)
        except ValueError:
            return i
    if v.double_value is not UNSET:
        return v.double_value
    if v.bool_value is not UNSET:
        return v.bool_value
    if v.array_value is not UNSET:
        return [_value(x) for x in v.array_value.values]
    if v.kvlist_value is not UNSET:
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    if v.bytes_value is not UNSET:
        return v.bytes_value
    return None
