"""Encode SDK spans as OTLP/JSON ``ExportTraceServiceRequest`` objects (hex ids, as OTLP/JSON requires).

Written by hand rather than through protobuf so the file exporter needs no protobuf runtime and
stays cheap: one dict per span, one JSON line per export batch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan

# OTLP enum values (the Python SDK's SpanKind starts at 0 = INTERNAL; OTLP's at 1).
_OTLP_KIND = {0: 1, 1: 2, 2: 3, 3: 4, 4: 5}


def any_value(value: Any) -> dict[str, Any]:
    """A Python attribute value -> OTLP ``AnyValue`` (int64 as a decimal string, per proto3 JSON)."""
    kind = type(value)
    if kind is str:
        return {"stringValue": value}
    if kind is int:
        return {"intValue": str(value)}
    if kind is float:
        return {"doubleValue": value}
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value}
    if isinstance(value, str):
        return {"stringValue": value}
    if isinstance(value, bytes):
        import base64

        return {"bytesValue": base64.b64encode(value).decode("ascii")}
    if isinstance(value, Mapping):
        return {"kvlistValue": {"values": key_values(value)}}
    if isinstance(value, Sequence):
        return {"arrayValue": {"values": [any_value(v) for v in value]}}
    return {"stringValue": str(value)}


def key_values(attributes: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """Attributes -> OTLP ``KeyValue`` list."""
    return [{"key": k, "value": any_value(v)} for k, v in (attributes or {}).items()]


def encode_span(span: ReadableSpan) -> dict[str, Any]:
    """One SDK span -> OTLP/JSON ``Span``."""
    ctx = span.context
    out: dict[str, Any] = {
        "traceId": format(ctx.trace_id, "032x"),
        "spanId": format(ctx.span_id, "016x"),
        "parentSpanId": format(span.parent.span_id, "016x") if span.parent is not None else "",
        "name": span.name,
        "kind": _OTLP_KIND.get(span.kind.value, 0),
        "startTimeUnixNano": str(span.start_time or 0),
        "endTimeUnixNano": str(span.end_time or span.start_time or 0),
        "attributes": key_values(span.attributes),
        "status": {"code": span.status.status_code.value},
    }
    if span.status.description:
        out["status"]["message"] = span.status.description
    if span.events:
        out["events"] = [
            {"timeUnixNano": str(e.timestamp), "name": e.name, "attributes": key_values(e.attributes)} for e in span.events
        ]
    if span.links:
        out["links"] = [
            {
                "traceId": format(link.context.trace_id, "032x"),
                "spanId": format(link.context.span_id, "016x"),
                "attributes": key_values(link.attributes),
            }
            for link in span.links
        ]
    return out


def encode_request(spans: Sequence[ReadableSpan]) -> dict[str, Any]:
    """Spans -> one ``ExportTraceServiceRequest`` grouped by resource and instrumentation scope."""
    by_resource: dict[int, tuple[Any, dict[tuple[str, str], list[dict[str, Any]]]]] = {}
    for span in spans:
        res_key = id(span.resource)
        if res_key not in by_resource:
            by_resource[res_key] = (span.resource, {})
        scope = span.instrumentation_scope
        scope_key = (scope.name if scope else "", (scope.version or "") if scope else "")
        by_resource[res_key][1].setdefault(scope_key, []).append(encode_span(span))
    resource_spans = []
    for resource, scopes in by_resource.values():
        resource_spans.append(
            {
                "resource": {"attributes": key_values(resource.attributes if resource else {})},
                "scopeSpans": [
                    {"scope": {"name": name, "version": version}, "spans": encoded}
                    for (name, version), encoded in scopes.items()
                ],
            }
        )
    return {"resourceSpans": resource_spans}


def dumps_request(spans: Sequence[ReadableSpan]) -> str:
    """Spans -> one compact JSON line (no trailing newline)."""
    return json.dumps(encode_request(spans), ensure_ascii=False, separators=(",", ":"))
