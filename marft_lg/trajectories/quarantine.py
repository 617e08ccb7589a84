"""Quarantine: where every span or line that mining could not use is written, with its reason and source.

Nothing is dropped silently: a quarantined record keeps the original span (or raw line), so it can
be inspected, repaired and mined again.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import IO, Any

# reason -> what it means (also the legend of the `marft-lg mine` summary)
REASONS: dict[str, str] = {
    "invalid_json": "the line is not JSON (garbage or a truncated write)",
    "line_too_long": "the line is longer than max_line_bytes; skipped in chunks, never read whole",
    "not_otlp": "valid JSON but not an OTLP/JSON ExportTraceServiceRequest",
    "missing_id": "the span has no usable traceId/spanId",
    "bad_time": "start/end time missing or not an integer",
    "end_before_start": "the span ends before it starts (clock or exporter bug)",
    "attribute_too_large": "an attribute value is larger than max_attribute_bytes",
    "duplicate": "the same (traceId, spanId) was already read; the first copy is used",
    "tool_without_action": "a tool span with no LLM call in its episode that could have issued it",
    "feedback_without_episode": "a feedback span whose episode id is not in the mined input",
    "bad_feedback": "a feedback span without a name or an episode id",
}


FIRST_SOURCES = 3  # `file:line`s kept in memory per reason: what a summary can name without the quarantine file


class Quarantine:
    """Collects unusable input; writes it as JSON lines when given a path, and always counts reasons and keeps the
    first `FIRST_SOURCES` sources of each (so a caller without a quarantine file can still name them)."""

    def __init__(self, path: str | Path | None = None, *, keep_raw_bytes: int = 64 * 1024 * 1024):
        self.path = Path(path) if path is not None else None
        self.counts: Counter[str] = Counter()
        self.first: dict[str, list[str]] = {}
        self._file: IO[str] | None = None
        self._keep_raw_bytes = keep_raw_bytes

    def add(self, reason: str, source: str, *, detail: str = "", span: Any = None, raw: str | None = None,
            trace_id: str | None = None, span_id: str | None = None) -> None:
        """Record one unusable item. `span` is the original OTLP span dict; `raw` the raw line when unparsable."""
        self.counts[reason] += 1
        first = self.first.setdefault(reason, [])
        if len(first) < FIRST_SOURCES:
            first.append(source)
        if self.path is None:
            return
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        record: dict[str, Any] = {"reason": reason, "source": source}
        if detail:
            record["detail"] = detail
        if trace_id:
            record["trace_id"] = trace_id
        if span_id:
            record["span_id"] = span_id
        if span is not None:
            record["span"] = span
        if raw is not None:
            record["raw"] = raw[: self._keep_raw_bytes]
        self._file.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")

    def merge(self, counts: dict[str, int], first: dict[str, list[str]]) -> None:
        """Add another quarantine's tallies (a mining worker's) to this one's."""
        self.counts.update(counts)
        for reason, sources in first.items():
            mine = self.first.setdefault(reason, [])
            mine.extend(sources[:FIRST_SOURCES - len(mine)])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> Quarantine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def total(self) -> int:
        return sum(self.counts.values())
