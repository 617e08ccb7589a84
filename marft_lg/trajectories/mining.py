"""`mine()`: OTLP/JSON trace files (any supported instrumentor) -> `TrajectoryDataset`.

Read line by line (damage goes to the quarantine), interpret each span with the first format that
recognises it, drop re-exported duplicates, then assemble episodes (see `assembly`). The output
depends only on the input's content: mining the same files twice gives identical tables.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, Any

from marft_lg.tracing.files import trace_files
from marft_lg.trajectories.assembly import ACTION_FIELDS, INCOMPLETE, NO_TOKEN_IDS, group_episodes
from marft_lg.trajectories.columns import EPISODE_COLUMNS
from marft_lg.trajectories.flat_columns import TokenColumn
from marft_lg.trajectories.otlp import DEFAULT_MAX_ATTRIBUTE_BYTES, DEFAULT_MAX_LINE_BYTES, FileRange
from marft_lg.trajectories.pipeline import (
    REPLAYS,
    SERVER_RECORDS,
    SHADOWS,
    UNJOINED_IN,
    RawSpans,
    assemble_batches,
    episode_traces,
    feedback_index,
    flatten,
    gc_paused,
    interned,
    new_columns,
    quarantine_orphan_feedback,
    read_spans,
    resolve_feedback,
    targeted,
)
from marft_lg.trajectories.quarantine import Quarantine
from marft_lg.trajectories.raw_span import RawSpan

if TYPE_CHECKING:  # pandas is imported when the tables are built: the mining workers never need it
    import pandas as pd

    from marft_lg.trajectories.dataset import TrajectoryDataset
    from marft_lg.trajectories.parquet_writer import DatasetParquetWriter
    from marft_lg.trajectories.range_worker import RangeExecutor

PathsLike = str | os.PathLike | Iterable[str | os.PathLike]
_SHARED_NAMES = frozenset({"agent", "model", "adapter_version"})  # columns whose repeated strings mine() shares
logger = logging.getLogger("marft_lg.mining")


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
    files_before_since: int = 0
    """Files last written more than `SINCE_FILE_MARGIN_S` before `since`: skipped unread (see `_fresh_files`)."""
    non_utf8_lines: int = 0
    """Lines holding bytes that are not UTF-8 (read with those bytes replaced by U+FFFD, as a text-mode read would)."""
    actions_without_token_ids: dict[str, int] = field(default_factory=dict)
    """Actions per agent whose trace holds no exact prompt/completion token ids (no server record joined to a
    client that keeps none): the trainer re-renders their prompts, which may not be what the model saw."""
    replays: int = 0
    """Counterfactual replay episodes (metadata ``replay_of``) left out: they are never production data."""
    shadows: int = 0
    """Shadow (mirrored) runs (metadata ``mirror_of``) left out: a candidate's answers, never served to a user."""
    server_records_unjoined: int = 0
    """Server records (requests `marft-lg serve` answered) that joined no app span, left out unless
    `server_records_only`: another run's records in the server's folder, or an app whose own spans are missing."""
    server_records_unjoined_in: dict[str, int] = field(default_factory=dict)
    """Those records per file they were read from."""
    unsettled: int = 0
    """Episodes kept whose server record of some call is missing (episodes column `settled` False): mined too soon
    after the call (the server's sink drains every 0.5 s) or the record was lost; such calls have no exact token ids."""
    incomplete: int = 0
    """Episodes kept with status "incomplete": a run of each has spans but not its root span (still being exported,
    or the process ended first), so its status, scenario and metadata are unknown; they are not settled, and a
    reward leaves them unscored."""
    served_merged: int = 0
    """LLM calls whose server record (what `marft-lg serve` sampled) was joined to the app's span."""
    quarantine_path: str | None = None
    first_quarantined: dict[str, list[str]] = field(default_factory=dict)
    """The first `file:line`s (up to 3) of each quarantine reason, e.g. of the lines over `max_line_bytes`."""

    @property
    def quarantined_total(self) -> int:
        return sum(self.quarantined.values())

    def long_lines_note(self, setting: str) -> str | None:
        """One line saying which trace lines were over the line bound and skipped (None when none was), for the
        commands that mine as a step (`train`, `retrain`); `setting` names how to raise the bound."""
        n = self.quarantined.get("line_too_long", 0)
        if not n:
            return None
        where = ", ".join(self.first_quarantined.get("line_too_long", []))
        return (f"{n} trace line(s) longer than the line bound were skipped unread (first at {where}); raise "
                f"{setting} to mine them")

    def notes(self) -> list[str]:
        """The warnings a mining run ends with: server records left over, episodes not settled or incomplete."""
        notes = [self.leftover_note()]
        if self.unsettled:
            notes.append(f"{self.unsettled} episode(s) are not settled: a call of each has neither token ids nor "
                         f"its server record yet (the server may not have written it; mine again in a few seconds). "
                         f"They are kept, with settled=False")
        if self.incomplete:
            notes.append(f"{self.incomplete} episode(s) are incomplete: a run of each has spans but no root span yet "
                         f"(it is exported when the run ends; or the app stopped first), so its scenario and metadata "
                         f"are unknown. They are kept, with status 'incomplete', and never scored; mine again later")
        return [n for n in notes if n]

    def leftover_note(self) -> str | None:
        """One line saying how many server records joined no app episode and were left out (None when none was)."""
        n = self.server_records_unjoined
        if not n:
            return None
        files = sorted(self.server_records_unjoined_in.items(), key=lambda kv: (-kv[1], kv[0]))
        where = ", ".join(f"{f} ({k})" for f, k in files[:2]) + (f" and {len(files) - 2} more" if len(files) > 2 else "")
        return (f"{n} server record(s) joined no app span and were left out (in {where}): another run's records, or "
                f"the app's own spans were not mined; mine with server_records_only (--server-records-only) when the "
                f"server's records are all there is")


def mine(paths: PathsLike, *, since: datetime | str | None = None, quarantine: str | Path | None = None,
         max_attribute_bytes: int = DEFAULT_MAX_ATTRIBUTE_BYTES, workers: int | None = None,
         executor: RangeExecutor | None = None, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
         server_records_only: bool = False, keep_shadows: bool = False) -> TrajectoryDataset:
    """Mine trace files, directories or globs into a `TrajectoryDataset` of production episodes.

    `since` keeps only episodes that ended after it (a watermark); `quarantine` is a JSONL file
    that receives every line or span that could not be used, with its reason and `file:line`; a line longer than
    `max_line_bytes` is one of them, skipped without being read whole (memory stays flat).
    `workers` processes share the work (default: one per core for inputs over 64 MB, else 1).
    `executor` runs those workers elsewhere (see `range_worker.RangeExecutor`; `marft_lg.distributed.mining.mine` passes
    Ray actors): then the input is always cut into `workers` ranges, whatever its size.
    `server_records_only`: server records that joined no app span become episodes (an app that was not wrapped, whose
    only record is the server's); `keep_shadows`: keep shadow (mirrored) runs. Both are left out by default.
    """
    return mine_with_report(paths, since=since, quarantine=quarantine, max_attribute_bytes=max_attribute_bytes,
                            workers=workers, executor=executor, max_line_bytes=max_line_bytes,
                            server_records_only=server_records_only, keep_shadows=keep_shadows)[0]


def mine_with_report(paths: PathsLike, *, since: datetime | str | None = None, quarantine: str | Path | None = None,
                     max_attribute_bytes: int = DEFAULT_MAX_ATTRIBUTE_BYTES,
                     progress: Callable[[int], None] | None = None, workers: int | None = None,
                     executor: RangeExecutor | None = None, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
                     server_records_only: bool = False,
                     keep_shadows: bool = False) -> tuple[TrajectoryDataset, MiningReport]:
    """`mine`, plus the `MiningReport` the CLI prints. `progress(n)` is called with spans read so far. `paths` may
    also be a `RawSpans` list of spans already in memory (`mine_spans`)."""
    report = MiningReport(quarantine_path=str(quarantine) if quarantine else None)
    keep = _keep(paths, server_records_only, keep_shadows)
    episode_rows: list[dict] = []
    action_chunks: dict[str, list] = new_columns()  # name -> the batches' values (lists or flat columns)
    with gc_paused():
        for rows, cols in _batches(paths, since, quarantine, max_attribute_bytes, progress, report, workers=workers,
                                   chunk_actions=20_000, executor=executor, max_line_bytes=max_line_bytes, keep=keep):
            episode_rows.extend(rows)
            for name, values in cols.items():
                if isinstance(values, TokenColumn):
                    values = values.to_lists()
                elif name in _SHARED_NAMES:  # one copy per name
                    values = interned(values)
                action_chunks[name].append(values)
            del rows, cols
        dataset = _to_dataset(episode_rows, action_chunks)
    _warn(report)
    return dataset, report


def mine_spans(spans: Iterable[RawSpan], *, since: datetime | str | None = None, replays: bool = False,
               shadows: bool = False, server_records_only: bool = False) -> TrajectoryDataset:
    """`mine` for spans already in memory (a wrapped app's own records): the same interpretation and assembly, no
    file and no JSON. Mining the files those spans were exported to gives the same tables. `replays`, `shadows`: keep
    the counterfactual replay and the shadow (mirrored) episodes (which `mine` leaves out)."""
    raw = RawSpans(spans)
    raw.keep = frozenset(kind for kind, on in ((REPLAYS, replays), (SHADOWS, shadows)) if on)
    return mine_with_report(raw, since=since, server_records_only=server_records_only)[0]


def mine_to_parquet(paths: PathsLike, out: str | Path, *, since: datetime | str | None = None,
                    quarantine: str | Path | None = None, max_attribute_bytes: int = DEFAULT_MAX_ATTRIBUTE_BYTES,
                    progress: Callable[[int], None] | None = None, chunk_actions: int = 5_000,
                    workers: int | None = None, executor: RangeExecutor | None = None,
                    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES, server_records_only: bool = False,
                    keep_shadows: bool = False) -> MiningReport:
    """Mine straight into ``out/episodes.parquet`` and ``out/actions.parquet`` without holding the whole
    dataset in memory (what `marft-lg mine --out` uses); the files read back with `TrajectoryDataset.from_parquet`.
    Nothing is written when no episode was mined. `workers`, `executor`, `server_records_only` and `keep_shadows`
    as in `mine`."""
    from marft_lg.trajectories.parquet_writer import DatasetParquetWriter

    report = MiningReport(quarantine_path=str(quarantine) if quarantine else None)
    with gc_paused(), DatasetParquetWriter(out) as writer:
        for rows, cols in _batches(paths, since, quarantine, max_attribute_bytes, progress, report, workers=workers,
                                   chunk_actions=chunk_actions, writer=writer, executor=executor,
                                   max_line_bytes=max_line_bytes,
                                   keep=_keep(paths, server_records_only, keep_shadows)):
            writer.write(rows, cols)
        if report.episodes == 0:
            writer.abort()
    _warn(report)
    return report


def _keep(paths: PathsLike, server_records_only: bool, keep_shadows: bool) -> frozenset[str]:
    """The kinds of non-production episode a run keeps (`pipeline.assemble_batches`)."""
    kinds = {SERVER_RECORDS} if server_records_only else set()
    if keep_shadows:
        kinds.add(SHADOWS)
    return frozenset(kinds | getattr(paths, "keep", frozenset()))


def _warn(report: MiningReport) -> None:
    for note in report.notes():
        logger.warning("marft_lg: %s", note)


MIN_PARALLEL_BYTES = 64 * 1024 * 1024  # below this, starting worker processes costs more than it saves


def _worker_count(files: list[Path], workers: int | None) -> int:
    if workers is None and os.environ.get("MARFT_MINING_WORKERS"):
        workers = int(os.environ["MARFT_MINING_WORKERS"])
    if workers is not None:
        return max(1, workers)
    from marft_lg.trajectories.ranges import default_workers

    total = sum(f.stat().st_size for f in files)
    return default_workers() if total >= MIN_PARALLEL_BYTES else 1


def _batches(paths: PathsLike, since: datetime | str | None, quarantine: str | Path | None, max_attribute_bytes: int,
             progress: Callable[[int], None] | None, report: MiningReport, *, workers: int | None, chunk_actions: int,
             writer: DatasetParquetWriter | None = None, executor: RangeExecutor | None = None,
             max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
             keep: frozenset[str] = frozenset()) -> Iterator[tuple[list[dict], dict[str, list]]]:
    """(episode rows, action columns) batches, token columns as `TokenColumn`s; fills `report` at the end.
    With `writer` (the caller writes every yielded batch to it), worker processes' batches are written to it
    as well: the first worker's as they arrive, the others' as parquet parts appended at the end. With `executor`
    the ranges are mined by its workers, also when there is only one."""
    watermark = _watermark(since)
    if isinstance(paths, RawSpans):
        yield from _local_batches(paths, watermark, quarantine, max_attribute_bytes, progress, report,
                                  chunk_actions=chunk_actions, share_strings=writer is None, keep=keep)
        return
    files = _fresh_files(trace_files(paths), watermark, report)
    n_workers = _worker_count(files, workers)
    groups = []
    if n_workers > 1 or executor is not None:
        from marft_lg.trajectories.ranges import plan_ranges

        groups = plan_ranges(files, n_workers, count_lines=False)  # counted once the first worker runs
    if len(groups) > 1 or (groups and executor is not None):
        yield from _parallel_batches(groups, watermark, quarantine, max_attribute_bytes, progress, report,
                                     chunk_actions=chunk_actions, writer=writer, executor=executor,
                                     max_line_bytes=max_line_bytes, keep=keep)
        return
    yield from _local_batches([FileRange(f) for f in files], watermark, quarantine, max_attribute_bytes, progress,
                              report, chunk_actions=chunk_actions, share_strings=writer is None,
                              max_line_bytes=max_line_bytes, keep=keep)


SINCE_FILE_MARGIN_S = 3600


def _fresh_files(files: list[Path], watermark: int | None, report: MiningReport) -> list[Path]:
    """The files that may hold a span of an episode that ended after the watermark. A span is written after it
    ends, so a file last modified more than `SINCE_FILE_MARGIN_S` before the watermark holds only spans of
    episodes that ended before it (or of an episode that ran longer than the margin, whose early spans it would
    drop): such files are skipped unread, which keeps each retraining run and on-policy iteration from re-reading
    the whole trace history."""
    if watermark is None:
        return files
    cutoff = watermark - SINCE_FILE_MARGIN_S * 1_000_000_000
    fresh = [f for f in files if f.stat().st_mtime_ns >= cutoff]
    report.files_before_since = len(files) - len(fresh)
    return fresh


def _local_batches(source: Any, watermark: int | None, quarantine: str | Path | None, max_attribute_bytes: int,
                   progress: Callable[[int], None] | None, report: MiningReport, *, chunk_actions: int,
                   share_strings: bool, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
                   keep: frozenset[str] = frozenset()) -> Iterator[tuple[list[dict], dict[str, list]]]:
    """`_batches` in this process, from `FileRange`s or `RawSpans`."""
    stats: dict[str, int] = {}
    formats: Counter[str] = Counter()
    agents: Counter[str] = Counter()
    with Quarantine(quarantine) as q:
        spans = read_spans(source, q, max_attribute_bytes=max_attribute_bytes, stats=stats, formats=formats,
                           progress=progress, max_line_bytes=max_line_bytes)
        kept = len(spans)
        episodes, feedback_spans = group_episodes(spans)
        del spans
        if targeted(feedback_spans):
            feedback_spans = resolve_feedback(feedback_spans, *episode_traces(episodes), q)
        fb_index = feedback_index(feedback_spans, q)
        seen: set[str] = set()
        for rows, cols in assemble_batches(episodes, q, stats, fb_index, watermark, seen, chunk_actions, agents,
                                           share_strings=share_strings, keep=keep):
            yield rows, flatten(cols)
        quarantine_orphan_feedback(feedback_spans, seen, q)
        _fill_report(report, stats, formats, kept, q, agents)


def _parallel_batches(groups: list, watermark: int | None, quarantine: str | Path | None, max_attribute_bytes: int,
                      progress: Callable[[int], None] | None, report: MiningReport, *, chunk_actions: int,
                      writer: DatasetParquetWriter | None,
                      executor: RangeExecutor | None, max_line_bytes: int,
                      keep: frozenset[str]) -> Iterator[tuple[list[dict], dict[str, list]]]:
    from marft_lg.trajectories.parallel import ParallelRun

    run = ParallelRun(groups, quarantine=quarantine, max_attribute_bytes=max_attribute_bytes, watermark=watermark,
                      chunk_actions=chunk_actions, progress=progress, writer=writer, executor=executor,
                      max_line_bytes=max_line_bytes, keep=keep)
    try:
        run.start()
        if writer is None:  # mine() builds DataFrames at the end: pandas loads now, beside the reading workers
            import pandas  # noqa: F401
        run.parse()
        yield from run.batches()
        if writer is not None:
            writer.append_parts(run.part_dirs())
        quarantine_orphan_feedback(run.feedback_spans, run.seen, run.q)
        run.finish_quarantine()
        _fill_report(report, run.stats, run.formats, run.spans_kept, run.q, run.agents)
    finally:
        run.close()


def _fill_report(report: MiningReport, stats: dict[str, int], formats: Counter[str], kept: int, q: Quarantine,
                 agents: Counter[str]) -> None:
    report.files = stats.get("files", 0)
    report.lines = stats.get("lines", 0)
    report.spans_read = stats.get("spans_read", 0)
    report.quarantined = {k: v for k, v in sorted(q.counts.items()) if v}
    report.first_quarantined = {k: list(q.first.get(k, ())) for k in report.quarantined}
    report.spans_kept = kept - report.quarantined.get("tool_without_action", 0)
    report.repaired_parents = stats.get("repaired_parents", 0)
    report.spans_without_actions = stats.get("spans_without_actions", 0)
    report.formats = {k: v for k, v in sorted(formats.items()) if v}
    report.episodes = stats.get("episodes", 0)
    report.actions = stats.get("actions", 0)
    report.episodes_before_since = stats.get("episodes_before_since", 0)
    report.non_utf8_lines = stats.get("non_utf8_lines", 0)
    report.actions_per_agent = {str(k): int(v) for k, v in sorted(agents.items())}
    report.actions_without_token_ids = {k[len(NO_TOKEN_IDS):]: v for k, v in sorted(stats.items())
                                        if k.startswith(NO_TOKEN_IDS) and v}
    report.served_merged = stats.get("served_merged", 0)
    report.replays = stats.get(REPLAYS, 0)
    report.shadows = stats.get(SHADOWS, 0)
    report.server_records_unjoined_in = {k[len(UNJOINED_IN):]: v for k, v in sorted(stats.items())
                                         if k.startswith(UNJOINED_IN) and v}
    report.server_records_unjoined = sum(report.server_records_unjoined_in.values())
    report.unsettled = stats.get("unsettled", 0)
    report.incomplete = stats.get(INCOMPLETE, 0)


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


def _to_dataset(episode_rows: list[dict], action_chunks: dict[str, list]) -> TrajectoryDataset:
    import pandas as pd

    from marft_lg.trajectories.dataset import TrajectoryDataset

    extra_e = ["source_format", "trace_ids", "settled"]
    episodes = pd.DataFrame(episode_rows, columns=[*EPISODE_COLUMNS, *extra_e])
    for col in ("start_time", "end_time"):
        episodes[col] = pd.to_datetime(episodes[col].astype("int64"), unit="ns", utc=True)
    episodes["n_actions"] = episodes["n_actions"].astype("int64")
    columns: dict[str, pd.Series] = {}
    for name in ACTION_FIELDS:  # one column at a time: each list is freed once converted
        dtype = _ACTION_DTYPES.get(name)
        chunks = action_chunks.pop(name)
        values = list(chain.from_iterable(chunks))
        del chunks
        columns[name] = pd.Series(values, dtype=None if dtype == "Int64" else dtype)
        del values
        if dtype == "Int64":
            columns[name] = columns[name].astype("Int64")
    actions = pd.DataFrame(columns, copy=False)
    return TrajectoryDataset(episodes=episodes, actions=actions)


_ACTION_DTYPES = {"order": "int64", "tool_errors": "int64", "step": "Int64", "input_tokens": "Int64",
                  "output_tokens": "Int64", "latency_s": "float64",
                  # lists and dicts: what pandas would infer, without scanning every value to infer it
                  **dict.fromkeys(("messages", "prompt_token_ids", "completion_token_ids", "completion_logprobs",
                                   "depends_on", "tool_calls"), object)}
