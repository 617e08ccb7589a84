"""JobStore: run lifecycle, atomic finish + watermark, crash marking."""

from __future__ import annotations

import sqlite3

import pytest

from marft_lg.jobs import store as st
from marft_lg.jobs.store import JobStore


def test_run_lifecycle_and_json_fields_round_trip(tmp_path):
    db = JobStore(tmp_path / "jobs.sqlite")
    db.start_run("r1", "nightly", pid=1, hostname="h", run_dir="/x")
    db.update_run("r1", baseline={"planner": "v1"}, n_episodes=7)
    rec = db.finish_run("r1", st.PROMOTED, advance_watermark_to="2026-03-01T00:00:00+00:00",
                        message="ok", metrics={"delta": 0.5}, candidate={"planner": "v2"})
    assert rec.status == st.PROMOTED and rec.ended_at and rec.message == "ok"
    assert rec.baseline == {"planner": "v1"} and rec.candidate == {"planner": "v2"} and rec.metrics == {"delta": 0.5}
    assert rec.n_episodes == 7
    assert db.watermark("nightly") == "2026-03-01T00:00:00+00:00"
    assert db.watermark("other") is None
    assert JobStore(tmp_path / "jobs.sqlite").get("r1") == rec  # persisted


def test_finish_without_advance_keeps_watermark(tmp_path):
    db = JobStore(tmp_path / "jobs.sqlite")
    db.start_run("r1", "nightly", pid=1, hostname="h")
    db.finish_run("r1", st.PROMOTED, advance_watermark_to="2026-03-01T00:00:00+00:00")
    db.start_run("r2", "nightly", pid=1, hostname="h")
    db.finish_run("r2", st.SKIPPED, message="too few")
    assert db.watermark("nightly") == "2026-03-01T00:00:00+00:00"
    assert [r.run_id for r in db.runs(job="nightly")] == ["r2", "r1"]


def test_failed_watermark_write_rolls_back_the_success_record(tmp_path):
    db = JobStore(tmp_path / "jobs.sqlite")
    db.start_run("r1", "nightly", pid=1, hostname="h")
    with sqlite3.connect(tmp_path / "jobs.sqlite") as con:
        con.execute("CREATE TRIGGER boom BEFORE INSERT ON watermarks BEGIN SELECT RAISE(ABORT, 'disk full'); END")
    with pytest.raises(sqlite3.DatabaseError, match="disk full"):
        db.finish_run("r1", st.PROMOTED, advance_watermark_to="2026-03-01T00:00:00+00:00")
    assert db.get("r1").status == st.RUNNING
    assert db.watermark("nightly") is None


def test_mark_crashed_only_touches_running_runs_of_that_job(tmp_path):
    db = JobStore(tmp_path / "jobs.sqlite")
    for rid, job in (("a", "nightly"), ("b", "nightly"), ("c", "weekly")):
        db.start_run(rid, job, pid=42, hostname="h")
    db.finish_run("b", st.PROMOTED)
    crashed = db.mark_crashed("nightly", "stopped")
    assert [r.run_id for r in crashed] == ["a"] and "pid 42" in crashed[0].message
    assert db.get("b").status == st.PROMOTED and db.get("c").status == st.RUNNING


def test_bad_input_is_refused(tmp_path):
    db = JobStore(tmp_path / "jobs.sqlite")
    db.start_run("r1", "nightly", pid=1, hostname="h")
    with pytest.raises(ValueError, match="unknown run status"):
        db.update_run("r1", status="great")
    with pytest.raises(ValueError, match="unknown run fields"):
        db.update_run("r1", colour="red")
    with pytest.raises(KeyError, match="jobs list"):
        db.get("nope")
    with pytest.raises(ValueError, match="final status"):
        db.finish_run("r1", st.RUNNING)
