"""SQLite job store: one row per retraining run, and each job's watermark.

A run is inserted as `running` before any work starts and finished exactly once. Every transaction is
durable when it returns (`PRAGMA synchronous = FULL`: SQLite fsyncs its journal and the database). Finishing a
successful run and advancing the watermark happen in ONE transaction, so the watermark can never
move past a window whose run was not recorded (and a recorded success always moved it).
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

RUNNING = "running"
SKIPPED = "skipped"
PROMOTED = "promoted"
REJECTED = "rejected"
FAILED = "failed"
INTERRUPTED = "interrupted"
CRASHED = "crashed"
STATUSES = (RUNNING, SKIPPED, PROMOTED, REJECTED, FAILED, INTERRUPTED, CRASHED)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    job TEXT NOT NULL,
    status TEXT NOT NULL,
    started_at TEXT NOT NULL,
    ended_at TEXT,
    pid INTEGER,
    hostname TEXT,
    window_start TEXT,
    window_end TEXT,
    n_episodes INTEGER,
    baseline TEXT,
    candidate TEXT,
    live_after TEXT,
    metrics TEXT,
    report_path TEXT,
    run_dir TEXT,
    message TEXT
);
CREATE INDEX IF NOT EXISTS runs_job_started ON runs (job, started_at);
CREATE TABLE IF NOT EXISTS watermarks (
    job TEXT PRIMARY KEY,
    value TEXT NOT NULL,
    run_id TEXT,
    updated_at TEXT NOT NULL
);
"""
_JSON_FIELDS = ("baseline", "candidate", "live_after", "metrics")
OUR_TABLES = frozenset({"runs", "watermarks", "scheduler_entries", "apscheduler_jobs"})  # what a job store file holds (the scheduler's too)


class NotAJobStore(ValueError):
    """An SQLite file of another program: opened to read, it is refused rather than given our tables."""


@dataclass
class RunRecord:
    """One retraining run as stored."""

    run_id: str
    job: str
    status: str
    started_at: str
    ended_at: str | None = None
    pid: int | None = None
    hostname: str | None = None
    window_start: str | None = None
    window_end: str | None = None
    n_episodes: int | None = None
    baseline: dict[str, str] | None = None
    candidate: dict[str, str] | None = None
    live_after: dict[str, str] | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    report_path: str | None = None
    run_dir: str | None = None
    message: str | None = None


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


class JobStore:
    """Run records and watermarks in one SQLite file (short connections; safe across processes)."""

    def __init__(self, path: str | Path, *, foreign_ok: bool = True):
        """`foreign_ok=False` (the CLI reading a `--store` it was given) refuses an SQLite file whose tables are
        another program's (`NotAJobStore`), before anything is written to it."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as db:
            if not foreign_ok:
                tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
                if tables and not tables & OUR_TABLES:
                    raise NotAJobStore(f"{self.path} is an SQLite database of another program (tables: "
                                       f"{', '.join(sorted(tables)[:5])}), not a job store; nothing was changed")
            db.executescript(_SCHEMA)

    @contextlib.contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA synchronous = FULL")  # every commit is fsynced (journal and database file)
        try:
            yield db
        finally:
            db.close()

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    # --- runs ---------------------------------------------------------------------------------
    def start_run(self, run_id: str, job: str, *, pid: int, hostname: str, run_dir: str | None = None) -> RunRecord:
        with self._transaction() as db:
            db.execute(
                "INSERT INTO runs (run_id, job, status, started_at, pid, hostname, run_dir) VALUES (?,?,?,?,?,?,?)",
                (run_id, job, RUNNING, _now(), pid, hostname, run_dir),
            )
        return self.get(run_id)

    def update_run(self, run_id: str, **values: Any) -> None:
        """Set fields of a run (JSON fields given as dicts)."""
        with self._transaction() as db:
            _set(db, run_id, values)

    def finish_run(self, run_id: str, status: str, *, advance_watermark_to: str | None = None,
                   message: str | None = None, **values: Any) -> RunRecord:
        """Close a run; when `advance_watermark_to` is given its job's watermark moves in the same transaction."""
        if status == RUNNING:
            raise ValueError("finish_run needs a final status")
        job = self.get(run_id).job
        with self._transaction() as db:
            _set(db, run_id, {"status": status, "ended_at": _now(), "message": message, **values})
            if advance_watermark_to is not None:
                db.execute(
                    "INSERT INTO watermarks (job, value, run_id, updated_at) VALUES (?,?,?,?) "
                    "ON CONFLICT(job) DO UPDATE SET value = excluded.value, run_id = excluded.run_id, "
                    "updated_at = excluded.updated_at",
                    (job, advance_watermark_to, run_id, _now()),
                )
        return self.get(run_id)

    def running_runs(self, job: str) -> list[RunRecord]:
        """The runs of `job` still recorded `running` (dead ones, when the caller holds the job's lock)."""
        return [r for r in self.runs(job=job) if r.status == RUNNING]

    def close_crashed(self, run_id: str, reason: str) -> RunRecord:
        """Record one dead `running` run as `crashed` (its window is redone; the watermark does not move)."""
        r = self.get(run_id)
        return self.finish_run(run_id, CRASHED, message=f"{reason} (was pid {r.pid} on {r.hostname})")

    def mark_crashed(self, job: str, reason: str) -> list[RunRecord]:
        """Close every `running` run of `job` as `crashed` (call only while holding the job's lock)."""
        stale = [r for r in self.runs(job=job) if r.status == RUNNING]
        for r in stale:
            self.update_run(r.run_id, status=CRASHED, ended_at=_now(),
                            message=f"{reason} (was pid {r.pid} on {r.hostname})")
        return [self.get(r.run_id) for r in stale]

    def get(self, run_id: str) -> RunRecord:
        with self._connect() as db:
            row = db.execute("SELECT * FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        if row is None:
            raise KeyError(f"no run {run_id!r} in {self.path}; `marft-lg jobs list` shows the recorded runs")
        return _record(row)

    def runs(self, *, job: str | None = None, limit: int | None = None) -> list[RunRecord]:
        """Runs, newest first."""
        sql = "SELECT * FROM runs" + (" WHERE job = ?" if job else "") + " ORDER BY started_at DESC, rowid DESC"
        if limit:
            sql += f" LIMIT {int(limit)}"
        with self._connect() as db:
            rows = db.execute(sql, (job,) if job else ()).fetchall()
        return [_record(r) for r in rows]

    # --- watermarks ---------------------------------------------------------------------------
    def watermark(self, job: str) -> str | None:
        """The end of the last window a run of `job` consumed (ISO time), or None."""
        with self._connect() as db:
            row = db.execute("SELECT value FROM watermarks WHERE job = ?", (job,)).fetchone()
        return None if row is None else row["value"]


def _set(db: sqlite3.Connection, run_id: str, values: dict[str, Any]) -> None:
    if not values:
        return
    bad = set(values) - (set(RunRecord.__dataclass_fields__) - {"run_id"})
    if bad:
        raise ValueError(f"unknown run fields {sorted(bad)}")
    if "status" in values and values["status"] not in STATUSES:
        raise ValueError(f"unknown run status {values['status']!r}; known: {STATUSES}")
    cols = ", ".join(f"{k} = ?" for k in values)
    params = [json.dumps(v, default=str) if k in _JSON_FIELDS and v is not None else v for k, v in values.items()]
    if db.execute(f"UPDATE runs SET {cols} WHERE run_id = ?", [*params, run_id]).rowcount == 0:
        raise KeyError(f"no run {run_id!r}")


def _record(row: sqlite3.Row) -> RunRecord:
    data = dict(row)
    for k in _JSON_FIELDS:
        if data.get(k) is not None:
            data[k] = json.loads(data[k])
    data["metrics"] = data.get("metrics") or {}
    return RunRecord(**data)
