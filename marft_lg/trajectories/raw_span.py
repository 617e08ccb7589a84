"""`RawSpan`: one span as read from a trace file, before any format-specific interpretation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class RawSpan:
    """One span as read from the file, before any format-specific interpretation."""

    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    error: bool = False
    status_message: str = ""
    events: list[dict[str, Any]] = field(default_factory=list)
    source: str = ""
