"""Encode spans (SDK spans or `SpanRecord`s) as OTLP/JSON ``ExportTraceServiceRequest`` lines (hex ids, as OTLP/JSON requires).

Written by hand rather than through protobuf so the file exporter needs no protobuf runtime and
stays cheap: one dict per span, one JSON line per export batch.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from itertools import islice
from json.encoder import encode_basestring
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan

# OTLP enum values (the Python SDK's SpanKind starts at 0 = INTERNAL; OTLP's at 1).
_OTLP_KIND = {0: 1, 1: 2, 2: 3, 3: 4, 4: 5}


def decode_any_value(v: dict[str, Any]) -> Any:
    """OTLP ``AnyValue`` -> a Python value: the one decoder, for mining and for `read_spans` (an int64 sent as
    decimal text becomes an int, arrays lists, kvlists dicts; bytes stay the base64 text the file holds)."""
    if "stringValue" in v:
        return v["stringValue"]
    if "intValue" in v:
        try:
            return int(v["intValue"])
        except (TypeError, ValueError):
            return v["intValue"]
    if "doubleValue" in v:
        return float(v["doubleValue"])
    if "boolValue" in v:
        return bool(v["boolValue"])
    if "arrayValue" in v:
        return [decode_any_value(x) for x in (v["arrayValue"] or {}).get("values", [])]
    if "kvlistValue" in v:
        return {kv.get("key"): decode_any_value(kv.get("value") or {})
                for kv in (v["kvlistValue"] or {}).get("values", [])}
    if "bytesValue" in v:
        return v["bytesValue"]
    return None


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


# -- the fast path: SpanRecords straight to OTLP/JSON text ---------------------------------------
# Produces the same bytes `dumps_request` writes for the equivalent SDK spans (compact separators,
# ``ensure_ascii=False``), without building the intermediate dicts.
_str = encode_basestring
_FLOAT_SPECIAL = {float("inf"): "Infinity", float("-inf"): "-Infinity"}


def _float_json(value: float) -> str:
    if value != value:
        return "NaN"
    return _FLOAT_SPECIAL.get(value) or float.__repr__(value)


def value_json(value: Any) -> str:
    """One attribute value -> OTLP/JSON ``AnyValue`` text."""
    kind = type(value)
    if kind is str:
        return '{"stringValue":' + _str(value) + "}"
    if kind is int:
        return '{"intValue":"' + int.__repr__(value) + '"}'
    if kind is float:
        return '{"doubleValue":' + _float_json(value) + "}"
    if kind is bool:
        return '{"boolValue":true}' if value else '{"boolValue":false}'
    if kind is list or kind is tuple:
        return '{"arrayValue":{"values":[' + ",".join(value_json(v) for v in value) + "]}}"
    return json.dumps(any_value(value), ensure_ascii=False, separators=(",", ":"))


def attributes_json(attributes: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> str:
    """Attributes -> the text of an OTLP ``KeyValue`` list (without brackets); None values are skipped.

    Short string values repeat across spans (episode id, agent, model, operation, ...): their
    KeyValue text is remembered per attribute name (a few dozen values each) and reused.
    """
    parts = []
    append = parts.append
    for k, v in attributes.items() if isinstance(attributes, Mapping) else attributes:
        kind = type(v)
        if kind is str:
            if len(v) > 128:  # long texts (messages, token ids) are unique: not worth remembering
                append(_head(k) + '{"stringValue":' + _str(v) + "}}")
                continue
            memo = _MEMO.get(k)
            if memo is None:
                if len(_MEMO) >= 4096:
                    _MEMO.clear()
                memo = _MEMO[k] = {}
            text = memo.get(v)
            if text is None:
                if len(memo) >= 64:
                    memo.clear()
                text = memo[v] = _head(k) + '{"stringValue":' + _str(v) + "}}"
            append(text)
        elif kind is int:
            append(_head(k) + '{"intValue":"' + int.__repr__(v) + '"}}')
        elif kind is float and v - v == 0.0:  # finite
            append(_head(k) + '{"doubleValue":' + float.__repr__(v) + "}}")
        elif v is not None:
            append(_head(k) + value_json(v) + "}")
    return ",".join(parts)


class _Heads(dict):
    """``key -> '{"key":<key>,"value":'`` (bounded)."""

    def __missing__(self, key: str) -> str:
        head = '{"key":' + _str(key) + ',"value":'
        if len(self) < 4096:
            self[key] = head
        return head


_head = _Heads().__getitem__
_MEMO: dict[str, dict[str, str]] = {}  # attribute name -> {short string value: its KeyValue text}


def record_attributes_json(record: Any) -> str:
    """A record's attributes as `attributes_json` text; its `AttrGroup` prefix is encoded once per group."""
    group = record.group
    if group is None:
        return attributes_json(record.attributes)
    text = group.text
    if text is None:
        text = group.text = attributes_json(group.attrs)
    rest = attributes_json(islice(record.attributes.items(), len(group.attrs), None))
    if not text:
        return rest
    return text + "," + rest if rest else text


def encode_record(record: Any) -> str:
    """One `SpanRecord` -> OTLP/JSON ``Span`` text."""
    parent = f'"{record.parent_id:016x}"' if record.parent_id else '""'
    status = (f'{{"code":{record.status_code},"message":{_str(record.status_message)}}}' if record.status_message
              else f'{{"code":{record.status_code}}}')
    events = ""
    if record.events:
        events = ',"events":[' + ",".join(
            f'{{"timeUnixNano":"{ts}","name":{_str(name)},"attributes":[{attributes_json(attrs)}]}}'
            for ts, name, attrs in record.events) + "]"
    return (f'{{"traceId":"{record.trace_id:032x}","spanId":"{record.span_id:016x}","parentSpanId":{parent},'
            f'"name":{_str(record.name)},"kind":{record.kind},"startTimeUnixNano":"{record.start_ns}",'
            f'"endTimeUnixNano":"{record.end_ns or record.start_ns}","attributes":[{record_attributes_json(record)}],'
            f'"status":{status}{events}}}')


def request_frame(resource: Any, scope_name: str, scope_version: str | None = None) -> tuple[str, str]:
    """The text before and after the span list of a one-resource, one-scope ``ExportTraceServiceRequest``."""
    head = ('{"resourceSpans":[{"resource":{"attributes":'
            + json.dumps(key_values(resource.attributes if resource else {}), ensure_ascii=False, separators=(",", ":"))
            + '},"scopeSpans":[{"scope":{"name":' + _str(scope_name) + ',"version":' + _str(scope_version or "")
            + '},"spans":[')
    return head, "]}]}]}"


def dumps_records(encoded_spans: Sequence[str], frame: tuple[str, str]) -> str:
    """Already encoded spans -> one compact ``ExportTraceServiceRequest`` line (no trailing newline)."""
    return frame[0] + ",".join(encoded_spans) + frame[1]
