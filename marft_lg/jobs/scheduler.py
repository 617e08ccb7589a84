"""`marft-lg schedule`: APScheduler 3 with a cron trigger and a SQLite job store.

The scheduler entry (its trigger and next fire time) is persisted in the job's SQLite file, so a
run that fell due while the scheduler was down still starts on restart when it is at most
`misfire_grace_s` late (several missed runs coalesce into one). Each fire runs `marft-lg retrain`
in a child process: a crash or OOM there never takes the scheduler down, and memory is returned.
The persisted entry is plain JSON (the cron fields, timezone, next run time, job name); the callable is
always this module's `_fire`, never read from the file, and a pickled table of an older version is refused.
SIGTERM/SIGINT: no new runs start, the running child gets SIGTERM (it records `interrupted` and
releases its lock), and the scheduler exits once it has.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from apscheduler.job import Job
from apscheduler.jobstores.base import BaseJobStore, ConflictingIdError, JobLookupError
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.cron import CronTrigger
from apscheduler.util import datetime_to_utc_timestamp, utc_timestamp_to_datetime

from marft_lg.jobs.config import RetrainJob


def cron_trigger(expression: str, timezone: str = "UTC") -> CronTrigger:
    """Standard crontab (`min hour dom month dow`, Sunday = 0 or 7), or 6 fields with seconds first.

    APScheduler numbers weekdays from Monday = 0, so numeric weekdays are translated to names.
    """
    fields = expression.split()
    if len(fields) not in (5, 6):
        raise ValueError(
            f"cron expression {expression!r} has {len(fields)} fields; use 5 (min hour dom month dow) "
            "or 6 (sec min hour dom month dow)"
        )
    second, (minute, hour, day, month, dow) = (fields[0] if len(fields) == 6 else "0"), fields[-5:]
    try:
        return CronTrigger(second=second, minute=minute, hour=hour, day=day, month=month,
                           day_of_week=_crontab_weekdays(dow), timezone=timezone)
    except ValueError as exc:
        raise ValueError(f"invalid cron expression {expression!r} (job setting `schedule`): {exc}") from exc


_DAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")


def _crontab_weekdays(field: str) -> str:
    """Crontab weekday field (0/7 = Sunday, names allowed) -> an explicit APScheduler name list."""
    if field in ("*", "?"):
        return "*"
    days: set[int] = set()
    for part in field.lower().split(","):
        rng, _, step = part.partition("/")
        if rng == "*":
            lo, hi = 0, 6
        else:
            a, _, b = rng.partition("-")
            lo = _day_number(a, field)
            hi = _day_number(b, field) if b else (6 if step else lo)
            if b and hi == 0 and lo > 0:
                hi = 7
        if hi < lo:
            raise ValueError(f"invalid weekday range {part!r} in {field!r}")
        days.update(d % 7 for d in range(lo, hi + 1, int(step) if step else 1))
    return ",".join(_DAYS[d] for d in sorted(days))


def _day_number(token: str, field: str) -> int:
    if token.isdigit() and 0 <= int(token) <= 7:
        return int(token)
    if token[:3] in _DAYS:
        return _DAYS.index(token[:3])
    raise ValueError(f"invalid weekday {token!r} in {field!r} (use 0-7 or sun..sat)")


LEGACY_TABLE = "apscheduler_jobs"
_FIRE_REF = "marft_lg.jobs.scheduler:_fire"


class LegacySchedulerStore(ValueError):
    """The job store file holds an older marft_lg's scheduler table of pickled rows, which is never read."""


def refuse_legacy_table(path: str | Path) -> None:
    """Raise `LegacySchedulerStore` if `path` holds the old pickled `apscheduler_jobs` table (never unpickled)."""
    path = Path(path)
    if not path.exists():
        return
    db = sqlite3.connect(path, timeout=30.0)
    try:
        found = db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (LEGACY_TABLE,)).fetchone()
    finally:
        db.close()
    if found:
        raise LegacySchedulerStore(
            f"{path} holds a scheduler table from an older marft_lg ({LEGACY_TABLE}: pickled rows, never read): "
            f"delete that table (sqlite3 {path} 'DROP TABLE {LEGACY_TABLE}') or the file, and run "
            "`marft-lg schedule` again")


def _trigger_data(trigger: Any) -> dict[str, Any]:
    """A cron trigger as plain data: its explicitly set fields, timezone, start/end dates and jitter."""
    if not isinstance(trigger, CronTrigger):
        raise ValueError(f"the scheduler store keeps cron triggers only, not {type(trigger).__name__}")
    tz = trigger.timezone
    return {"fields": {f.name: str(f) for f in trigger.fields if not f.is_default},
            "timezone": getattr(tz, "key", None) or str(tz),
            "start_date": trigger.start_date.isoformat() if trigger.start_date else None,
            "end_date": trigger.end_date.isoformat() if trigger.end_date else None,
            "jitter": trigger.jitter}


def _trigger_from(data: dict[str, Any]) -> CronTrigger:
    return CronTrigger(**{str(k): str(v) for k, v in data["fields"].items()}, timezone=data["timezone"],
                       start_date=data.get("start_date"), end_date=data.get("end_date"), jitter=data.get("jitter"))


class SQLiteJobStore(BaseJobStore):
    """APScheduler job store of plain JSON rows in a SQLite table (stdlib `sqlite3`); nothing in it is code.

    Each row is one cron entry of `_fire`: its id, name, job-name argument, trigger fields and timezone,
    misfire/coalesce settings and next run time. Rebuilding a job never imports or unpickles what the row says.
    """

    def __init__(self, path: str | Path, tablename: str = "scheduler_entries"):
        super().__init__()
        self.path = Path(path)
        self.table = tablename

    @contextlib.contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(self.path, timeout=30.0)
        try:
            with db:  # commits, or rolls back on error
                yield db
        finally:
            db.close()

    def start(self, scheduler, alias):
        super().start(scheduler, alias)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        refuse_legacy_table(self.path)
        with self._db() as db:
            db.execute(f"CREATE TABLE IF NOT EXISTS {self.table} "
                       "(id TEXT PRIMARY KEY, next_run_time REAL, entry TEXT NOT NULL)")
            db.execute(f"CREATE INDEX IF NOT EXISTS {self.table}_next ON {self.table} (next_run_time)")

    def lookup_job(self, job_id):
        with self._db() as db:
            row = db.execute(f"SELECT entry, next_run_time FROM {self.table} WHERE id = ?", (job_id,)).fetchone()
        return self._reconstitute(job_id, row[0], row[1]) if row else None

    def get_due_jobs(self, now):
        return self._jobs("WHERE next_run_time <= ?", (datetime_to_utc_timestamp(now),))

    def get_next_run_time(self):
        with self._db() as db:
            row = db.execute(f"SELECT MIN(next_run_time) FROM {self.table} WHERE next_run_time IS NOT NULL").fetchone()
        return utc_timestamp_to_datetime(row[0]) if row and row[0] is not None else None

    def get_all_jobs(self):
        jobs = self._jobs("", ())
        self._fix_paused_jobs_sorting(jobs)
        return jobs

    def add_job(self, job):
        entry = self._entry(job)
        try:
            with self._db() as db:
                db.execute(f"INSERT INTO {self.table} (id, next_run_time, entry) VALUES (?,?,?)",
                           (job.id, datetime_to_utc_timestamp(job.next_run_time), entry))
        except sqlite3.IntegrityError:
            raise ConflictingIdError(job.id) from None

    def update_job(self, job):
        entry = self._entry(job)
        with self._db() as db:
            cur = db.execute(f"UPDATE {self.table} SET next_run_time = ?, entry = ? WHERE id = ?",
                             (datetime_to_utc_timestamp(job.next_run_time), entry, job.id))
        if cur.rowcount == 0:
            raise JobLookupError(job.id)

    def remove_job(self, job_id):
        with self._db() as db:
            cur = db.execute(f"DELETE FROM {self.table} WHERE id = ?", (job_id,))
        if cur.rowcount == 0:
            raise JobLookupError(job_id)

    def remove_all_jobs(self):
        with self._db() as db:
            db.execute(f"DELETE FROM {self.table}")

    @staticmethod
    def _entry(job: Job) -> str:
        """The job as a JSON row; only `_fire` with string arguments can be stored."""
        if job.func_ref != _FIRE_REF or job.kwargs or not all(isinstance(a, str) for a in job.args):
            raise ValueError(f"the scheduler store keeps `{_FIRE_REF}(job_name)` entries only, not {job.func_ref}")
        return json.dumps({"version": 1, "name": job.name, "args": list(job.args), "executor": job.executor,
                           "trigger": _trigger_data(job.trigger), "misfire_grace_time": job.misfire_grace_time,
                           "coalesce": job.coalesce, "max_instances": job.max_instances})

    def _reconstitute(self, job_id: str, entry: str, next_run: float | None) -> Job:
        data = json.loads(entry)
        if data.get("version") != 1:
            raise ValueError(f"scheduler entry version {data.get('version')!r} is not 1")
        job = Job.__new__(Job)
        job.__setstate__({
            "version": 1, "id": job_id, "func": _FIRE_REF, "trigger": _trigger_from(data["trigger"]),
            "executor": str(data["executor"]), "args": tuple(str(a) for a in data["args"]), "kwargs": {},
            "name": str(data["name"]), "misfire_grace_time": data["misfire_grace_time"],
            "coalesce": bool(data["coalesce"]), "max_instances": int(data["max_instances"]),
            "next_run_time": utc_timestamp_to_datetime(next_run) if next_run is not None else None,
        })
        job._scheduler = self._scheduler
        job._jobstore_alias = self._alias
        return job

    def _jobs(self, where: str, params: tuple) -> list[Job]:
        with self._db() as db:
            rows = db.execute(f"SELECT id, entry, next_run_time FROM {self.table} {where} ORDER BY next_run_time",
                              params).fetchall()
        jobs, broken = [], []
        for job_id, entry, next_run in rows:
            try:
                jobs.append(self._reconstitute(job_id, entry, next_run))
            except Exception:
                self._logger.exception("cannot restore scheduled job %r; removing it", job_id)
                broken.append(job_id)
        for job_id in broken:
            self.remove_job(job_id)
        return jobs


# Scheduler entries name a job; `_fire` (the only callable an entry can have) finds the live
# RetrainScheduler for that name here.
_ACTIVE: dict[str, RetrainScheduler] = {}


def _fire(job_name: str) -> None:
    sched = _ACTIVE.get(job_name)
    if sched is not None:
        sched.fire()


class SubprocessRunner:
    """Runs `marft-lg retrain --job PATH` as a child process; `terminate()` forwards SIGTERM to it."""

    def __init__(self, job_path: str | Path, *, grace_s: float = 300.0):
        self.job_path = str(job_path)
        self.grace_s = grace_s
        self._child: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self.returncodes: list[int] = []

    def __call__(self) -> int:
        with self._lock:
            self._child = subprocess.Popen([sys.executable, "-m", "marft_lg.cli", "retrain", "--job", self.job_path])
        child = self._child
        rc = child.wait()
        with self._lock:
            self._child = None
        self.returncodes.append(rc)
        return rc

    def terminate(self) -> None:
        with self._lock:
            child = self._child
        if child is None:
            return
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(self.grace_s)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


class RetrainScheduler:
    """One job's cron schedule on APScheduler's BackgroundScheduler with a `SQLiteJobStore`.

    `runner` does one run (default: a `SubprocessRunner` for `job_path`); at most one runs at a time.
    """

    def __init__(self, job: RetrainJob, *, job_path: str | Path | None = None,
                 runner: Callable[[], Any] | None = None, log: Callable[[str], None] = print):
        if runner is None and job_path is None:
            raise ValueError("RetrainScheduler needs job_path (for the default subprocess runner) or a runner")
        self.job = job
        self.runner = runner or SubprocessRunner(job_path)
        self.log = log
        self.trigger = cron_trigger(job.schedule, job.timezone)
        refuse_legacy_table(job.store_path)
        self.scheduler = BackgroundScheduler(
            jobstores={"default": SQLiteJobStore(job.store_path)},
            job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": job.misfire_grace_s},
            timezone=job.timezone,
        )
        self._stopping = threading.Event()
        self.fired = 0

    def start(self) -> None:
        """Start in the background; keeps a persisted entry (and its due time) when the schedule is unchanged."""
        if _ACTIVE.get(self.job.name) not in (None, self):
            raise RuntimeError(f"a scheduler for job {self.job.name!r} is already running in this process")
        _ACTIVE[self.job.name] = self
        self.scheduler.start(paused=True)
        existing = self.scheduler.get_job(self.job.name)
        if existing is None or str(existing.trigger) != str(self.trigger):
            self.scheduler.add_job("marft_lg.jobs.scheduler:_fire", trigger=self.trigger, args=[self.job.name],
                                   id=self.job.name, name=f"retrain {self.job.name}", replace_existing=True)
        self.scheduler.resume()
        self.log(f"scheduled retrain job {self.job.name!r} ({self.job.schedule} {self.job.timezone}); "
                 f"next run {self.next_run_time()}")

    def next_run_time(self) -> datetime | None:
        entry = self.scheduler.get_job(self.job.name)
        return None if entry is None else entry.next_run_time

    def fire(self) -> None:
        if self._stopping.is_set():
            return
        self.fired += 1
        self.log(f"retrain job {self.job.name!r}: starting run")
        try:
            outcome = self.runner()
        except Exception as exc:  # a failed run must not stop the schedule
            self.log(f"retrain job {self.job.name!r}: run raised {type(exc).__name__}: {exc}")
            return
        self.log(f"retrain job {self.job.name!r}: run finished ({outcome}); next run {self.next_run_time()}")

    def wakeup(self) -> None:
        """Re-check due runs now (after a clock change)."""
        self.scheduler.wakeup()

    def stop(self) -> None:
        """No new runs; ask a running one to stop (SIGTERM) and wait for it; then shut down."""
        self._stopping.set()
        if self.scheduler.running:
            self.scheduler.pause()
        terminate = getattr(self.runner, "terminate", None)
        if callable(terminate):
            terminate()
        if self.scheduler.running:
            self.scheduler.shutdown(wait=True)
        if _ACTIVE.get(self.job.name) is self:
            del _ACTIVE[self.job.name]

    def serve_forever(self) -> None:
        """Start, block until SIGTERM or SIGINT, then `stop()` gracefully."""
        done = threading.Event()
        previous = {sig: signal.signal(sig, lambda *_: done.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            self.start()
            while not done.wait(1.0):
                pass
            self.log("stopping: no new runs; waiting for a running one to finish")
            self.stop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
