"""Finished spans still in memory (a wrapped app's `SpanRecord`s, or SDK `ReadableSpan`s) -> `RawSpan`s, holding
exactly what reading them back from an OTLP/JSON file would give, without writing or parsing any JSON."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from marft_lg.tracing.otlp_json import any_value as encode_any_value
from marft_lg.tracing.records import STATUS_ERROR, SpanRecord
from marft_lg.trajectories.otlp import any_value
from marft_lg.trajectories.pipeline import RawSpans
from marft_lg.trajectories.raw_span import RawSpan

SOURCE = "memory"


def raw_spans(spans: Iterable[Any]) -> RawSpans:
    """The spans as the file reader would give them back (see `_value` for attribute values)."""
    return RawSpans(_record(s) if type(s) is SpanRecord else _sdk_span(s) for s in spans)


def _record(r: SpanRecord) -> RawSpan:
    events = [{"name": name, "attributes": _attributes(attrs)} for _, name, attrs in r.events or ()]
    return RawSpan(f"{r.trace_id:032x}", f"{r.span_id:016x}", f"{r.parent_id:016x}" if r.parent_id else None, r.name,
                   r.start_ns, r.end_ns or r.start_ns, _attributes(r.attributes), r.status_code == STATUS_ERROR,
                   r.status_message or "", events, SOURCE)


def _sdk_span(span: Any) -> RawSpan:
    """An OpenTelemetry SDK `ReadableSpan` (the user's own instrumentation, routed through the sink)."""
    ctx, parent = span.context, span.parent
    events = [{"name": e.name, "attributes": _attributes(e.attributes or {})} for e in span.events]
    status = span.status
    return RawSpan(f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}", f"{parent.span_id:016x}" if parent else None,
                   span.name or "", span.start_time, span.end_time or span.start_time, _attributes(span.attributes or {}),
                   status.status_code.value == STATUS_ERROR, status.description or "", events, SOURCE)


def _attributes(attrs: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _value(v) for k, v in attrs.items() if v is not None}


def _value(v: Any) -> Any:
    """What an attribute value reads back as from OTLP/JSON: text, integers, booleans and finite floats as they
    are, sequences as lists, anything else through its OTLP ``AnyValue``."""
    kind = type(v)
    if kind is str or kind is int or kind is bool or (kind is float and math.isfinite(v)):
        return v
    if kind is list or kind is tuple:
        return [_value(x) for x in v]
    return any_value(encode_any_value(v))
