"""Span records: the cheap form the recorder writes spans in (no OpenTelemetry SDK span per step).

A `SpanRecord` holds exactly what an OTLP span carries (ids, name, kind, times, attributes,
status, events). The JSON-lines writer encodes records straight to OTLP/JSON
(`otlp_json.dumps_records`); `to_readable` turns one into an SDK `ReadableSpan` for the OTLP
endpoint and user-supplied exporters.
"""

from __future__ import annotations

import random
import time
import traceback
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

# OTLP enum values (what the file carries): SpanKind INTERNAL=1, SERVER=2, CLIENT=3; Status UNSET=0, OK=1, ERROR=2.
KIND_INTERNAL = 1
KIND_SERVER = 2
KIND_CLIENT = 3
STATUS_UNSET = 0
STATUS_OK = 1
STATUS_ERROR = 2

_rand = random.getrandbits
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)


def new_trace_id() -> int:
    """A random non-zero 128-bit trace id (as the SDK's `RandomIdGenerator` makes them)."""
    while True:
        value = _rand(128)
        if value:
            return value


def new_span_id() -> int:
    """A random non-zero 64-bit span id."""
    while True:
        value = _rand(64)
        if value:
            return value


class AttrGroup:
    """Attributes several spans start with (one LangGraph task's), encoded to OTLP/JSON once for all of them."""

    __slots__ = ("attrs", "text")

    def __init__(self, attrs: dict[str, Any]):
        self.attrs = attrs
        self.text: str | None = None  # filled by the encoder on first use


class SpanRecord:
    """One span as plain data; `attributes` is a dict of OTel attribute values (None values are skipped).

    `group`: an `AttrGroup` whose items are the first items of `attributes`, unchanged (whoever
    changes one of them sets `group` to None); the encoder then reuses the group's text.
    """

    __slots__ = ("trace_id", "span_id", "parent_id", "name", "kind", "start_ns", "end_ns", "attributes",
                 "status_code", "status_message", "events", "group")

    def __init__(self, trace_id: int, parent_id: int, name: str, kind: int, attributes: dict[str, Any]):
        self.trace_id = trace_id
        self.span_id = _rand(64) or new_span_id()
        self.parent_id = parent_id  # 0: a root span
        self.name = name
        self.kind = kind
        self.start_ns = time.time_ns()
        self.end_ns = 0
        self.attributes = attributes
        self.status_code = STATUS_UNSET
        self.status_message = ""
        self.events: list[tuple[int, str, dict[str, Any]]] | None = None
        self.group: AttrGroup | None = None

    def set_status(self, code: int, message: str = "") -> None:
        """Set the status as the SDK does: OK is final; a message is kept only with ERROR."""
        if self.status_code == STATUS_OK:
            return
        self.status_code = code
        self.status_message = message if code == STATUS_ERROR else ""

    def record_exception(self, error: BaseException) -> None:
        """Add the ``exception`` event with the same attributes as the SDK's `Span.record_exception`."""
        module = type(error).__module__
        qualname = type(error).__qualname__
        attrs = {
            "exception.type": f"{module}.{qualname}" if module and module != "builtins" else qualname,
            "exception.message": str(error),
            "exception.stacktrace": "".join(traceback.format_exception(error)),
            "exception.escaped": "False",
        }
        if self.events is None:
            self.events = []
        self.events.append((time.time_ns(), "exception", attrs))

    def end(self) -> None:
        if not self.end_ns:
            self.end_ns = time.time_ns()


def _sdk_value(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def to_readable(record: SpanRecord, resource: Resource, scope: InstrumentationScope) -> ReadableSpan:
    """A record as an SDK `ReadableSpan` (for `SpanExporter`s such as the OTLP/HTTP one)."""
    context = SpanContext(record.trace_id, record.span_id, is_remote=False, trace_flags=_SAMPLED)
    parent = (SpanContext(record.trace_id, record.parent_id, is_remote=False, trace_flags=_SAMPLED)
              if record.parent_id else None)
    attributes = {k: _sdk_value(v) for k, v in record.attributes.items() if v is not None}
    events = [Event(name, {k: _sdk_value(v) for k, v in attrs.items()}, timestamp=ts)
              for ts, name, attrs in record.events or ()]
    status = Status(StatusCode(record.status_code), record.status_message or None)
    return ReadableSpan(
        name=record.name,
        context=context,
        parent=parent,
        resource=resource,
        attributes=attributes,
        events=events,
        kind=SpanKind(record.kind - 1),
        status=status,
        start_time=record.start_ns,
        end_time=record.end_ns or record.start_ns,
        instrumentation_scope=scope,
    )
