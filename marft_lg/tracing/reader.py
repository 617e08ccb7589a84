"""Read OTLP/JSON-lines trace files back into flat span dicts, each as the file holds it (kind, status, resource,
file:line): for looking at traces and testing them. Mining has its own streaming reader (`trajectories.otlp`);
both decode attribute values with the one `decode_any_value`."""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterable, Iterator
from typing import Any

from marft_lg._durable import write_atomic
from marft_lg.tracing.attributes import MARFT_EPISODE_ID
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


def drop_episodes(folder: str | os.PathLike, episode_ids: Iterable[str]) -> int:
    """Rewrite the plain trace files under `folder` (when it exists) without the spans of `episode_ids` and of the
    traces they are in, durably; returns how many spans went. What an abandoned attempt of an episode left behind
    (a rollout worker that died mid-share) must not be mined beside its retry. Lines that do not parse stay."""
    ids = set(episode_ids)
    files = [p for p in trace_files(folder) if not p.name.endswith(".gz")] if ids and os.path.isdir(folder) else []
    contents = {path: [_request(line) for line in path.read_bytes().splitlines(keepends=True)] for path in files}
    traces = {s.get("traceId", "") for requests in contents.values() for _, r in requests for s in _spans(r)
              if _episode_of(s) in ids}
    dropped = 0
    for path, requests in contents.items():
        lines, lost = [], 0
        for line, request in requests:
            n = sum(1 for s in _spans(request) if s.get("traceId", "") in traces)
            lost += n
            lines.append(line if not n else _with_spans(request, traces))
        if lost:
            write_atomic(path, b"".join(lines))
            dropped += lost
    return dropped


def _request(line: bytes) -> tuple[bytes, dict[str, Any] | None]:
    """A line and its ``ExportTraceServiceRequest`` (None when it does not parse as one)."""
    try:
        request = json.loads(line)
    except ValueError:
        return line, None
    return line, request if isinstance(request, dict) else None


def _spans(request: dict[str, Any] | None) -> Iterator[dict[str, Any]]:
    for rs in (request or {}).get("resourceSpans", []):
        for ss in rs.get("scopeSpans", []):
            yield from ss.get("spans", [])


def _episode_of(span: dict[str, Any]) -> Any:
    return next((kv.get("value", {}).get("stringValue") for kv in span.get("attributes", [])
                 if kv.get("key") == MARFT_EPISODE_ID), None)


def _with_spans(request: dict[str, Any], traces: set[str]) -> bytes:
    """The request as a line without the spans of `traces` (b"" when none is left)."""
    for rs in request["resourceSpans"]:
        for ss in rs.get("scopeSpans", []):
            ss["spans"] = [s for s in ss.get("spans", []) if s.get("traceId", "") not in traces]
        rs["scopeSpans"] = [ss for ss in rs.get("scopeSpans", []) if ss["spans"]]
    request["resourceSpans"] = [rs for rs in request["resourceSpans"] if rs["scopeSpans"]]
    if not request["resourceSpans"]:
        return b""
    return json.dumps(request, separators=(",", ":"), ensure_ascii=False).encode("utf-8") + b"\n"
