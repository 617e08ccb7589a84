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

import marshal
import multiprocessing as mp
import os
import pickle
import shutil
import tempfile
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import replace
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Protocol

from marft_lg.trajectories.assembly import episode_key
from marft_lg.trajectories.formats.base import FEEDBACK, SpanInfo
from marft_lg.trajectories.otlp import FileRange
from marft_lg.trajectories.pipeline import (
    assemble_batches,
    feedback_index,
    flatten,
    gc_paused,
    read_traces,
    table_columns,
)
from marft_lg.trajectories.quarantine import Quarantine

_BLOCK = 16 * 1024 * 1024


def default_workers() -> int:
    """Cores this process may use, at most 8 (mining is I/O- and memory-bound beyond that)."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    return max(1, min(8, n))


def plan_ranges(files: list[Path], workers: int, *, count_lines: bool = True) -> list[list[FileRange]]:
    """Cut `files` (in order) into at most `workers` contiguous groups of about equal bytes, splitting plain
    files at line boundaries (``.gz`` files stay whole); empty groups are dropped. With `count_lines` False a range
    that starts inside a file gets first_line 0, to be filled in by `number_lines` (the first group never needs it)."""
    sizes = [f.stat().st_size for f in files]
    total = sum(sizes)
    groups: list[list[FileRange]] = [[] for _ in range(max(1, workers))]
    g, assigned = 0, 0
    for path, size in zip(files, sizes, strict=True):
        start, line = 0, 1
        if size == 0:
            groups[g].append(FileRange(path))
            continue
        while start < size:
            room = int((g + 1) * total / len(groups)) - assigned
            last = g == len(groups) - 1
            if last or size - start <= room or path.name.endswith(".gz"):
                groups[g].append(FileRange(path, start, None, line))
                assigned += size - start
                if not last and assigned >= (g + 1) * total / len(groups):
                    g += 1
                break
            cut = _next_line_start(path, start + max(room, 1))
            cut_line = line + _count_newlines(path, start, cut) if count_lines else 0
            if cut >= size:
                groups[g].append(FileRange(path, start, None, line))
                assigned += size - start
                g += 1
                break
            groups[g].append(FileRange(path, start, cut, line))
            assigned += cut - start
            start, line = cut, cut_line
            g += 1
    return [grp for grp in groups if grp]


def number_lines(groups: list[list[FileRange]]) -> list[list[FileRange]]:
    """`groups` with the first line number of every range planned without counting (first_line 0) filled in,
    counting each file's newlines once, in order."""
    at: dict[Path, tuple[int, int]] = {}  # file -> (byte, line number) of the latest range start seen
    out = []
    for group in groups:
        numbered = []
        for r in group:
            if r.first_line == 0:
                pos, line = at.get(r.path, (0, 1))
                r = replace(r, first_line=line + _count_newlines(r.path, pos, r.start))
            at[r.path] = (r.start, r.first_line)
            numbered.append(r)
        out.append(numbered)
    return out


def _next_line_start(path: Path, pos: int) -> int:
    """The first line start after `pos`."""
    with path.open("rb") as fh:
        fh.seek(pos)
        fh.readline()
        return fh.tell()


def _count_newlines(path: Path, start: int, end: int) -> int:
    """Newlines in bytes [start, end) of `path`, read a block at a time into one buffer (a memory map would count
    the file's pages in this process's RSS)."""
    buf = bytearray(min(_BLOCK, max(end - start, 0)))
    newlines = 0
    with path.open("rb", buffering=0) as fh, memoryview(buf) as view:
        fh.seek(start)
        left = end - start
        while left > 0:
            n = fh.readinto(view[:min(_BLOCK, left)])
            if not n:
                break
            newlines += buf.count(b"\n", 0, n)
            left -= n
    return newlines


def _start_method() -> str:
    """fork when this process runs no other thread (cheap, and an unguarded script is not re-imported);
    spawn otherwise, since forking while another thread holds a lock can deadlock the child."""
    import threading

    if "fork" in mp.get_all_start_methods() and threading.active_count() == 1:
        return "fork"
    return "spawn"


# --- worker side ---------------------------------------------------------------------------------


def rows_file(index: int) -> str:
    """The name of worker `index`'s rows file (`mine`), in its `tmp` directory."""
    return f"worker-{index}.rows"


def quarantine_file(index: int) -> str:
    """The name of worker `index`'s quarantine records, in its `tmp` directory."""
    return f"quarantine-{index}.jsonl"


class RangeWorker:
    """The worker role of a run, whatever carries its messages (a pipe from a worker process here, Ray's object
    store from an actor in `marft_lg.distributed.mining`): `handle(cmd, arg)` yields the replies to one command.

    - ``parse``: read and interpret the ranges; one reply ("parsed", episode key per trace, feedback spans per
      trace, stats, spans per format, spans kept). The spans stay here.
    - ``ship`` (trace ids): one reply, the spans of those traces in read order (they leave this worker).
    - ``assemble`` (episodes as trace ids, their feedback, watermark, chunk_actions, to_file): assemble the episodes;
      with `to_file` the batches go to `tmp`/`rows_file(index)` (for `mine`), else each is a reply ("batch",
      episode columns, action columns) ready for parquet; then ("done", stats, episodes seen, quarantine counts,
      actions per agent). The last command.

    Quarantine records go to `tmp`/`quarantine_file(index)` when `quarantine` is set.
    """

    def __init__(self, index: int, ranges: list[FileRange], max_attribute_bytes: int, tmp: str | Path,
                 quarantine: bool, progress: Callable[[int], None] | None = None):
        self.index, self.ranges, self.max_attribute_bytes = index, ranges, max_attribute_bytes
        self.tmp, self.progress = Path(tmp), progress
        self.q = Quarantine(self.tmp / quarantine_file(index) if quarantine else None)
        self.by_trace: dict[str, list[SpanInfo]] = {}
        self.feedback: dict[str, list[SpanInfo]] = defaultdict(list)

    def handle(self, cmd: str, arg: Any = None) -> Iterator[Any]:
        if cmd == "parse":
            yield self._parse()
        elif cmd == "ship":  # spans of these traces, in read order: the parent merges or assembles them
            yield [s for t in arg for s in (*self.by_trace.pop(t, ()), *self.feedback.pop(t, ()))]
        elif cmd == "assemble":
            yield from self._assemble(*arg)
        else:
            raise ValueError(f"unknown mining command {cmd!r}")

    def _parse(self) -> tuple:
        stats: dict[str, int] = {}
        formats: Counter[str] = Counter()
        traces = read_traces(self.ranges, self.q, max_attribute_bytes=self.max_attribute_bytes, stats=stats,
                             formats=formats, progress=self.progress)
        kept = 0
        for t in list(traces):
            members = traces.pop(t)
            kept += len(members)
            spans = [s for s in members.values() if s.kind != FEEDBACK]
            if len(spans) < len(members):
                self.feedback[t] = [s for s in members.values() if s.kind == FEEDBACK]
            if spans:
                self.by_trace[t] = spans
        del traces
        # the episode key of each trace (no feedback span here); used for the traces no other worker read
        keys = {t: episode_key(spans) for t, spans in self.by_trace.items()}
        return "parsed", keys, dict(self.feedback), stats, dict(formats), kept

    def _assemble(self, episode_traces: dict[str, list[str]], fb_index: dict[str, dict[str, Any]],
                  watermark: int | None, chunk_actions: int, to_file: bool) -> Iterator[tuple]:
        episodes = {key: [s for t in tids for s in self.by_trace.pop(t)] for key, tids in episode_traces.items()}
        self.by_trace.clear()
        self.feedback.clear()
        st: dict[str, int] = {}
        seen: set[str] = set()
        agents: Counter[str] = Counter()
        batches = assemble_batches(episodes, self.q, st, fb_index, watermark, seen, chunk_actions, agents,
                                   share_strings=to_file)
        if to_file:  # mine(): rows wait on disk until the worker's spans are gone
            with (self.tmp / rows_file(self.index)).open("wb") as fh:
                for rows, cols in batches:
                    _dump_batch(fh, rows, flatten(cols))
        else:  # mine_to_parquet(): the parent writes the parquet part, so no worker loads pyarrow
            for rows, cols in batches:
                yield ("batch", *table_columns(rows, flatten(cols)))
                del rows, cols
        self.q.close()
        yield "done", st, seen, dict(self.q.counts), dict(agents)


def _worker_main(conn: Connection, index: int, ranges: list[FileRange], max_attribute_bytes: int, tmp: str,
                 quarantine: bool, counter: Any) -> None:
    """A worker process: answers the parent's commands on `conn` until it has assembled (see `RangeWorker`)."""
    def progress(n: int) -> None:
        counter.value = n

    try:
        with gc_paused():  # a spawned worker does not inherit the caller's paused collector
            worker = RangeWorker(index, ranges, max_attribute_bytes, tmp, quarantine, progress)
            cmd = ""
            while cmd != "assemble":
                cmd, arg = conn.recv()
                for msg in worker.handle(cmd, arg):
                    conn.send(msg)
                    del msg  # the parsed keys or a batch: not kept while waiting for the next command
                del arg
    except BaseException:  # report, do not hang the parent
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def _dump_batch(fh: Any, rows: list[dict], cols: dict[str, Any]) -> None:
    """Write a batch for `_load_batch`: the rows and plain column lists with marshal (about twice as fast as pickle
    both ways, for what came from JSON: dicts, lists, str, numbers), the flat columns with pickle."""
    plain = {k: v for k, v in cols.items() if type(v) is list}
    try:
        blob = marshal.dumps((rows, plain), 4)
    except ValueError:  # a value marshal cannot write
        pickle.dump((None, rows, cols), fh, protocol=pickle.HIGHEST_PROTOCOL)
        return
    flat = {k: v for k, v in cols.items() if k not in plain}
    pickle.dump((blob, list(cols), flat), fh, protocol=pickle.HIGHEST_PROTOCOL)


def _load_batch(fh: Any) -> tuple[list[dict], dict[str, Any]]:
    """The next batch written by `_dump_batch` (EOFError at the end)."""
    blob, names, flat = pickle.load(fh)
    if blob is None:
        return names, flat
    rows, plain = marshal.loads(blob)
    del blob
    return rows, {k: plain[k] if k in plain else flat[k] for k in names}


# --- parent side ---------------------------------------------------------------------------------


class Channel(Protocol):
    """The parent's end of one worker (a `RangeWorker`, wherever it runs)."""

    def send(self, cmd: str, arg: Any = None) -> None:
        """Give the worker its next command."""

    def recv(self) -> Any:
        """The next reply to the current command; RuntimeError when the worker failed or is gone."""

    def spans_read(self) -> int:
        """Spans the worker has read so far (progress; may lag)."""

    def release(self, names: list[str], tmp: Path) -> None:
        """The worker has answered its last command: put its files `names` (those that exist) into `tmp`, then let
        it go (its memory is free before the parent loads the rows)."""

    def close(self) -> None:
        """Stop the worker if it still runs (also after an error)."""


class RangeExecutor(Protocol):
    """Where the workers of a run live: worker processes on this machine (`ProcessExecutor`, the default) or, from
    `marft_lg.distributed.mining`, Ray actors. Every worker reads the files at the paths this process sees."""

    def start(self, index: int, ranges: list[FileRange], *, max_attribute_bytes: int, tmp: Path,
              quarantine: bool) -> Channel:
        """Start worker `index` on `ranges`; it writes its files (see `RangeWorker`) to `tmp` or to its own
        directory, which `Channel.release` copies into `tmp`."""

    def wait(self, channels: list[Channel], timeout: float | None) -> list[Channel]:
        """Those of `channels` with a reply ready (none after `timeout` seconds; None waits for one)."""


class ProcessExecutor:
    """One worker process per range group with a pipe each, forked from a single-threaded caller and spawned
    otherwise (see `_start_method`); workers write their files straight into the parent's `tmp`."""

    def __init__(self) -> None:
        self._ctx: Any = None

    def start(self, index: int, ranges: list[FileRange], *, max_attribute_bytes: int, tmp: Path,
              quarantine: bool) -> _ProcessChannel:
        if self._ctx is None:
            self._ctx = mp.get_context(_start_method())
        counter = self._ctx.Value("q", 0, lock=False)
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_worker_main, name=f"marft-mine-{index}", daemon=True,
                                 args=(child, index, ranges, max_attribute_bytes, str(tmp), quarantine, counter))
        proc.start()
        child.close()
        return _ProcessChannel(index, proc, parent, counter)

    def wait(self, channels: list[Channel], timeout: float | None) -> list[Channel]:
        ready = wait([c.conn for c in channels], timeout=timeout)  # type: ignore[attr-defined]
        return [c for c in channels if c.conn in ready]  # type: ignore[attr-defined]


class _ProcessChannel:
    def __init__(self, index: int, proc: Any, conn: Connection, counter: Any):
        self.index, self.proc, self.conn, self.counter = index, proc, conn, counter

    def send(self, cmd: str, arg: Any = None) -> None:
        self.conn.send((cmd, arg))

    def recv(self) -> Any:
        try:
            msg = self.conn.recv()
        except EOFError as exc:
            raise RuntimeError(f"mining worker {self.index} exited unexpectedly (exit code {self.proc.exitcode}); "
                               "out of memory? try workers=1") from exc
        if isinstance(msg, tuple) and msg and msg[0] == "error":
            raise RuntimeError(f"mining worker {self.index} failed:\n{msg[1]}")
        return msg

    def spans_read(self) -> int:
        return self.counter.value

    def release(self, names: list[str], tmp: Path) -> None:
        self.proc.join()  # its files are in `tmp` already

    def close(self) -> None:
        self.conn.close()  # a worker waiting for a command sees the end of the pipe and exits
        self.proc.join(timeout=5)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join()


class ParallelRun:
    """One mining run over range workers (`executor`: processes by default); `batches()` yields what
    `assemble_batches` would, and fills the tallies."""

    def __init__(self, groups: list[list[FileRange]], *, quarantine: str | Path | None, max_attribute_bytes: int,
                 watermark: int | None, chunk_actions: int, progress: Callable[[int], None] | None,
                 writer: Any = None, executor: RangeExecutor | None = None):
        self.groups, self.max_attribute_bytes = groups, max_attribute_bytes
        self.writer, self.parquet = writer, writer is not None
        self.watermark, self.chunk_actions, self.progress = watermark, chunk_actions, progress
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
                                         tmp=self._tmp, quarantine=self.quarantine_path is not None)
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
            w.send("assemble", (local, fb, self.watermark, self.chunk_actions, not self.parquet))
        episodes = {key: [s for t in tids for s in self._parent_traces.pop(t, ())] for key, tids in self._global.items()}
        self._parent_traces = {}
        fb = {k: fb_index[k] for k in episodes if k in fb_index}
        for rows, cols in assemble_batches(episodes, self.q, self.stats, fb, self.watermark, self.seen, self.chunk_actions,
                                           self.agents, share_strings=not self.parquet):
            yield rows, flatten(cols)
        done = self._write_parts() if self.parquet else [w.recv() for w in self._workers]
        for _, st, seen, qcounts, agents in done:
            self.agents.update(agents)
            for k, v in st.items():
                self.stats[k] = self.stats.get(k, 0) + v
            self.seen |= seen
            self.q.counts.update(qcounts)
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
