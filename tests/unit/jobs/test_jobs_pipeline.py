"""run_once: watermark windows across runs, idempotence, skips, gate rejection, failures, crash recovery."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pandas as pd
import pytest
from jobs_fakes import ROLES, FakeStages, adapter_value, append_episodes, make_job, set_control

from marft_lg.jobs import store as st
from marft_lg.jobs.config import RetrainJob
from marft_lg.jobs.lock import LockHeld, RunLock
from marft_lg.jobs.pipeline import run_once
from marft_lg.jobs.store import JobStore
from marft_lg.serving.registry.store import AdapterRegistry

T0 = datetime(2026, 3, 1, 2, 0, tzinfo=UTC)


def iso(dt: datetime) -> str:
    return dt.isoformat()


@pytest.fixture()
def env(tmp_path):
    path = make_job(tmp_path / "job")
    job = RetrainJob.from_yaml(path)
    return job, tmp_path / "job"


def run(job, now, **kw):
    stages = FakeStages(job)
    result = run_once(job, stages=stages, now=now, log=lambda m: None, **kw)
    return result, stages


def live(job):
    return AdapterRegistry(job.registry).alias("live")


def test_first_run_trains_promotes_records_and_advances_watermark(env):
    job, root = env
    ids = append_episodes(root / "traces" / "spans.jsonl", [iso(T0 - timedelta(hours=h)) for h in (5, 4, 3, 2)], "a")
    result, stages = run(job, T0)
    assert result.status == st.PROMOTED, result.message
    assert stages.calls == ["mine", "train", "compare", "promote"]
    rec = result.record
    assert rec.n_episodes == 4 and rec.baseline == {r: "v1" for r in ROLES}
    assert rec.candidate == {r: "v2" for r in ROLES} == rec.live_after == live(job)
    assert rec.metrics["reward_delta"] == 0.1 and rec.metrics["gate_passed"] is True
    assert rec.report_path and os.path.exists(rec.report_path)
    store = JobStore(job.store_path)
    assert pd.Timestamp(store.watermark(job.name)) == pd.Timestamp(T0 - timedelta(seconds=job.settle_s))
    saved = pd.read_parquet(f"{rec.run_dir}/dataset/episodes.parquet")
    assert sorted(saved["episode_id"]) == sorted(ids)
    assert not job.lock_path.exists()


def test_rerunning_a_finished_window_does_nothing(env):
    job, root = env
    append_episodes(root / "traces" / "spans.jsonl", [iso(T0 - timedelta(hours=h)) for h in (3, 2, 1)], "a")
    # ends just before the first window's end: the next run must not train on it again
    append_episodes(root / "traces" / "spans.jsonl", [iso(T0 - timedelta(seconds=120))], "edge")
    first, _ = run(job, T0)
    assert first.status == st.PROMOTED and first.record.n_episodes == 4
    mark = JobStore(job.store_path).watermark(job.name)
    second, stages = run(job, T0 + timedelta(hours=1))
    assert second.status == st.SKIPPED and "0 new episode(s)" in second.message
    assert stages.calls == ["mine"]
    assert live(job) == {r: "v2" for r in ROLES}
    assert JobStore(job.store_path).watermark(job.name) == mark
    # the same clock again: the window is empty, nothing is even mined
    third, stages = run(job, T0)
    assert third.status == st.SKIPPED and stages.calls == []


def test_only_new_episodes_are_mined_and_too_few_accumulate(env):
    job, root = env
    traces = root / "traces" / "spans.jsonl"
    append_episodes(traces, [iso(T0 - timedelta(hours=h)) for h in (3, 2, 1)], "old")
    run(job, T0)
    t1 = T0 + timedelta(days=1)
    append_episodes(traces, [iso(t1 - timedelta(hours=5)), iso(t1 - timedelta(hours=4))], "b")
    skipped, stages = run(job, t1)
    assert skipped.status == st.SKIPPED and "2 new episode(s)" in skipped.message and "min_new_episodes=3" in skipped.message
    assert stages.calls == ["mine"]
    # episodes ending inside the settle period belong to the next window
    new = append_episodes(traces, [iso(t1 - timedelta(hours=1)), iso(t1 + timedelta(hours=1))], "c")
    late = append_episodes(traces, [iso(t1 + timedelta(hours=2) - timedelta(seconds=10))], "late")
    t2 = t1 + timedelta(hours=2)
    result, stages = run(job, t2)
    assert result.status == st.PROMOTED and result.record.n_episodes == 4
    trained = json.loads(Path(result.record.run_dir, "training_started").read_text())
    assert trained == sorted(["b-0", "b-1", *new])
    assert late[0] not in trained
    since = Path(result.record.run_dir, "mined_since.txt").read_text()
    assert pd.Timestamp(since) == pd.Timestamp(T0 - timedelta(seconds=job.settle_s))  # the watermark
    # the late episode is picked up by the next run
    append_episodes(traces, [iso(t2 + timedelta(minutes=m)) for m in (1, 2)], "d")
    nxt, _ = run(job, t2 + timedelta(hours=1))
    assert nxt.record.n_episodes == 3
    assert late[0] in json.loads(Path(nxt.record.run_dir, "training_started").read_text())


def test_gate_rejection_leaves_live_untouched_and_is_recorded(env):
    job, root = env
    append_episodes(root / "traces" / "spans.jsonl", [iso(T0 - timedelta(hours=h)) for h in (3, 2, 1)], "a")
    set_control(root, gate_pass=False)
    before = AdapterRegistry(job.registry).aliases()
    result, stages = run(job, T0)
    assert result.status == st.REJECTED and result.ok
    assert "promote" not in stages.calls
    reg = AdapterRegistry(job.registry)
    assert reg.aliases() == before
    assert all(adapter_value(reg, r, "live") == 1.0 for r in ROLES)
    rec = JobStore(job.store_path).get(result.record.run_id)
    assert rec.status == st.REJECTED and rec.candidate == {r: "v2" for r in ROLES}
    assert rec.live_after == {r: "v1" for r in ROLES}
    assert rec.metrics["gate_passed"] is False and "CI includes 0" in rec.message
    assert JobStore(job.store_path).watermark(job.name) is not None  # advance_on_reject defaults to True


def test_rejection_keeps_window_when_advance_on_reject_is_off(env):
    job, root = env
    job.advance_on_reject = False
    append_episodes(root / "traces" / "spans.jsonl", [iso(T0 - timedelta(hours=h)) for h in (3, 2, 1)], "a")
    set_control(root, gate_pass=False)
    assert run(job, T0)[0].status == st.REJECTED
    assert JobStore(job.store_path).watermark(job.name) is None
    set_control(root, gate_pass=True)
    again, _ = run(job, T0 + timedelta(hours=1))
    assert again.status == st.PROMOTED and again.record.n_episodes == 3


@pytest.mark.parametrize("stage", ["mine", "train", "compare", "promote"])
def test_a_failing_stage_changes_nothing_and_releases_the_lock(env, stage):
    job, root = env
    append_episodes(root / "traces" / "spans.jsonl", [iso(T0 - timedelta(hours=h)) for h in (3, 2, 1)], "a")
    set_control(root, fail_in=stage)
    result, _ = run(job, T0)
    assert result.status == st.FAILED and not result.ok
    assert f"injected failure in {stage}" in result.message
    assert "injected failure" in Path(result.record.run_dir, "error.txt").read_text()
    assert live(job) == {r: "v1" for r in ROLES}
    assert JobStore(job.store_path).watermark(job.name) is None
    assert not job.lock_path.exists()
    set_control(root)
    assert run(job, T0 + timedelta(minutes=5))[0].status == st.PROMOTED


def test_live_changed_by_someone_else_during_the_run_is_not_overwritten(env):
    job, root = env
    append_episodes(root / "traces" / "spans.jsonl", [iso(T0 - timedelta(hours=h)) for h in (3, 2, 1)], "a")

    class Racing(FakeStages):
        def compare(self, ctx, baseline, candidate):
            out = super().compare(ctx, baseline, candidate)
            self.registry.promote({"planner": "v2"}, reason="manual promotion during the run")
            return out

    result = run_once(job, stages=Racing(job), now=T0, log=lambda m: None)
    assert result.status == st.REJECTED and "live changed during the run" in result.message
    assert live(job) == {"planner": "v2", "solver": "v1"}


def test_stale_lock_and_running_record_from_a_dead_run_are_detected(env):
    job, root = env
    append_episodes(root / "traces" / "spans.jsonl", [iso(T0 - timedelta(hours=h)) for h in (3, 2, 1)], "a")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock = RunLock(job.lock_path)
    lock.path.parent.mkdir(parents=True, exist_ok=True)
    lock.path.write_text(json.dumps({"pid": dead.pid, "hostname": socket.gethostname(), "process_start": 1.0,
                                     "acquired_at": "2026-03-01T01:00:00+00:00", "run_id": "nightly-old", "token": "t"}))
    store = JobStore(job.store_path)
    store.start_run("nightly-old", job.name, pid=dead.pid, hostname=socket.gethostname())
    logs = []
    result = run_once(job, stages=FakeStages(job), now=T0, log=logs.append)
    assert result.status == st.PROMOTED
    assert [r.run_id for r in result.crashed] == ["nightly-old"]
    assert store.get("nightly-old").status == st.CRASHED
    assert any("stale lock" in m and str(dead.pid) in m for m in logs)


def test_a_live_holder_blocks_a_second_run(env):
    job, root = env
    with RunLock(job.lock_path, run_id="nightly-first"), pytest.raises(LockHeld) as info:
        run(job, T0)
    assert f"pid {os.getpid()}" in str(info.value) and socket.gethostname() in str(info.value)
    assert "nightly-first" in str(info.value)
    assert JobStore(job.store_path).runs() == []


@pytest.mark.parametrize(("stage", "expected"), [("train", st.INTERRUPTED), ("promote", st.PROMOTED)])
def test_sigterm_interrupts_work_but_not_finishing(env, stage, expected):
    import signal

    job, root = env
    append_episodes(root / "traces" / "spans.jsonl", [iso(T0 - timedelta(hours=h)) for h in (3, 2, 1)], "a")

    class Terminated(FakeStages):
        def train(self, ctx, dataset, baseline):
            if stage == "train":
                os.kill(os.getpid(), signal.SIGTERM)
            return super().train(ctx, dataset, baseline)

        def promote(self, ctx, candidate, reason):
            if stage == "promote":
                os.kill(os.getpid(), signal.SIGTERM)
            return super().promote(ctx, candidate, reason)

    before = signal.getsignal(signal.SIGTERM)
    result = run_once(job, stages=Terminated(job), now=T0, log=lambda m: None, handle_sigterm=True)
    assert signal.getsignal(signal.SIGTERM) == before
    assert result.status == expected, result.message
    promoted = expected == st.PROMOTED
    assert live(job) == {r: ("v2" if promoted else "v1") for r in ROLES}
    assert (JobStore(job.store_path).watermark(job.name) is not None) == promoted
    assert not job.lock_path.exists()
