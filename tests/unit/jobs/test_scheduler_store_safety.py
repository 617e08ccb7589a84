"""The scheduler's SQLite entries are plain JSON: an old pickled table is refused unread, a new entry survives restarts."""

from __future__ import annotations

import json
import pickle
import sqlite3

from jobs_fakes import make_job
from typer.testing import CliRunner

from marft_lg.cli import app
from marft_lg.jobs.config import RetrainJob
from marft_lg.jobs.scheduler import RetrainScheduler


class Payload:
    """Unpickling this writes a marker file: the planted code a pickled row could run."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def _plant_old_table(db_path, marker) -> None:
    db_path.parent.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(db_path) as db:
        db.execute("CREATE TABLE apscheduler_jobs (id TEXT PRIMARY KEY, next_run_time REAL, job_state BLOB NOT NULL)")
        db.execute("INSERT INTO apscheduler_jobs VALUES (?,?,?)",
                   ("nightly", 0.0, pickle.dumps(Payload(str(marker)))))


def test_schedule_refuses_an_old_pickled_table_without_unpickling(tmp_path, monkeypatch):
    path = make_job(tmp_path / "job")
    job = RetrainJob.from_yaml(path)
    marker = tmp_path / "payload-ran"
    _plant_old_table(job.store_path, marker)

    def start_then_stop(self):  # bounded: never waits for a signal
        self.start()
        self.stop()

    monkeypatch.setattr(RetrainScheduler, "serve_forever", start_then_stop)
    result = CliRunner().invoke(app, ["schedule", "--job", str(path)])
    text = result.output + (result.stderr if result.stderr_bytes is not None else "")
    assert not marker.exists()
    assert result.exit_code == 2, text
    assert "scheduler table from an older marft_lg" in text and "never read" in text
    assert "marft-lg schedule" in text and "DROP TABLE apscheduler_jobs" in text


def test_the_plain_entry_round_trips_its_next_run_time(tmp_path):
    job = RetrainJob.from_yaml(make_job(tmp_path / "job", schedule="15 3 * * 1-5", timezone="Europe/Paris"))
    first = RetrainScheduler(job, runner=lambda: None, log=lambda m: None)
    first.start()
    due = first.next_run_time()
    first.stop()
    with sqlite3.connect(job.store_path) as db:
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        (entry,) = db.execute("SELECT entry FROM scheduler_entries").fetchone()
    assert "apscheduler_jobs" not in tables
    data = json.loads(entry)
    assert data["args"] == ["nightly"] and data["trigger"]["timezone"] == "Europe/Paris"
    assert "func" not in data  # the callable is never read from the file

    second = RetrainScheduler(job, runner=lambda: None, log=lambda m: None)
    second.start()
    try:
        entry_job = second.scheduler.get_job(job.name)
        assert second.next_run_time() == due and due is not None
        assert str(entry_job.trigger) == str(second.trigger)
        assert entry_job.func.__name__ == "_fire"
    finally:
        second.stop()
