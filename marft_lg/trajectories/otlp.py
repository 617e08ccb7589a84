"""Stream spans out of OTLP/JSON-lines files (``ExportTraceServiceRequest`` per line), damage-tolerant.

Each good span comes out as a `RawSpan` (ids normalised to lower-case hex, attributes as Python
values, its source `file:line`); each bad line or span goes to the `Quarantine` with its reason.
Files are read one line at a time, so memory does not grow with the file size; a line longer than
`max_line_bytes` is never held whole: it is skipped in chunks to its newline and quarantined with its `file:line`. A well-formed line is
decoded by `otlp_schema.typed_spans` in one typed pass (msgspec); a line it declines goes through the tolerant
path, which decides every quarantine reason.
"""

from __future__ import annotations

import base64
import binascii
import gzip
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from marft_lg.tracing.files import trace_files
from marft_lg.tracing.otlp_json import decode_any_value as any_value
from marft_lg.trajectories.otlp_schema import typed_spans
from marft_lg.trajectories.quarantine import Quarantine
from marft_lg.trajectories.raw_span import RawSpan

try:  # orjson is ~5x faster on long lines; the standard library is the fallback
    import orjson

    loads_json = orjson.loads
    _JSONError: tuple[type[Exception], ...] = (orjson.JSONDecodeError, ValueError)
except ImportError:  # pragma: no cover
    import json

    loads_json = json.loads
    _JSONError = (ValueError,)

DEFAULT_MAX_ATTRIBUTE_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_LINE_BYTES = 64 * 1024 * 1024  # an exporter's line is ~100 kB; a longer one than this is not read
_READ_BUFFER = 1 << 20  # exporters write long lines (~100 kB for 64 spans): 8 kB reads cost ~1 us a span
_SKIP_CHUNK = 1 << 16  # what `skip_line` holds at a time
_HEX_ID = re.compile("[0-9a-fA-F]+")
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16
_LOWER_HEX = "0123456789abcdef"
_MISSING = object()
_EMPTY: dict[str, Any] = {}


def normalise_id(value: Any, length: int) -> str | None:
    """A trace/span id as lower-case hex of `length` chars; accepts hex or base64 (protobuf JSON); None if unusable."""
    if type(value) is str and len(value) == length and not value.strip(_LOWER_HEX):  # the usual case
        return None if value in (_ZERO_TRACE, _ZERO_SPAN) else value
    if not value or not isinstance(value, str):
        return None
    if len(value) == length and _HEX_ID.fullmatch(value):
        out = value.lower()
    else:
        try:
            raw = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            return None
        if len(raw) * 2 != length:
            return None
        out = raw.hex()
    return None if out in (_ZERO_TRACE, _ZERO_SPAN) else out


def attribute_dict(kvs: list[dict[str, Any]] | None, limit: int | None = None) -> dict[str, Any]:
    """OTLP ``KeyValue`` list -> dict (fast path for strings); raises `_TooLarge` past `limit` chars."""
    if not kvs:
        return {}
    if limit is None:
        try:  # well-formed lists (nearly all): one lookup per key and value
            out = {}
            for kv in kvs:
                v = kv["value"]
                s = v.get("stringValue")
                out[kv["key"]] = any_value(v) if s is None else s
            return out
        except (KeyError, TypeError, AttributeError):
            pass
    out = {}
    for kv in kvs:
        v = kv.get("value") or {}
        s = v.get("stringValue")
        if s is None:
            out[kv.get("key")] = any_value(v)
        else:
            if limit is not None and len(s) > limit:
                raise _TooLarge(str(kv.get("key")))
            out[kv.get("key")] = s
    return out


class _TooLarge(Exception):
    pass


@dataclass(frozen=True, slots=True)
class FileRange:
    """A line-aligned byte range of one trace file (`end` None: to the end); `first_line` numbers its first line."""

    path: Path
    start: int = 0
    end: int | None = None
    first_line: int = 1


def _open(path: Path):
    if path.name.endswith(".gz"):
        return gzip.open(path, "rb")
    return path.open("rb", buffering=_READ_BUFFER)


def iter_raw_spans(
    paths: str | os.PathLike | Iterable[str | os.PathLike] | Iterable[FileRange],
    quarantine: Quarantine,
    *,
    max_attribute_bytes: int = DEFAULT_MAX_ATTRIBUTE_BYTES,
    stats: dict[str, int] | None = None,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
) -> Iterator[RawSpan]:
    """Yield every usable span of every file (or `FileRange`); send unusable lines and spans to `quarantine`."""
    for spans in iter_span_batches(paths, quarantine, max_attribute_bytes=max_attribute_bytes, stats=stats,
                                   max_line_bytes=max_line_bytes):
        yield from spans


def iter_span_batches(
    paths: str | os.PathLike | Iterable[str | os.PathLike] | Iterable[FileRange],
    quarantine: Quarantine,
    *,
    max_attribute_bytes: int = DEFAULT_MAX_ATTRIBUTE_BYTES,
    stats: dict[str, int] | None = None,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
) -> Iterator[Iterable[RawSpan]]:
    """`iter_raw_spans` a line at a time: a well-formed line's spans as a list, any other line's as a generator that
    quarantines as it goes (iterate each before asking for the next, so records keep their order). A line over
    `max_line_bytes` (newline excluded) is skipped unread and quarantined as ``line_too_long``."""
    stats = stats if stats is not None else {}
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    items = list(paths)
    ranges = items if items and all(isinstance(i, FileRange) for i in items) else [FileRange(p) for p in trace_files(items)]
    for unit in ranges:
        path = unit.path
        if unit.start == 0:
            stats["files"] = stats.get("files", 0) + 1
        try:
            fh = _open(path)
        except OSError as exc:
            quarantine.add("invalid_json", f"{path}:0", detail=f"cannot open: {exc}")
            continue
        with fh:
            if unit.start:
                fh.seek(unit.start)
            left = None if unit.end is None else unit.end - unit.start
            lineno = unit.first_line - 1
            while left is None or left > 0:
                try:
                    line = fh.readline(max_line_bytes + 1)  # never more: a longer line is skipped, not held
                    too_long = len(line) > max_line_bytes and not line.endswith(b"\n")
                    size = len(line) + skip_line(fh) if too_long else len(line)
                except (OSError, EOFError) as exc:  # truncated .gz
                    quarantine.add("invalid_json", f"{path}:{lineno + 1}", detail=f"unreadable: {exc}")
                    break
                if not line:
                    break
                if left is not None:
                    left -= size
                lineno += 1
                stats["lines"] = stats.get("lines", 0) + 1
                if too_long:
                    quarantine.add("line_too_long", f"{path}:{lineno}", detail=f"{size} bytes, over max_line_bytes "
                                   f"({max_line_bytes}); skipped unread: raise the limit to mine it")
                    continue
                if line.isspace():  # the same ASCII whitespace as bytes.strip(), without copying the line
                    stats["empty_lines"] = stats.get("empty_lines", 0) + 1
                    continue
                source = f"{path}:{lineno}"
                # no value can be longer than its line: no size check, the typed decoder may read it
                typed = None if len(line) > max_attribute_bytes else typed_spans(line, source)
                if typed is None:
                    yield tolerant_spans_of_line(line, source, quarantine, max_attribute_bytes, stats)
                else:
                    stats["spans_read"] = stats.get("spans_read", 0) + typed[1]
                    yield typed[0]


def skip_line(fh: Any) -> int:
    """Read past the rest of the current line (to its newline or the end) in chunks, never holding it whole;
    returns the bytes skipped."""
    skipped = 0
    while chunk := fh.readline(_SKIP_CHUNK):
        skipped += len(chunk)
        if chunk.endswith(b"\n"):
            break
    return skipped


def _text(line: bytes) -> str:
    return line.decode("utf-8", errors="replace").rstrip("\n")


def tolerant_spans_of_line(line: bytes, source: str, quarantine: Quarantine, limit: int,
                           stats: dict[str, int]) -> Iterator[RawSpan]:
    """A line's usable spans, whatever shape it has (orjson, then checks per span); the rest is quarantined."""
    try:
        request = loads_json(line)
    except _JSONError:
        try:
            line.decode("utf-8")
        except UnicodeDecodeError:  # counted (`non_utf8_lines` in the mining report), then read as below
            stats["non_utf8_lines"] = stats.get("non_utf8_lines", 0) + 1
        try:  # invalid UTF-8 is replaced, as a text-mode read would
            request = loads_json(_text(line))
        except _JSONError as exc:
            quarantine.add("invalid_json", source, detail=str(exc)[:200], raw=_text(line))
            return
    resource_spans = request.get("resourceSpans", request.get("resource_spans")) if isinstance(request, dict) else None
    if not isinstance(resource_spans, list):
        quarantine.add("not_otlp", source, detail="no 'resourceSpans' list", raw=_text(line))
        return
    if len(line) <= limit:  # no value can be longer than its line: skip the per-attribute size check
        limit = None
    trace_ids: dict[Any, str | None] = {}  # spans of one line share few trace ids: normalise (and store) each once
    for rs in resource_spans:
        if rs and not isinstance(rs, dict):
            quarantine.add("not_otlp", source, detail="a resourceSpans entry is not a JSON object", span=rs)
            continue
        scope_spans = (rs or {}).get("scopeSpans", (rs or {}).get("scope_spans")) or []
        if isinstance(scope_spans, int | float):
            quarantine.add("not_otlp", source, detail="scopeSpans is a number, not a list", span=rs)
            continue
        for ss in scope_spans:
            if ss and not isinstance(ss, dict):
                quarantine.add("not_otlp", source, detail="a scopeSpans entry is not a JSON object", span=ss)
                continue
            spans = (ss or {}).get("spans") or []
            if isinstance(spans, int | float):
                quarantine.add("not_otlp", source, detail="spans is a number, not a list", span=ss)
                continue
            stats["spans_read"] = stats.get("spans_read", 0) + len(spans)
            for span in spans:
                try:
                    raw = _raw_span(span, source, quarantine, limit, trace_ids)
                except (AttributeError, TypeError, ValueError, KeyError, IndexError) as exc:  # a field of the wrong shape
                    quarantine.add("not_otlp", source, span=span,
                                   detail=f"malformed span ({type(exc).__name__}: {exc}); OTLP/JSON field types expected")
                    continue
                if raw is not None:
                    yield raw


def _raw_span(span: Any, source: str, quarantine: Quarantine, limit: int | None,
              trace_ids: dict[Any, str | None]) -> RawSpan | None:
    if not isinstance(span, dict):
        quarantine.add("not_otlp", source, detail="a span is not a JSON object", span=span)
        return None
    raw_trace = span.get("traceId", _MISSING)
    if raw_trace is _MISSING:
        raw_trace = span.get("trace_id")
    try:
        trace_id = trace_ids[raw_trace]
    except (KeyError, TypeError):
        trace_id = normalise_id(raw_trace, 32)
        if isinstance(raw_trace, str):
            trace_ids[raw_trace] = trace_id
    raw_span = span.get("spanId", _MISSING)
    span_id = normalise_id(span.get("span_id") if raw_span is _MISSING else raw_span, 16)
    if trace_id is None or span_id is None:
        quarantine.add("missing_id", source, span=span,
                       detail=f"traceId={span.get('traceId')!r} spanId={span.get('spanId')!r}; ids must be hex (or base64)")
        return None
    start, end = span.get("startTimeUnixNano", _MISSING), span.get("endTimeUnixNano", _MISSING)
    try:
        start = int(span.get("start_time_unix_nano") if start is _MISSING else start)
        end = int(span.get("end_time_unix_nano") if end is _MISSING else end)
    except (TypeError, ValueError):
        quarantine.add("bad_time", source, span=span, trace_id=trace_id, span_id=span_id,
                       detail="startTimeUnixNano/endTimeUnixNano missing or not integers")
        return None
    if end < start:
        quarantine.add("end_before_start", source, span=span, trace_id=trace_id, span_id=span_id,
                       detail=f"end {end} < start {start}")
        return None
    try:
        attributes = attribute_dict(span.get("attributes"), limit)
    except _TooLarge as big:
        quarantine.add("attribute_too_large", source, span=span, trace_id=trace_id, span_id=span_id,
                       detail=f"attribute {big.args[0]!r} exceeds {limit} bytes; raise max_attribute_bytes to keep it")
        return None
    parent = span.get("parentSpanId", _MISSING)
    if parent is _MISSING:
        parent = span.get("parent_span_id")
    parent_id = normalise_id(parent, 16) if parent else None
    status = span.get("status") or _EMPTY
    code = status.get("code")
    events = span.get("events")
    return RawSpan(
        trace_id=trace_id,
        span_id=span_id,
        parent_id=parent_id,
        name=str(span.get("name") or ""),
        start_ns=start,
        end_ns=end,
        attributes=attributes,
        error=code in (2, "2", "STATUS_CODE_ERROR", "ERROR"),
        status_message=str(status.get("message") or ""),
        events=[{"name": e.get("name"), "attributes": attribute_dict(e.get("attributes"))} for e in events
                if isinstance(e, dict)] if events else [],
        source=source,
    )
