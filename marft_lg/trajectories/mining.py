"""`mine()`: OTLP/JSON trace files (any supported instrumentor) -> `TrajectoryDataset`.

Read line by line (damage goes to the quarantine), interpret each span with the first format that
recognises it, drop re-exported duplicates, then assemble episodes (see `assembly`). The output
depends only on the input's content: mining the same files twice gives identical tables.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd

from marft_lg.trajectories.assembly import assemble_episode, group_episodes
from marft_lg.trajectories.dataset import ACTION_COLUMNS, EPISODE_COLUMNS, TrajectoryDataset
from marft_lg.trajectories.formats import interpret
from marft_lg.trajectories.formats.base import SpanInfo
from marft_lg.trajectories.otlp import DEFAULT_MAX_ATTRIBUTE_BYTES, iter_raw_spans
from marft_lg.trajectories.quarantine import Quarantine

PathsLike = str | os.PathLike | Iterable[str | os.PathLike]


@dataclass
class MiningReport:
    """What a mining run read, kept, repaired and quarantined."""

    files: int = 0
    lines: int = 0
    spans_read: int = 0
    spans_kept: int = 0
    episodes: int = 0
    actions: int = 0
    actions_per_agent: dict[str, int] = field(default_factory=dict)
    formats: dict[str, int] = field(default_factory=dict)
    quarantined: dict[str, int] = field(default_factory=dict)
    repaired_parents: int = 0
    spans_without_actions: int = 0
    episodes_before_since: int = 0
    quarantine_path: str | None = None

    @property
    def quarantined_total(self) -> int:
        return sum(self.quarantined.values())


def mine(paths: PathsLike, *, since: datetime | str | None = None, quarantine: str | Path | None = None,
         max_attribute_bytes: int = DEFAULT_MAX_ATTRIBUTE_BYTES) -> TrajectoryDataset:
    """Mine trace files, directories or globs into a `TrajectoryDataset`.

    `since` keeps only episodes that ended after it (a watermark); `quarantine` is a JSONL file
    that receives every line or span that could not be used, with its reason and `file:line`.
    """
    return mine_with_report(paths, since=since, quarantine=quarantine, max_attribute_bytes=max_attribute_bytes)[0]


def mine_with_report(paths: PathsLike, *, since: datetime | str | None = None, quarantine: str | Path | None = None,
                     max_attribute_bytes: int = DEFAULT_MAX_ATTRIBUTE_BYTES,
                     progress: Callable[[int], None] | None = None) -> tuple[TrajectoryDataset, MiningReport]:
    """`mine`, plus the `MiningReport` the CLI prints. `progress(n)` is called with spans read so far."""
    report = MiningReport(quarantine_path=str(quarantine) if quarantine else None)
    episode_rows: list[dict] = []
    action_cols: dict[str, list] = {c: [] for c in (*ACTION_COLUMNS, "trace_id")}
    for row, acts in _iter_episodes(paths, since, quarantine, max_attribute_bytes, progress, report):
        episode_rows.append(row)
        _extend_columns(action_cols, acts)
    dataset = _to_dataset(episode_rows, action_cols)
    report.actions_per_agent = {str(k): int(v) for k, v in sorted(Counter(dataset.actions["agent"]).items())}
    return dataset, report


def mine_to_parquet(paths: PathsLike, out: str | Path, *, since: datetime | str | None = None,
                    quarantine: str | Path | None = None, max_attribute_bytes: int = DEFAULT_MAX_ATTRIBUTE_BYTES,
                    progress: Callable[[int], None] | None = None, chunk_actions: int = 5_000) -> MiningReport:
    """Mine straight into ``out/episodes.parquet`` and ``out/actions.parquet`` without holding the whole
    dataset in memory (what `marft-lg mine --out` uses); the files read back with `TrajectoryDataset.from_parquet`.
    Nothing is written when no episode was mined."""
    from marft_lg.trajectories.parquet_writer import DatasetParquetWriter

    report = MiningReport(quarantine_path=str(quarantine) if quarantine else None)
    per_agent: Counter[str] = Counter()
    with DatasetParquetWriter(out) as writer:
        episode_rows: list[dict] = []
        action_cols: dict[str, list] = {c: [] for c in (*ACTION_COLUMNS, "trace_id")}
        for row, acts in _iter_episodes(paths, since, quarantine, max_attribute_bytes, progress, report):
            episode_rows.append(row)
            _extend_columns(action_cols, acts)
            per_agent.update(a["agent"] for a in acts)
            if len(action_cols["order"]) >= chunk_actions:
                writer.write(episode_rows, action_cols)
                episode_rows, action_cols = [], {c: [] for c in action_cols}
        writer.write(episode_rows, action_cols)
        if report.episodes == 0:
            writer.abort()
    report.actions_per_agent = dict(sorted(per_agent.items()))
    return report


def _extend_columns(action_cols: dict[str, list], acts: list[dict]) -> None:
    for name, column in action_cols.items():  # columns, not row dicts: a third of the memory
        column.extend([_intern(a[name]) for a in acts] if name in _INTERNED else [a[name] for a in acts])


def _iter_episodes(paths: PathsLike, since: datetime | str | None, quarantine: str | Path | None,
                   max_attribute_bytes: int, progress: Callable[[int], None] | None,
                   report: MiningReport) -> Iterator[tuple[dict, list[dict]]]:
    """Read, interpret and de-duplicate every span, then yield (episode row, action rows) in episode-id order;
    fills `report` as it goes."""
    watermark = _watermark(since)
    stats: dict[str, int] = {}
    formats: Counter[str] = Counter()
    with Quarantine(quarantine) as q:
        spans: dict[tuple[str, str], SpanInfo] = {}
        for n, raw in enumerate(iter_raw_spans(paths, q, max_attribute_bytes=max_attribute_bytes, stats=stats), 1):
            key = (raw.trace_id, raw.span_id)
            first = spans.get(key)
            if first is not None:
                q.add("duplicate", raw.source, trace_id=raw.trace_id, span_id=raw.span_id,
                      detail=f"first read at {first.source}")
                continue
            info = interpret(raw)
            formats[info.fmt] += 1
            spans[key] = info
            if progress is not None and n % 10000 == 0:
                progress(n)
        episodes, feedback_spans = group_episodes(spans.values())
        report.spans_kept = len(spans)
        del spans
        feedback = _feedback_index(feedback_spans, q)
        seen: set[str] = set()
        for key in sorted(episodes):
            built = assemble_episode(key, episodes.pop(key), q, stats)
            if built is None:
                continue
            seen.add(key)
            row, acts = built
            if watermark is not None and row["end_time"] <= watermark:
                report.episodes_before_since += 1
                continue
            row["feedback"] = {name: value for name, (_, value) in sorted(feedback.get(key, {}).items())}
            report.episodes += 1
            report.actions += len(acts)
            yield row, acts
        for fb in sorted(feedback_spans, key=lambda s: (s.end_ns, s.span_id)):
            if fb.episode_id and fb.feedback_name and fb.episode_id not in seen:
                q.add("feedback_without_episode", fb.source, trace_id=fb.trace_id, span_id=fb.span_id,
                      detail=f"episode {fb.episode_id!r} is not in the mined input")
        report.quarantined = dict(sorted(q.counts.items()))
    report.files = stats.get("files", 0)
    report.lines = stats.get("lines", 0)
    report.spans_read = stats.get("spans_read", 0)
    report.spans_kept -= report.quarantined.get("tool_without_action", 0)
    report.repaired_parents = stats.get("repaired_parents", 0)
    report.spans_without_actions = stats.get("spans_without_actions", 0)
    report.formats = dict(sorted(formats.items()))


def _feedback_index(spans: list[SpanInfo], q: Quarantine) -> dict[str, dict[str, tuple[SpanInfo, object]]]:
    """episode id -> feedback name -> (latest span, value); the latest span of a name wins."""
    index: dict[str, dict[str, tuple[SpanInfo, object]]] = {}
    for fb in sorted(spans, key=lambda s: (s.end_ns, s.span_id)):
        if not fb.episode_id or not fb.feedback_name:
            q.add("bad_feedback", fb.source, trace_id=fb.trace_id, span_id=fb.span_id,
                  detail="marft.feedback span needs marft.episode.id and marft.feedback.name")
            continue
        index.setdefault(fb.episode_id, {})[fb.feedback_name] = (fb, fb.feedback_value)
    return index


def _watermark(since: datetime | str | None) -> int | None:
    if since is None:
        return None
    if isinstance(since, str):
        try:
            since = datetime.fromisoformat(since.replace("Z", "+00:00"))
        except ValueError as exc:
            raise ValueError(f"since={since!r} is not an ISO-8601 time such as 2026-01-31T12:00:00Z") from exc
    if since.tzinfo is None:
        since = since.replace(tzinfo=UTC)
    return int(since.timestamp() * 1_000_000) * 1000


_INTERNED = frozenset({"agent", "model", "adapter_version"})


def _intern(value: object) -> object:
    return sys.intern(value) if isinstance(value, str) else value


def _to_dataset(episode_rows: list[dict], action_cols: dict[str, list]) -> TrajectoryDataset:
    extra_e = ["source_format", "trace_ids"]
    episodes = pd.DataFrame(episode_rows, columns=[*EPISODE_COLUMNS, *extra_e])
    for col in ("start_time", "end_time"):
        episodes[col] = pd.to_datetime(episodes[col].astype("int64"), unit="ns", utc=True)
    episodes["n_actions"] = episodes["n_actions"].astype("int64")
    actions = pd.DataFrame(action_cols, columns=[*ACTION_COLUMNS, "trace_id"])
    action_cols.clear()
    actions["order"] = actions["order"].astype("int64")
    actions["tool_errors"] = actions["tool_errors"].astype("int64")
    actions["step"] = actions["step"].astype("Int64")
    for col in ("input_tokens", "output_tokens"):
        actions[col] = actions[col].astype("Int64")
    actions["latency_s"] = actions["latency_s"].astype("float64")
    return TrajectoryDataset(episodes=episodes, actions=actions)
