"""Mining on several cores: the input is cut into line-aligned byte ranges, one worker process per range.

1. Each worker reads and interprets its range (`read_traces`) and sends back each trace's episode key (from
   `assembly.episode_key`) and its feedback spans; its spans stay in the worker.
2. The parent finds traces read by more than one worker (a trace cut by a range boundary, or re-exported
   elsewhere), fetches their spans and merges them in input order (the first copy wins, later ones are
   quarantined as duplicates, exactly as one process would); then it decides every trace's episode.
3. Episodes whose traces all live in one worker are assembled there; the few that cross workers are
   fetched and assembled by the parent. For `mine`, workers leave their rows on disk (`_dump_batch`) and exit;
   for `mine_to_parquet` they stream their batches to the parent, which writes the first worker's into the
   output as they arrive and stages the others' as Arrow parts, appended in worker order at the end (each
   batch is parquet-encoded once). Only the parent loads pyarrow: its
   allocator and code pages cost ~80 MB in every process that converts to Arrow.

The tables are the same as a one-process run's: same spans, same episode keys, same assembly code.
Quarantine records are the same too; only their order in the file differs (workers' in input order, then
the parent's). Workers are forked from a single-threaded caller, spawned otherwise (see `_start_method`).

The worker role is `RangeWorker` (commands in, replies out) and the parent's is `ParallelRun`; what carries the
messages is a `RangeExecutor`: worker processes and pipes here (`ProcessExecutor`), Ray actors and the object store
in `marft_lg.distributed.mining`.
"""


from __future__ import annotations

import shutil
import tempfile
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from marft_lg.trajectories.assembly import episode_key
from marft_lg.trajectories.formats.base import FEEDBACK, SpanInfo
from marft_lg.trajectories.otlp import DEFAULT_MAX_LINE_BYTES, FileRange
from marft_lg.trajectories.pipeline import (
    assemble_batches,
    feedback_index,
    flatten,
    resolve_feedback,
    targeted,
    trace_threads,
)
from marft_lg.trajectories.quarantine import Quarantine
from marft_lg.trajectories.range_worker import (
    Channel,
    ProcessExecutor,
    RangeExecutor,
    _load_batch,
    quarantine_file,
    rows_file,
)
from marft_lg.trajectories.ranges import number_lines


class ParallelRun:
    """One mining run over range workers (`executor`: processes by default); `batches()` yields what
    `assemble_batches` would, and fills the tallies."""

    def __init__(self, groups: list[list[FileRange]], *, quarantine: str | Path | None, max_attribute_bytes: int,
                 watermark: int | None, chunk_actions: int, progress: Callable[[int], None] | None,
                 writer: Any = None, executor: RangeExecutor | None = None,
                 max_line_bytes: int = DEFAULT_MAX_LINE_BYTES, keep: frozenset[str] = frozenset()):
        self.groups, self.max_attribute_bytes, self.max_line_bytes = groups, max_attribute_bytes, max_line_bytes
        self.writer, self.parquet = writer, writer is not None
        self.watermark, self.chunk_actions, self.progress = watermark, chunk_actions, progress
        self.keep = keep  # the kinds of non-production episode kept (`pipeline.assemble_batches`)
        self.executor: RangeExecutor = executor if executor is not None else ProcessExecutor()
        self.quarantine_path = Path(quarantine) if quarantine is not None else None
        self._tmp = Path(tempfile.mkdtemp(prefix="marft-mine-"))
        # the parent's own records (cross-worker duplicates, feedback, cross-worker episodes) go after the workers'
        self.q = Quarantine(self._tmp / "quarantine-parent.jsonl" if quarantine is not None else None)
        self.stats: dict[str, int] = {}
        self.formats: Counter[str] = Counter()
        self.spans_kept = 0
        self.seen: set[str] = set()
        self.agents: Counter[str] = Counter()
        self.feedback_spans: list[SpanInfo] = []
        self._workers: list[Channel] = []

    # lifecycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start one worker per group; the line numbers of the later groups (when planned without counting) are
        counted while the first worker already reads."""
        for i in range(len(self.groups)):
            if i == 1:
                self.groups = number_lines(self.groups)
            worker = self.executor.start(i, self.groups[i], max_attribute_bytes=self.max_attribute_bytes,
                                         tmp=self._tmp, quarantine=self.quarantine_path is not None,
                                         max_line_bytes=self.max_line_bytes)
            self._workers.append(worker)
            worker.send("parse")

    def close(self) -> None:
        self.q.close()
        for w in self._workers:
            w.close()
        shutil.rmtree(self._tmp, ignore_errors=True)

    # the run --------------------------------------------------------------------------------------
    def parse(self) -> None:
        """Phases 1-2: workers read; the parent merges shared traces and decides every trace's episode."""
        pending = list(self._workers)
        parsed: dict[int, tuple] = {}
        while pending:
            ready = self.executor.wait(pending, 0.5)
            if self.progress is not None:
                self.progress(sum(w.spans_read() for w in self._workers))
            for w in ready:
                parsed[self._workers.index(w)] = w.recv()
                pending.remove(w)
        keys_by_worker: list[dict[str, str]] = []
        fb_by_worker: list[dict[str, list[SpanInfo]]] = []
        readers: Counter[str] = Counter()  # trace id -> how many workers read it
        for i in range(len(self._workers)):
            _, keys, feedback, stats, formats, kept = parsed.pop(i)
            keys_by_worker.append(keys)
            readers.update(keys.keys() | feedback.keys())
            for k, v in stats.items():
                self.stats[k] = self.stats.get(k, 0) + v
            self.formats.update(formats)
            self.spans_kept += kept
            fb_by_worker.append(feedback)
        shared = sorted(t for t, n in readers.items() if n > 1)
        del readers
        merged_traces, merged_feedback = self._merge_shared(shared)
        shared_set = set(shared)
        for feedback in fb_by_worker:
            for t, spans in feedback.items():
                if t not in shared_set:
                    self.feedback_spans.extend(spans)
        self.feedback_spans.extend(merged_feedback)
        # every trace's episode key, and where its spans are
        self._parent_traces = merged_traces  # trace id -> spans (read order), held here
        trace_key: dict[str, str] = {t: episode_key(spans) for t, spans in merged_traces.items()}
        home: dict[str, int] = {}
        for i, keys in enumerate(keys_by_worker):
            if shared_set:
                keys = {t: k for t, k in keys.items() if t not in shared_set}
            trace_key.update(keys)
            home.update(dict.fromkeys(keys, i))
        episodes: dict[str, list[str]] = defaultdict(list)
        for t in sorted(trace_key):
            episodes[trace_key[t]].append(t)
        self._local: list[dict[str, list[str]]] = [{} for _ in self._workers]
        self._global: dict[str, list[str]] = {}
        for key, tids in episodes.items():
            if len(tids) == 1:  # the usual episode: one trace
                owner = home.get(tids[0], -1)
                if owner >= 0:
                    self._local[owner][key] = tids
                else:
                    self._global[key] = tids
                continue
            owners = {home.get(t, -1) for t in tids}
            if len(owners) == 1 and -1 not in owners:
                self._local[owners.pop()][key] = tids
            else:
                self._global[key] = tids
        if targeted(self.feedback_spans):  # feedback by thread or trace: point it at its episode now
            threads = trace_threads(self._parent_traces.items())
            for w in self._workers:
                w.send("threads")
            for w in self._workers:
                threads.update(w.recv())
            self.feedback_spans = resolve_feedback(self.feedback_spans, trace_key, threads, self.q)
        wanted: list[list[str]] = [[] for _ in self._workers]
        for tids in self._global.values():
            for t in tids:
                if t in home:
                    wanted[home[t]].append(t)
        for i, tids in enumerate(wanted):
            if tids:
                self._workers[i].send("ship", tids)
                for s in self._workers[i].recv():
                    self._parent_traces.setdefault(s.trace_id, []).append(s)

    def _merge_shared(self, shared: list[str]) -> tuple[dict[str, list[SpanInfo]], list[SpanInfo]]:
        """Fetch traces read by several workers and merge them in input order, dropping re-exported copies."""
        traces: dict[str, list[SpanInfo]] = defaultdict(list)
        feedback: list[SpanInfo] = []
        if not shared:
            return traces, feedback
        first: dict[tuple[str, str], SpanInfo] = {}
        for w in self._workers:
            w.send("ship", shared)
            for s in w.recv():
                key = (s.trace_id, s.span_id)
                if key in first:
                    self.q.add("duplicate", s.source, trace_id=s.trace_id, span_id=s.span_id,
                               detail=f"first read at {first[key].source}")
                    self.formats[s.fmt] -= 1
                    self.spans_kept -= 1
                    continue
                first[key] = s
                (feedback if s.kind == FEEDBACK else traces[s.trace_id]).append(s)
        return traces, feedback

    def batches(self) -> Iterator[tuple[list[dict], dict[str, Any]]]:
        """Phase 3: workers and the parent assemble; yields (episode rows, action columns) with token columns
        as `TokenColumn`s: the parent's, then (`mine`) the workers', which they write to disk and which are
        loaded only once the workers are gone, so that their span memory and the rows never add up.
        In parquet mode the workers stream their batches here (see `_write_parts`)."""
        fb_index = feedback_index(self.feedback_spans, self.q)
        for i, w in enumerate(self._workers):
            local = self._local[i]
            fb = {k: fb_index[k] for k in local if k in fb_index}
            w.send("assemble", (local, fb, self.watermark, self.chunk_actions, not self.parquet, self.keep))
        episodes = {key: [s for t in tids for s in self._parent_traces.pop(t, ())] for key, tids in self._global.items()}
        self._parent_traces = {}
        fb = {k: fb_index[k] for k in episodes if k in fb_index}
        for rows, cols in assemble_batches(episodes, self.q, self.stats, fb, self.watermark, self.seen, self.chunk_actions,
                                           self.agents, share_strings=not self.parquet, keep=self.keep):
            yield rows, flatten(cols)
        done = self._write_parts() if self.parquet else [w.recv() for w in self._workers]
        for _, st, seen, qcounts, qfirst, agents in done:
            self.agents.update(agents)
            for k, v in st.items():
                self.stats[k] = self.stats.get(k, 0) + v
            self.seen |= seen
            self.q.merge(qcounts, qfirst)
        for i, w in enumerate(self._workers):  # their memory is free before the rows are loaded here
            files = [] if self.parquet else [rows_file(i)]
            w.release([*files, quarantine_file(i)] if self.quarantine_path is not None else files, self._tmp)
        if not self.parquet:
            for i in range(len(self._workers)):
                path = self._tmp / rows_file(i)
                with path.open("rb") as fh:
                    while True:
                        try:
                            batch = _load_batch(fh)
                        except EOFError:
                            break
                        yield batch
                        del batch
                path.unlink()

    def _write_parts(self) -> list[tuple]:
        """Write the batches the workers stream back as they arrive, in the order each worker sent them: the
        first worker's straight into `writer` (after the parent's own batches), every other worker's to its own
        Arrow part (`part_dirs`); returns every worker's final "done" message, in worker order."""
        from marft_lg.trajectories.parquet_writer import ArrowPartWriter

        done: dict[int, tuple] = {}
        writers = [self.writer, *(ArrowPartWriter(d) for d in self.part_dirs())]
        try:
            while len(done) < len(self._workers):
                for w in self.executor.wait([w for i, w in enumerate(self._workers) if i not in done], None):
                    i = self._workers.index(w)
                    msg = w.recv()
                    if msg[0] == "batch":
                        writers[i].write_columns(msg[1], msg[2])
                    else:
                        done[i] = msg
                    del msg
        finally:
            for w in writers[1:]:
                w.close()
        return [done[i] for i in range(len(self._workers))]

    def part_dirs(self) -> list[Path]:
        """Arrow parts staged for the workers after the first, in input order."""
        return [self._tmp / f"part-{i}" for i in range(1, len(self._workers))]

    def finish_quarantine(self) -> None:
        """Append the workers' quarantine records (in input order), then the parent's, to the quarantine file."""
        self.q.close()
        if self.quarantine_path is None:
            return
        parts = [self._tmp / quarantine_file(i) for i in range(len(self._workers))] + [self.q.path]
        if not any(p.exists() for p in parts):
            return
        self.quarantine_path.parent.mkdir(parents=True, exist_ok=True)
        with self.quarantine_path.open("ab") as out:
            for p in parts:
                if p.exists():
                    with p.open("rb") as fh:
                        shutil.copyfileobj(fh, out)
