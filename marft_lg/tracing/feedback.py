"""Attach an outcome to an episode after the fact (a thumbs-up hours later, a resolved ticket, an approval).

Each call writes one ``marft.feedback`` span (its own trace, no parent) into ``trace_dir`` with the feedback name
and value and what it is about: an episode id, a LangGraph thread id (the product's conversation id; `turn` picks
one of the thread's episodes by start, default the last one that started before the feedback), or a trace id of
the episode. Mining joins it to its episode (the latest value of a name wins); feedback that names no mined episode
is quarantined with the reason. `record_feedback_file` records a JSONL file of such lines; `marft-lg serve` takes
the same object on ``POST /v1/feedback``.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from marft_lg.tracing import attributes as A
from marft_lg.tracing.provider import TraceSink, make_sink

_sinks: dict[Path, TraceSink] = {}
_lock = threading.Lock()

TARGETS = ("episode_id", "thread_id", "trace_id")
FIELDS = frozenset({*TARGETS, "turn", "name", "value", "comment", "metadata"})


def _sink(trace_dir: str | os.PathLike) -> TraceSink:
    key = Path(trace_dir).resolve()
    with _lock:
        if key not in _sinks:
            _sinks[key] = make_sink(key, batch=False, file_prefix="feedback")
        return _sinks[key]


def _nonempty(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value or "\x00" in value:
        raise ValueError(f"record_feedback: {what} must be a non-empty string, got {value!r}")
    return value


def feedback_attributes(name: str, value: Any, *, episode_id: str | None = None, thread_id: str | None = None,
                        turn: int | None = None, trace_id: str | None = None, comment: str | None = None,
                        metadata: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The checked attributes of one feedback span: exactly one of `episode_id`, `thread_id`, `trace_id`; `turn`
    only with a thread; `value` a number, bool or string."""
    given = [k for k, v in (("episode_id", episode_id), ("thread_id", thread_id), ("trace_id", trace_id))
             if v is not None]
    if len(given) != 1:
        raise ValueError("record_feedback: say what the feedback is about with exactly one of episode_id, thread_id "
                         f"or trace_id (got {', '.join(given) or 'none'})")
    _nonempty(name, "name")
    if isinstance(value, bool | int | float):
        if isinstance(value, float) and value != value:
            raise ValueError(f"record_feedback: value for {name!r} is NaN")
    elif not isinstance(value, str):
        raise TypeError(
            f"record_feedback: value for {name!r} must be a number, bool or string, got {type(value).__name__}; "
            "serialise richer feedback to a string (e.g. JSON)"
        )
    attrs: dict[str, Any] = {
        A.MARFT_FEEDBACK_NAME: name,
        A.MARFT_FEEDBACK_VALUE: value,
        A.MARFT_FEEDBACK_TIME: dt.datetime.now(dt.UTC).isoformat(),
    }
    if episode_id is not None:
        attrs[A.MARFT_EPISODE_ID] = _nonempty(episode_id, "episode_id")
    if thread_id is not None:
        attrs[A.MARFT_FEEDBACK_THREAD_ID] = _nonempty(str(thread_id) if isinstance(thread_id, int) else thread_id,
                                                      "thread_id")
    if trace_id is not None:
        attrs[A.MARFT_FEEDBACK_TRACE_ID] = _nonempty(trace_id, "trace_id").lower()
    if turn is not None:
        if thread_id is None:
            raise ValueError("record_feedback: turn picks one episode of a thread; give thread_id with it")
        if isinstance(turn, bool) or not isinstance(turn, int):
            raise TypeError(f"record_feedback: turn must be an int (0 the first episode, -1 the last), got {turn!r}")
        attrs[A.MARFT_FEEDBACK_TURN] = turn
    if comment:
        attrs[A.MARFT_FEEDBACK_COMMENT] = str(comment)
    if metadata:
        if not isinstance(metadata, Mapping):
            raise TypeError(f"record_feedback: metadata must be a mapping, got {type(metadata).__name__}")
        attrs[A.MARFT_FEEDBACK_METADATA] = json.dumps(dict(metadata), ensure_ascii=False, default=str)
    return attrs


def record_feedback(
    episode_id: str | None = None,
    name: str = "score",
    value: float | int | bool | str | None = None,
    *,
    thread_id: str | None = None,
    turn: int | None = None,
    trace_id: str | None = None,
    trace_dir: str | os.PathLike = "traces",
    comment: str | None = None,
    metadata: dict[str, Any] | None = None,
) -> None:
    """Write feedback `name`=`value` about an episode (by `episode_id`, `thread_id` [+ `turn`] or `trace_id`) to
    ``trace_dir`` (flushed before returning)."""
    if value is None:
        raise ValueError(f"record_feedback: feedback {name!r} has no value")
    attrs = feedback_attributes(name, value, episode_id=episode_id, thread_id=thread_id, turn=turn,
                                trace_id=trace_id, comment=comment, metadata=metadata)
    write_feedback(attrs, trace_dir)


def write_feedback(attrs: Mapping[str, Any], trace_dir: str | os.PathLike) -> None:
    """One feedback span with `attrs` (from `feedback_attributes`) in ``trace_dir``, flushed."""
    sink = _sink(trace_dir)
    sink.tracer.start_span(A.FEEDBACK_SPAN_NAME, attributes=dict(attrs)).end()
    sink.flush()


def parse_feedback(obj: Any, where: str = "feedback") -> dict[str, Any]:
    """A feedback object (a JSONL line, an HTTP body) checked: its span attributes; errors name `where`."""
    if not isinstance(obj, Mapping):
        raise ValueError(f"{where}: a feedback must be a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - FIELDS)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; a feedback has {sorted(FIELDS)}")
    if "name" not in obj or "value" not in obj or obj["value"] is None:
        raise ValueError(f"{where}: a feedback needs 'name' and 'value'")
    try:
        return feedback_attributes(obj["name"], obj["value"], episode_id=obj.get("episode_id"),
                                   thread_id=obj.get("thread_id"), turn=obj.get("turn"), trace_id=obj.get("trace_id"),
                                   comment=obj.get("comment"), metadata=obj.get("metadata"))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {str(e).removeprefix('record_feedback: ')}") from None


def record_feedback_file(path: str | os.PathLike, trace_dir: str | os.PathLike = "traces") -> int:
    """Record every line of a JSONL file of feedback objects (``{"thread_id": ..., "name": ..., "value": ...}``);
    returns how many. The whole file is checked first: a bad line raises naming ``file:line`` and records nothing."""
    path = Path(path)
    parsed = []
    with path.open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
            parsed.append(parse_feedback(obj, where))
    for attrs in parsed:
        write_feedback(attrs, trace_dir)
    return len(parsed)
