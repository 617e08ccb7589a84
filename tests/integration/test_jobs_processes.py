"""Real `marft-lg retrain` / `marft-lg schedule` processes: SIGKILL mid-training, a concurrent second run,
SIGTERM. The stages are the test fakes (real registry, real files); no model is loaded."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "jobs"))

from jobs_fakes import ROLES, adapter_value, append_episodes, child_env, make_job, set_control  # noqa: E402

from marft_lg.jobs import store as st  # noqa: E402
from marft_lg.jobs.config import RetrainJob  # noqa: E402
from marft_lg.jobs.store import JobStore  # noqa: E402
from marft_lg.serving.registry.store import AdapterRegistry  # noqa: E402


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "marft_lg.cli", *args]


def wait_for(predicate, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture()
def job_setup(tmp_path):
    root = tmp_path / "job"
    path = make_job(root)
    append_episodes(root / "traces" / "spans.jsonl",
                    ["2026-01-01T01:00:00+00:00", "2026-01-01T02:00:00+00:00", "2026-01-01T03:00:00+00:00"], "a")
    return path, root, RetrainJob.from_yaml(path)


def training_started(job: RetrainJob) -> bool:
    return any(Path(job.output_dir).glob("*/training_started"))


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_sigkill_during_training_then_a_clean_next_run(job_setup):
    path, root, job = job_setup
    set_control(root, train_sleep=120)
    proc = subprocess.Popen(cli("retrain", "--job", str(path)), env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: training_started(job) and "v2" in AdapterRegistry(job.registry).versions("planner"),
                 what="the child to be mid-training")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        kill(proc)
    assert proc.returncode == -signal.SIGKILL
    reg = AdapterRegistry(job.registry)
    assert reg.alias("live") == {r: "v1" for r in ROLES}  # a half-trained candidate exists but is not live
    assert reg.versions("planner") == ["v1", "v2"]
    store = JobStore(job.store_path)
    [killed] = store.runs()
    assert killed.status == st.RUNNING and killed.pid == proc.pid
    assert store.watermark(job.name) is None
    assert json.loads(job.lock_path.read_text())["pid"] == proc.pid  # the stale lock is left behind

    set_control(root)
    done = subprocess.run(cli("retrain", "--job", str(path)), env=child_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "stale lock" in done.stderr and f"pid {proc.pid}" in done.stderr
    assert done.stdout.startswith("promoted:")
    assert store.get(killed.run_id).status == st.CRASHED
    newest = store.runs()[0]
    assert newest.status == st.PROMOTED and newest.n_episodes == 3
    assert newest.candidate == {"planner": "v3", "solver": "v2"} == reg.alias("live")
    assert adapter_value(reg, "planner", "live") == 2.0  # trained from live v1, not from the orphan v2
    assert store.watermark(job.name) is not None and not job.lock_path.exists()

    again = subprocess.run(cli("retrain", "--job", str(path)), env=child_env(), capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 0 and again.stdout.startswith("skipped:")
    assert reg.alias("live") == {"planner": "v3", "solver": "v2"}


def test_second_concurrent_run_names_the_holder_and_sigterm_interrupts_cleanly(job_setup):
    path, root, job = job_setup
    set_control(root, train_sleep=120)
    first = subprocess.Popen(cli("retrain", "--job", str(path)), env=child_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: training_started(job), what="the first run to be training")
        second = subprocess.run(cli("retrain", "--job", str(path)), env=child_env(), capture_output=True,
                                text=True, timeout=120)
        assert second.returncode == 3
        assert f"pid {first.pid}" in second.stderr and "holds the lock" in second.stderr
        first.send_signal(signal.SIGTERM)
        out, err = first.communicate(timeout=60)
    finally:
        kill(first)
    assert first.returncode == 1 and out.startswith("interrupted:"), out + err
    [run] = JobStore(job.store_path).runs()
    assert run.status == st.INTERRUPTED
    assert AdapterRegistry(job.registry).alias("live") == {r: "v1" for r in ROLES}
    assert not job.lock_path.exists()


def test_schedule_runs_on_time_and_stops_gracefully_on_sigterm(tmp_path):
    root = tmp_path / "job"
    path = make_job(root, schedule="*/2 * * * * *", settle_s=0)
    job = RetrainJob.from_yaml(path)
    append_episodes(root / "traces" / "spans.jsonl", ["2026-01-01T01:00:00+00:00"] * 3, "a")
    proc = subprocess.Popen(cli("schedule", "--job", str(path)), env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: job.store_path.exists() and any(
            r.status != st.RUNNING for r in JobStore(job.store_path).runs()), timeout=90, what="a scheduled run")
        set_control(root, train_sleep=120)
        append_episodes(root / "traces" / "spans.jsonl", [datetime.now(UTC).isoformat()] * 3, "b")
        wait_for(lambda: len(list(Path(job.output_dir).glob("*/training_started"))) >= 2, timeout=90,
                 what="a second scheduled run to be training")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        kill(proc)
    assert proc.returncode == 0, err
    statuses = [r.status for r in JobStore(job.store_path).runs()]
    assert statuses[-1] == st.PROMOTED and statuses[0] == st.INTERRUPTED, statuses
    assert "stopping" in err and not job.lock_path.exists()


def test_sigkill_between_promotion_and_record_is_completed_not_redone(job_setup):
    path, root, job = job_setup
    set_control(root, kill_after_promote=True)
    killed = subprocess.run(cli("retrain", "--job", str(path)), env=child_env(), capture_output=True, text=True,
                            timeout=120)
    assert killed.returncode == -signal.SIGKILL
    store = JobStore(job.store_path)
    [dead] = store.runs()
    assert dead.status == st.RUNNING and AdapterRegistry(job.registry).alias("live") == dead.candidate
    assert store.watermark(job.name) is None

    set_control(root)
    nxt = subprocess.run(cli("retrain", "--job", str(path)), env=child_env(), capture_output=True, text=True,
                         timeout=120)
    assert nxt.returncode == 0, nxt.stdout + nxt.stderr
    assert "then stopped before recording it" in nxt.stderr
    assert nxt.stdout.startswith("skipped: 0 new episode(s)")  # the promoted window is not trained again
    finished = store.get(dead.run_id)
    assert finished.status == st.PROMOTED and finished.live_after == dead.candidate
    assert store.watermark(job.name) == dead.window_end
