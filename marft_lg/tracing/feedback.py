"""Attach an outcome to an episode after the fact (a thumbs-up hours later, a resolved ticket).

Each call writes one ``marft.feedback`` span (its own trace, no parent) into ``trace_dir`` with the
episode id, the feedback name and value; mining joins it to the episode by ``marft.episode.id``
(the latest value of a name wins).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import threading
from pathlib import Path
from typing import Any

from marft_lg.tracing import attributes as A
from marft_lg.tracing.provider import TraceSink, make_sink

_sinks: dict[Path, TraceSink] = {}
_lock = threading.Lock()


def _sink(trace_dir: str | os.PathLike) -> TraceSink:
    key = Path(trace_dir).resolve()
    with _lock:
        if key not in _sinks:
            _sinks[key] = make_sink(key, batch=False, file_prefix="feedback")
        return _sinks[key]


def record_feedback(
    episode_id: str,
    name: str,
    value: float | int | bool | str,
    *,
    trace_dir: str | os.PathLike = "traces",
    comment: str | None = None,
    metadata: dict[str, Any] | None = None,
) -> None:
    """Write feedback `name`=`value` for `episode_id` to ``trace_dir`` (flushed before returning)."""
    if not episode_id or not isinstance(episode_id, str):
        raise ValueError(f"record_feedback: episode_id must be a non-empty string, got {episode_id!r}")
    if not name or not isinstance(name, str):
        raise ValueError(f"record_feedback: name must be a non-empty string, got {name!r}")
    if not isinstance(value, bool | int | float | str):
        raise TypeError(
            f"record_feedback: value for {name!r} must be a number, bool or string, got {type(value).__name__}; "
            "serialise richer feedback to a string (e.g. JSON)"
        )
    attrs: dict[str, Any] = {
        A.MARFT_EPISODE_ID: episode_id,
        A.MARFT_FEEDBACK_NAME: name,
        A.MARFT_FEEDBACK_VALUE: value,
        A.MARFT_FEEDBACK_TIME: dt.datetime.now(dt.UTC).isoformat(),
    }
    if comment:
        attrs[A.MARFT_FEEDBACK_COMMENT] = comment
    if metadata:
        attrs[A.MARFT_FEEDBACK_METADATA] = json.dumps(metadata, ensure_ascii=False, default=str)
    sink = _sink(trace_dir)
    sink.tracer.start_span(A.FEEDBACK_SPAN_NAME, attributes=attrs).end()
    sink.flush()
