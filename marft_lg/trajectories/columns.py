"""The column lists of `TrajectoryDataset`'s two tables (the contract), importable without pandas: mining's
worker processes need them, and not importing pandas there saves ~70 MB of memory per worker."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

try:  # the fast encoder of `json_texts(..., parsed=True)`
    from orjson import dumps as _orjson_dumps
except ImportError:  # pragma: no cover
    _orjson_dumps = None

EPISODE_COLUMNS: tuple[str, ...] = (
    "episode_id",
    "scenario_id",
    "start_time",  # pandas Timestamp, UTC
    "end_time",
    "n_actions",
    "agents",  # list[str], in order of first action
    "status",  # "ok" | "error" | "paused" (stopped at an interrupt) | "incomplete" (a run's root span is missing)
    "outcome",  # JSON string of the final graph output, or None
    "feedback",  # dict name -> value (latest wins), from record_feedback
    "metadata",  # dict: user metadata given to the wrapped invoke (mirror pair ids live here too)
)

ACTION_COLUMNS: tuple[str, ...] = (
    "episode_id",
    "order",  # 0..n-1 within the episode
    "step",  # LangGraph super-step, or None
    "agent",  # role (node name, namespaced for subgraphs)
    "span_id",  # hex
    "messages",  # list of {"role","content",...}: the prompt in chat form
    "completion",  # str
    "prompt_token_ids",  # list[int] or None
    "completion_token_ids",  # list[int] or None
    "completion_logprobs",  # list[float] or None (source had none)
    "depends_on",  # list[int]: orders of earlier actions this one could see
    "tool_calls",  # list of {"name","args","id","result","error"}
    "tool_errors",  # int: failed tool calls issued by this action
    "input_tokens",
    "output_tokens",
    "latency_s",
    "model",
    "adapter_version",
)

# Columns holding dicts/nested lists of mixed types are stored as JSON text in parquet so that
# round trips are exact whatever pyarrow infers.
JSON_COLUMNS: frozenset[str] = frozenset({"feedback", "metadata", "messages", "tool_calls"})


def _json_encoder() -> Callable[[Any], str]:
    """`json.dumps(v, ensure_ascii=False, default=str)` without building an encoder per value: the standard
    library's C encoder made once (values from JSON are never circular), checked against `json.dumps`."""
    plain = json.JSONEncoder(ensure_ascii=False, default=str).encode
    make = getattr(json.encoder, "c_make_encoder", None)
    try:
        iterencode = make(None, str, json.encoder.encode_basestring, None, ": ", ", ", False, False, True)

        def encode(v: Any) -> str:
            return "".join(iterencode(v, 0))

        probe = [{"a": [1, 2.5, None, True, float("nan")], "b": "é\n\u2028"}, "x", 3, {}]
        if encode(probe) == plain(probe):
            return encode
    except Exception:  # another Python's private C API: the plain encoder gives the same text
        pass
    return plain


_encode = _json_encoder()


_EMPTY_JSON = {list: "[]", dict: "{}"}  # most tool_calls, feedback and metadata values


def json_texts(values: Iterable[Any], *, parsed: bool = False) -> list[str | None]:
    """A JSON column's values as the JSON text parquet stores (None stays None). `parsed`: the values were read
    from JSON (mined prompts and tool calls: no NaN, no non-string keys, no other Python types), so orjson writes
    the same JSON, compact, ~3x faster; a value it refuses (an integer over 64 bits) takes the general encoder."""
    encode, empty = _encode, _EMPTY_JSON
    if parsed and _orjson_dumps is not None:
        return [None if v is None else _dumps_or(v, encode) if v else empty.get(type(v)) or encode(v) for v in values]
    return [None if v is None else encode(v) if v else empty.get(type(v)) or encode(v) for v in values]


def _dumps_or(value: Any, encode: Callable[[Any], str]) -> str:
    try:
        return _orjson_dumps(value).decode()
    except TypeError:  # orjson.JSONEncodeError
        return encode(value)

