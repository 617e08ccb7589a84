"""One mining worker (`RangeWorker`: reads and interprets its byte ranges, assembles the episodes it holds whole,
answers the parent's commands) and what carries its messages (`Channel`, `RangeExecutor`): a worker process and a
pipe here (`ProcessExecutor`), Ray actors in `marft_lg.distributed.mining`."""


from __future__ import annotations

import marshal
import multiprocessing as mp
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from datetime import datetime
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from marft_lg.trajectories.assembly import episode_key
from marft_lg.trajectories.flat_columns import TokenColumn
from marft_lg.trajectories.formats.base import FEEDBACK, SpanInfo
from marft_lg.trajectories.otlp import DEFAULT_MAX_LINE_BYTES, FileRange
from marft_lg.trajectories.pipeline import (
    assemble_batches,
    flatten,
    gc_paused,
    read_traces,
    table_columns,
    trace_threads,
)
from marft_lg.trajectories.quarantine import Quarantine


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
    - ``assemble`` (episodes as trace ids, their feedback, watermark, chunk_actions, to_file, the kinds of
      non-production episode kept): assemble the episodes;
      with `to_file` the batches go to `tmp`/`rows_file(index)` (for `mine`), else each is a reply ("batch",
      episode columns, action columns) ready for parquet; then ("done", stats, episodes seen, quarantine counts,
      the first sources of each quarantine reason, actions per agent). The last command.

    Quarantine records go to `tmp`/`quarantine_file(index)` when `quarantine` is set.
    """

    def __init__(self, index: int, ranges: list[FileRange], max_attribute_bytes: int, tmp: str | Path,
                 quarantine: bool, progress: Callable[[int], None] | None = None,
                 max_line_bytes: int = DEFAULT_MAX_LINE_BYTES):
        self.index, self.ranges, self.max_attribute_bytes = index, ranges, max_attribute_bytes
        self.max_line_bytes = max_line_bytes
        self.tmp, self.progress = Path(tmp), progress
        self.q = Quarantine(self.tmp / quarantine_file(index) if quarantine else None)
        self.by_trace: dict[str, list[SpanInfo]] = {}
        self.feedback: dict[str, list[SpanInfo]] = defaultdict(list)

    def handle(self, cmd: str, arg: Any = None) -> Iterator[Any]:
        if cmd == "parse":
            yield self._parse()
        elif cmd == "ship":  # spans of these traces, in read order: the parent merges or assembles them
            yield [s for t in arg for s in (*self.by_trace.pop(t, ()), *self.feedback.pop(t, ()))]
        elif cmd == "threads":  # each trace's thread and start: feedback about a thread finds its episode
            yield trace_threads(self.by_trace.items())
        elif cmd == "assemble":
            yield from self._assemble(*arg)
        else:
            raise ValueError(f"unknown mining command {cmd!r}")

    def _parse(self) -> tuple:
        stats: dict[str, int] = {}
        formats: Counter[str] = Counter()
        traces = read_traces(self.ranges, self.q, max_attribute_bytes=self.max_attribute_bytes, stats=stats,
                             formats=formats, progress=self.progress, max_line_bytes=self.max_line_bytes)
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
                  watermark: int | None, chunk_actions: int, to_file: bool,
                  keep: frozenset[str] = frozenset()) -> Iterator[tuple]:
        episodes = {key: [s for t in tids for s in self.by_trace.pop(t)] for key, tids in episode_traces.items()}
        self.by_trace.clear()
        self.feedback.clear()
        st: dict[str, int] = {}
        seen: set[str] = set()
        agents: Counter[str] = Counter()
        batches = assemble_batches(episodes, self.q, st, fb_index, watermark, seen, chunk_actions, agents,
                                   share_strings=to_file, keep=keep)
        if to_file:  # mine(): rows wait on disk until the worker's spans are gone
            with (self.tmp / rows_file(self.index)).open("wb") as fh:
                for rows, cols in batches:
                    _dump_batch(fh, rows, flatten(cols))
        else:  # mine_to_parquet(): the parent writes the parquet part, so no worker loads pyarrow
            for rows, cols in batches:
                yield ("batch", *table_columns(rows, flatten(cols)))
                del rows, cols
        self.q.close()
        yield "done", st, seen, dict(self.q.counts), dict(self.q.first), dict(agents)


def _worker_main(conn: Connection, index: int, ranges: list[FileRange], max_attribute_bytes: int, tmp: str,
                 quarantine: bool, counter: Any, max_line_bytes: int) -> None:
    """A worker process: answers the parent's commands on `conn` until it has assembled (see `RangeWorker`)."""
    def progress(n: int) -> None:
        counter.value = n

    try:
        with gc_paused():  # a spawned worker does not inherit the caller's paused collector
            worker = RangeWorker(index, ranges, max_attribute_bytes, tmp, quarantine, progress, max_line_bytes)
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


_BATCH_PLAIN, _BATCH_TAGGED = 1, 2  # a batch record's mode: marshal as is, or with `_tagged` values
_DATETIME_TAG = "\x00marft-datetime"


def _dump_batch(fh: Any, rows: list[dict], cols: dict[str, Any]) -> None:
    """Write a batch for `_load_batch` as plain data only (nothing that can run code on load): a length-prefixed
    marshal header (rows, list columns, column order, flat column layout), then the `TokenColumn`s' raw array bytes."""
    plain = {k: v for k, v in cols.items() if type(v) is list}
    arrays = {k: _flat_arrays(k, v) for k, v in cols.items() if k not in plain}
    layout = {k: (cols[k].kind, [(a.dtype.str, a.nbytes) for a in arrs]) for k, arrs in arrays.items()}
    try:
        head = marshal.dumps((_BATCH_PLAIN, rows, plain, list(cols), layout), 4)
    except ValueError:  # a value marshal cannot write (a datetime, a numpy scalar): tagged plain data instead
        head = marshal.dumps((_BATCH_TAGGED, _tagged(rows), _tagged(plain), list(cols), layout), 4)
    fh.write(len(head).to_bytes(8, "little"))
    fh.write(head)
    for arrs in arrays.values():
        for a in arrs:
            fh.write(memoryview(a).cast("B"))


def _load_batch(fh: Any) -> tuple[list[dict], dict[str, Any]]:
    """The next batch written by `_dump_batch` (EOFError at the end)."""
    mode, rows, plain, names, layout = marshal.loads(_read_exactly(fh, int.from_bytes(_read_exactly(fh, 8), "little")))
    if mode == _BATCH_TAGGED:
        rows, plain = _untagged(rows), _untagged(plain)
    flat = {}
    for name, (kind, parts) in layout.items():
        values, offsets, valid = (np.frombuffer(_read_exactly(fh, n), dtype=np.dtype(dt)) for dt, n in parts)
        flat[name] = TokenColumn(kind=kind, values=values, offsets=offsets, valid=valid)  # read-only: no copy
    return rows, {k: plain[k] if k in plain else flat[k] for k in names}


def _read_exactly(fh: Any, size: int) -> bytes:
    data = fh.read(size)
    if len(data) < size:
        raise EOFError("no more batches" if not data else f"a batch record cut short ({len(data)} of {size} bytes)")
    return data


def _flat_arrays(name: str, col: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if not isinstance(col, TokenColumn):
        raise TypeError(f"batch column {name!r} is a {type(col).__name__}, not a list or a TokenColumn")
    return (np.ascontiguousarray(col.values), np.ascontiguousarray(col.offsets, np.int64),
            np.ascontiguousarray(col.valid, bool))


def _tagged(value: Any) -> Any:
    """`value` with what marshal cannot write made plain: datetimes tagged, numpy values as Python ones."""
    if isinstance(value, dict):
        return {k: _tagged(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_tagged(v) for v in value)
    if isinstance(value, datetime):
        return (_DATETIME_TAG, value.isoformat())
    if isinstance(value, np.generic | np.ndarray):
        return value.tolist()
    return value


def _untagged(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _untagged(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_untagged(v) for v in value]
    if isinstance(value, tuple):
        if len(value) == 2 and value[0] == _DATETIME_TAG:
            return datetime.fromisoformat(value[1])
        return tuple(_untagged(v) for v in value)
    return value


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
              quarantine: bool, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> Channel:
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
              quarantine: bool, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> _ProcessChannel:
        if self._ctx is None:
            self._ctx = mp.get_context(_start_method())
        counter = self._ctx.Value("q", 0, lock=False)
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_worker_main, name=f"marft-mine-{index}", daemon=True,
                                 args=(child, index, ranges, max_attribute_bytes, str(tmp), quarantine, counter,
                                       max_line_bytes))
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
