"""`marft-lg retrain`, `marft-lg jobs list/show` in-process: exit codes and what they print."""

from __future__ import annotations

import json
import os

from jobs_fakes import append_episodes, make_job
from typer.testing import CliRunner

from marft_lg.cli import app
from marft_lg.jobs.config import RetrainJob
from marft_lg.jobs.lock import RunLock

runner = CliRunner()


def test_retrain_then_list_and_show(tmp_path):
    path = make_job(tmp_path / "job", settle_s=0)
    append_episodes(tmp_path / "job" / "traces" / "spans.jsonl", ["2026-01-01T00:00:00+00:00"] * 3, "a")
    first = runner.invoke(app, ["retrain", "--job", str(path)])
    assert first.exit_code == 0, first.output
    assert "promoted:" in first.output
    second = runner.invoke(app, ["retrain", "--job", str(path)])
    assert second.exit_code == 0 and "skipped: 0 new episode(s)" in second.output

    listed = runner.invoke(app, ["jobs", "list", "--job", str(path), "--json"])
    assert listed.exit_code == 0, listed.output
    runs = [json.loads(line) for line in listed.output.splitlines()]
    assert [r["status"] for r in runs] == ["skipped", "promoted"]
    table = runner.invoke(app, ["jobs", "list", "--job", str(path)])
    assert "promoted" in table.output and "watermark:" in table.output

    shown = runner.invoke(app, ["jobs", "show", runs[1]["run_id"], "--job", str(path)])
    assert shown.exit_code == 0
    record = json.loads(shown.output)
    assert record["candidate"] == {"planner": "v2", "solver": "v2"} and record["n_episodes"] == 3
    missing = runner.invoke(app, ["jobs", "show", "nope", "--job", str(path)])
    assert missing.exit_code == 2 and "jobs list" in missing.output


def test_retrain_exit_codes_for_bad_job_and_held_lock(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("min_episodes: 3\n")
    out = runner.invoke(app, ["retrain", "--job", str(bad)])
    assert out.exit_code == 2 and "bad.yaml:1: min_episodes: unknown job key" in out.output

    path = make_job(tmp_path / "job")
    with RunLock(RetrainJob.from_yaml(path).lock_path, run_id="other"):
        held = runner.invoke(app, ["retrain", "--job", str(path)])
    assert held.exit_code == 3
    assert f"pid {os.getpid()}" in held.output and "holds the lock" in held.output


def test_failed_run_exits_1_and_jobs_list_needs_a_store(tmp_path):
    path = make_job(tmp_path / "job", settle_s=0)
    append_episodes(tmp_path / "job" / "traces" / "spans.jsonl", ["2026-01-01T00:00:00+00:00"] * 3, "a")
    (tmp_path / "job" / "control.json").write_text(json.dumps({"fail_in": "compare"}))
    out = runner.invoke(app, ["retrain", "--job", str(path)])
    assert out.exit_code == 1 and "failed: RuntimeError: injected failure in compare" in out.output
    assert runner.invoke(app, ["jobs", "list"]).exit_code == 2
    assert runner.invoke(app, ["jobs", "list", "--store", str(tmp_path / "none.sqlite")]).exit_code == 2
