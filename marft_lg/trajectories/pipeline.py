"""The steps of a mining run, shared by the one-process and the multi-process paths.

`read_spans` (read, interpret, drop re-exports) -> `group_episodes` -> `assemble_batches` (episode rows
and columnar action rows, `chunk_actions` actions at a time). No pandas here: worker processes import
only this, the readers and the formats.
"""

from __future__ import annotations

import gc
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from operator import attrgetter
from typing import Any

from marft_lg.tracing.attributes import MIRROR_OF, REPLAY_OF
from marft_lg.trajectories.assembly import ACTION_FIELDS, INCOMPLETE, assemble_episode
from marft_lg.trajectories.columns import EPISODE_COLUMNS, JSON_COLUMNS, json_texts
from marft_lg.trajectories.flat_columns import TokenColumn
from marft_lg.trajectories.formats import interpret
from marft_lg.trajectories.formats.base import SpanInfo
from marft_lg.trajectories.otlp import DEFAULT_MAX_LINE_BYTES, iter_span_batches
from marft_lg.trajectories.quarantine import Quarantine

EPISODE_FIELDS: tuple[str, ...] = (*EPISODE_COLUMNS, "source_format", "trace_ids", "settled")
TOKEN_FIELDS = {"prompt_token_ids": "int", "completion_token_ids": "int", "completion_logprobs": "float"}
_MESSAGES = ACTION_FIELDS.index("messages")
_END = attrgetter("end_ns")
REPLAYS, SHADOWS, SERVER_RECORDS = "replays", "shadows", "server_records_unjoined"
"""The kinds of episode that are not production data, named as the `MiningReport` counts them; a mining run leaves
them out unless its `keep` names them."""
NOT_PRODUCTION = {REPLAY_OF: REPLAYS, MIRROR_OF: SHADOWS}  # episode metadata key -> the kind of run it marks
UNJOINED_IN = "server_records_unjoined_in:"  # stats key prefix: server records per file that joined no app episode


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while mining allocates millions of acyclic objects: every
    collection walks everything allocated so far (15-25% of mining's CPU time); reference counting still frees.
    On the way out the survivors (the mined tables) go straight to the oldest generation (freeze + unfreeze: two
    list splices), so that the first allocation after the pause does not walk them all (~0.25 s per million)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            if not gc.get_freeze_count():  # a caller's own frozen objects stay frozen
                gc.freeze()
                gc.unfreeze()
            gc.enable()


def read_spans(source: Any, q: Quarantine, *, max_attribute_bytes: int, stats: dict[str, int], formats: Counter[str],
               progress: Callable[[int], None] | None = None,
               max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> list[SpanInfo]:
    """Every usable span of `source` (paths, `FileRange`s, or a `RawSpans` of spans already in memory), in read
    order; re-exports are quarantined."""
    spans: list[SpanInfo] = []
    _read_first_copies(source, q, {}, spans, max_attribute_bytes=max_attribute_bytes, stats=stats, formats=formats,
                       progress=progress, max_line_bytes=max_line_bytes)
    return spans


class RawSpans(list):
    """Spans already read (a wrapped app's own records, say): `read_spans` takes them as they are, with no file.
    `keep`: the kinds of non-production episode to keep (`REPLAYS`: the trainer's own reading of the replays it ran)."""

    keep: frozenset[str] = frozenset()


def read_traces(source: Any, q: Quarantine, *, max_attribute_bytes: int, stats: dict[str, int], formats: Counter[str],
                progress: Callable[[int], None] | None = None,
                max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> dict[str, dict[str, SpanInfo]]:
    """`read_spans` as trace id -> span id -> span (read order): no list of all spans, which is what a mining
    worker holds at its peak."""
    traces: dict[str, dict[str, SpanInfo]] = {}
    _read_first_copies(source, q, traces, None, max_attribute_bytes=max_attribute_bytes, stats=stats, formats=formats,
                       progress=progress, max_line_bytes=max_line_bytes)
    return traces


def _read_first_copies(source: Any, q: Quarantine, traces: dict[str, dict[str, SpanInfo]], spans: list[SpanInfo] | None,
                       *, max_attribute_bytes: int, stats: dict[str, int], formats: Counter[str],
                       progress: Callable[[int], None] | None, max_line_bytes: int) -> None:
    """Interpret every span read into `traces` (trace id -> span id -> span) and, when given, `spans` (read order)."""
    n = 0
    if isinstance(source, RawSpans):
        stats["spans_read"] = stats.get("spans_read", 0) + len(source)
    batches = (source,) if isinstance(source, RawSpans) else iter_span_batches(
        source, q, max_attribute_bytes=max_attribute_bytes, stats=stats, max_line_bytes=max_line_bytes)
    for batch in batches:
        for raw in batch:
            n += 1
            members = traces.get(raw.trace_id)
            if members is None:
                members = traces[raw.trace_id] = {}
            else:
                first = members.get(raw.span_id)
                if first is not None:
                    q.add("duplicate", raw.source, trace_id=raw.trace_id, span_id=raw.span_id,
                          detail=f"first read at {first.source}")
                    continue
            info = interpret(raw)
            if info.parent_id is not None:  # share the parent's id string when it came first (65 bytes a span)
                parent = members.get(info.parent_id)
                if parent is not None:
                    info.parent_id = parent.span_id
            members[info.span_id] = info
            if spans is not None:
                spans.append(info)
            if progress is not None and n % 10000 == 0:
                progress(n)
    for members in traces.values():  # counted once at the end, in C
        formats.update(map(_FMT, members.values()))
    if progress is not None:
        progress(n)


_FMT = attrgetter("fmt")


def new_columns() -> dict[str, list]:
    return {c: [] for c in ACTION_FIELDS}


def assemble_batches(episodes: dict[str, list[SpanInfo]], q: Quarantine, stats: dict[str, int],
                     feedback: dict[str, dict[str, Any]], watermark: int | None, seen: set[str],
                     chunk_actions: int, agents: Counter[str], *, share_strings: bool = True,
                     keep: frozenset[str] = frozenset()) -> Iterator[tuple[list[dict], dict[str, list]]]:
    """Assemble episodes in key order (emptying `episodes`), `chunk_actions` actions per batch. Token columns keep
    their encoded values (decoded per batch by `TokenColumn`); `seen` receives every episode with an action,
    `agents` counts the kept actions per agent. `share_strings`: repeated message texts share one copy (what keeps
    `mine()`'s tables small; batches headed for parquet are encoded at once and skip it). Names and ids are shared
    by `mine()`. Episodes that are not production data are counted (`stats[kind]`) and left out unless `keep` names
    their kind: counterfactual replays and shadow (mirrored) runs (episode metadata ``replay_of`` / ``mirror_of``: the
    trainer's and the comparison's experiments), and server records that joined no app span (another run's, or an
    app that was not wrapped: `SERVER_RECORDS`, counted per record and file)."""
    rows: list[dict] = []
    batch: list[list[Any]] = []
    texts: dict[str, str] = {}  # one copy per distinct message text in a batch (system prompts repeat on every call)
    intern = sys.intern  # and one copy of each role name ("system", "user", ...) overall: ~100 bytes an action
    for key in sorted(episodes):
        spans = episodes.pop(key)
        if SERVER_RECORDS not in keep and all(s.served for s in spans):
            if watermark is None or max(map(_END, spans)) > watermark:
                _count_unjoined(spans, stats)
            continue
        built = assemble_episode(key, spans, q, stats)
        del spans
        if built is None:
            continue
        seen.add(key)
        row, acts = built
        if watermark is not None and row["end_time"] <= watermark:
            stats["episodes_before_since"] = stats.get("episodes_before_since", 0) + 1
            continue
        kind = not_production(row["metadata"])
        if kind is not None and kind not in keep:
            stats[kind] = stats.get(kind, 0) + 1
            continue
        row["feedback"] = dict(sorted(feedback.get(key, {}).items()))
        if not row["settled"]:
            stats["unsettled"] = stats.get("unsettled", 0) + 1
        if row["status"] == INCOMPLETE:
            stats[INCOMPLETE] = stats.get(INCOMPLETE, 0) + 1
        stats["episodes"] = stats.get("episodes", 0) + 1
        stats["actions"] = stats.get("actions", 0) + len(acts)
        rows.append(row)
        for a in acts if share_strings else ():
            for m in a[_MESSAGES]:
                if type(m) is dict:
                    role = m.get("role")
                    if type(role) is str:
                        m["role"] = intern(role)
                    text = m.get("content")
                    if type(text) is str:
                        m["content"] = texts.setdefault(text, text)
        batch.extend(acts)
        if len(batch) >= chunk_actions:
            yield rows, _columns(batch, agents)
            rows, batch, texts = [], [], {}
    if rows:
        yield rows, _columns(batch, agents)


def not_production(metadata: dict[str, Any]) -> str | None:
    """The kind of run an episode's metadata marks as not production data (`REPLAYS`, `SHADOWS`), or None."""
    return next((kind for key, kind in NOT_PRODUCTION.items() if metadata.get(key)), None)


def _count_unjoined(spans: list[SpanInfo], stats: dict[str, int]) -> None:
    """Count an episode's server records (first choices: one per request) per file they were read from."""
    for s in spans:
        if not s.choice:
            where = UNJOINED_IN + (s.source.rpartition(":")[0] or s.source)
            stats[where] = stats.get(where, 0) + 1


def _columns(actions: list[list[Any]], agents: Counter[str]) -> dict[str, list]:
    """Action rows -> columns; counts the actions per agent."""
    rows = zip(*actions, strict=True)  # transposed in C
    cols = dict(zip(ACTION_FIELDS, map(list, rows), strict=True)) if actions else new_columns()
    agents.update(cols["agent"])
    return cols


def flatten(cols: dict[str, Any]) -> dict[str, Any]:
    """Replace the encoded token columns of a batch by `TokenColumn`s, in place; returns `cols`."""
    for name, kind in TOKEN_FIELDS.items():
        cols[name] = TokenColumn.decode(cols[name], kind)
    return cols


def targeted(spans: Iterable[SpanInfo]) -> bool:
    """Whether any feedback span names its episode by thread or trace rather than by episode id."""
    return any(fb.feedback_thread is not None or fb.feedback_trace is not None for fb in spans)


def trace_threads(traces: Iterable[tuple[str, Iterable[SpanInfo]]]) -> dict[str, tuple[str | None, int]]:
    """trace id -> (its conversation/thread id, the start of its earliest span): what `resolve_feedback` needs."""
    out: dict[str, tuple[str | None, int]] = {}
    for t, spans in traces:
        spans = list(spans)
        if spans:
            named = min((s for s in spans if s.session), key=_START_ID, default=None)
            out[t] = (named.session if named is not None else None, min(map(_START, spans)))
    return out


def resolve_feedback(spans: list[SpanInfo], trace_key: dict[str, str], threads: dict[str, tuple[str | None, int]],
                     q: Quarantine) -> list[SpanInfo]:
    """Feedback about a thread or a trace pointed at its episode (``episode_id`` set); what names no episode is
    quarantined (``feedback_without_episode``) and left out. A thread's episodes are ordered by start: `turn` picks
    one (negative from the end), else the last that started before the feedback was given.

    `trace_key`: trace id -> episode key; `threads`: trace id -> (thread, start) (`trace_threads`)."""
    if not targeted(spans):
        return spans
    episodes: dict[str, tuple[str | None, int]] = {}  # episode key -> (thread, start)
    for t, key in trace_key.items():
        thread, start = threads.get(t, (None, 0))
        have = episodes.get(key)
        if have is None or start < have[1]:
            episodes[key] = (thread or (have[0] if have else None), start)
        elif thread and not have[0]:
            episodes[key] = (thread, have[1])
    by_thread: dict[str, list[tuple[int, str]]] = {}
    for key, (thread, start) in episodes.items():
        if thread:
            by_thread.setdefault(thread, []).append((start, key))
    for members in by_thread.values():
        members.sort()
    kept = []
    for fb in spans:
        if fb.episode_id or (fb.feedback_thread is None and fb.feedback_trace is None):
            kept.append(fb)
            continue
        key, why = _feedback_target(fb, trace_key, by_thread)
        if key is None:
            q.add("feedback_without_episode", fb.source, trace_id=fb.trace_id, span_id=fb.span_id, detail=why)
            continue
        fb.episode_id = key
        kept.append(fb)
    return kept


def _feedback_target(fb: SpanInfo, trace_key: dict[str, str],
                     by_thread: dict[str, list[tuple[int, str]]]) -> tuple[str | None, str]:
    if fb.feedback_trace is not None:
        key = trace_key.get(fb.feedback_trace)
        return key, f"trace {fb.feedback_trace!r} is not in the mined input"
    members = by_thread.get(fb.feedback_thread or "", [])
    if not members:
        return None, f"thread {fb.feedback_thread!r} has no episode in the mined input"
    if fb.feedback_turn is not None:
        if -len(members) <= fb.feedback_turn < len(members):
            return members[fb.feedback_turn][1], ""
        return None, (f"thread {fb.feedback_thread!r} has {len(members)} episode(s) in the mined input; "
                      f"turn {fb.feedback_turn} is not one of them")
    before = [key for start, key in members if start <= fb.end_ns]
    return (before or [members[-1][1]])[-1], ""


_START_ID, _START = attrgetter("start_ns", "span_id"), attrgetter("start_ns")


def episode_traces(episodes: dict[str, list[SpanInfo]]) -> tuple[dict[str, str], dict[str, tuple[str | None, int]]]:
    """(trace id -> episode key, `trace_threads`) of grouped episodes: `resolve_feedback`'s arguments."""
    by_trace: dict[str, list[SpanInfo]] = {}
    trace_key: dict[str, str] = {}
    for key, spans in episodes.items():
        for s in spans:
            by_trace.setdefault(s.trace_id, []).append(s)
            trace_key[s.trace_id] = key
    return trace_key, trace_threads(by_trace.items())


def feedback_index(spans: list[SpanInfo], q: Quarantine) -> dict[str, dict[str, Any]]:
    """episode id -> feedback name -> value, the latest span of a name winning; unusable ones are quarantined."""
    index: dict[str, dict[str, Any]] = {}
    for fb in sorted(spans, key=lambda s: (s.end_ns, s.span_id)):
        if not fb.episode_id or not fb.feedback_name:
            q.add("bad_feedback", fb.source, trace_id=fb.trace_id, span_id=fb.span_id,
                  detail="marft.feedback span needs marft.episode.id and marft.feedback.name")
            continue
        index.setdefault(fb.episode_id, {})[fb.feedback_name] = fb.feedback_value
    return index


def quarantine_orphan_feedback(spans: list[SpanInfo], seen: set[str], q: Quarantine) -> None:
    """Feedback whose episode was not mined goes to the quarantine."""
    for fb in sorted(spans, key=lambda s: (s.end_ns, s.span_id)):
        if fb.episode_id and fb.feedback_name and fb.episode_id not in seen:
            q.add("feedback_without_episode", fb.source, trace_id=fb.trace_id, span_id=fb.span_id,
                  detail=f"episode {fb.episode_id!r} is not in the mined input")


def _intern(value: object) -> object:
    return sys.intern(value) if isinstance(value, str) else value


def interned(values: Iterable[Any]) -> list[Any]:
    """`values` with every string replaced by its interned copy (one lookup per distinct string)."""
    values = list(values)
    try:
        shared = {v: sys.intern(v) for v in set(values) if type(v) is str}
        return list(map(shared.get, values, values))
    except TypeError:  # an unhashable value (an attribute sent as a list)
        return [_intern(v) for v in values]


def table_columns(episode_rows: list[dict[str, Any]], action_columns: dict[str, Any]) -> tuple[dict, dict]:
    """A batch as the parquet tables' columns: episode rows to columns, `JSON_COLUMNS` to JSON text (in place
    for the actions). No pyarrow, so that mining workers prepare batches without loading it."""
    episodes = {name: [row.get(name) for row in episode_rows] for name in EPISODE_FIELDS}
    for cols in (episodes, action_columns):
        for name in JSON_COLUMNS & cols.keys():  # the actions' prompts and tool calls were read from JSON
            cols[name] = json_texts(cols[name], parsed=cols is action_columns)
    return episodes, action_columns
