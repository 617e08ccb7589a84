"""Read OTLP/JSON-lines trace files back into flat span dicts, each as the file holds it (kind, status, resource,
file:line): for looking at traces and testing them. Mining has its own streaming reader (`trajectories.otlp`);
both decode attribute values with the one `decode_any_value`."""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterable, Iterator
from typing import Any

from marft_lg.tracing.files import trace_files
from marft_lg.tracing.otlp_json import decode_any_value


def attributes(kvs: Iterable[dict[str, Any]] | None) -> dict[str, Any]:
    """OTLP ``KeyValue`` list -> plain dict."""
    return {kv["key"]: decode_any_value(kv.get("value", {})) for kv in kvs or []}


def iter_spans(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> Iterator[dict[str, Any]]:
    """Yield every span as ``{trace_id, span_id, parent_span_id, name, kind, start_ns, end_ns, attributes,
    status_code, status_message, events, resource, file, line}``; a bad line raises with file and line."""
    for path in trace_files(paths):
        with (gzip.open(path, "rt", encoding="utf-8") if path.name.endswith(".gz") else open(path, encoding="utf-8")) as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    request = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{lineno}: not a JSON line ({exc}); a partial write? remove the line") from exc
                for rs in request.get("resourceSpans", []):
                    resource = attributes(rs.get("resource", {}).get("attributes"))
                    for ss in rs.get("scopeSpans", []):
                        for s in ss.get("spans", []):
                            status = s.get("status") or {}
                            yield {
                                "trace_id": s.get("traceId", ""),
                                "span_id": s.get("spanId", ""),
                                "parent_span_id": s.get("parentSpanId") or None,
                                "name": s.get("name", ""),
                                "kind": int(s.get("kind", 0)),
                                "start_ns": int(s.get("startTimeUnixNano", 0)),
                                "end_ns": int(s.get("endTimeUnixNano", 0)),
                                "attributes": attributes(s.get("attributes")),
                                "status_code": int(status.get("code", 0)),
                                "status_message": status.get("message", ""),
                                "events": [
                                    {"name": e.get("name"), "attributes": attributes(e.get("attributes"))}
                                    for e in s.get("events", [])
                                ],
                                "resource": resource,
                                "file": str(path),
                                "line": lineno,
                            }


def read_spans(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[dict[str, Any]]:
    """All spans in the given files/directories, sorted by start time."""
    return sorted(iter_spans(paths), key=lambda s: (s["start_ns"], s["end_ns"]))
