"""RunLock: single holder, holder named in the refusal, stale detection by pid, start time and heartbeat."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import psutil
import pytest

from marft_lg.jobs.lock import LockHeld, RunLock


def write_lock(path, **fields):
    data = {"pid": os.getpid(), "hostname": socket.gethostname(),
            "process_start": psutil.Process().create_time(), "acquired_at": "2026-03-01T00:00:00+00:00",
            "run_id": "other-run", "token": "someone-else", **fields}
    path.write_text(json.dumps(data))


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_second_acquire_is_refused_naming_the_holder(tmp_path):
    first = RunLock(tmp_path / "job.lock", run_id="run-1")
    first.acquire()
    try:
        with pytest.raises(LockHeld) as info:
            RunLock(tmp_path / "job.lock", run_id="run-2").acquire()
        msg = str(info.value)
        assert f"pid {os.getpid()}" in msg and socket.gethostname() in msg and "run-1" in msg
        assert info.value.holder.run_id == "run-1"
    finally:
        first.release()
    assert not (tmp_path / "job.lock").exists()
    with RunLock(tmp_path / "job.lock", run_id="run-3") as again:
        assert again.read().run_id == "run-3"


def test_dead_pid_on_this_host_is_stale(tmp_path):
    write_lock(tmp_path / "job.lock", pid=dead_pid())
    lock = RunLock(tmp_path / "job.lock", run_id="mine")
    lock.acquire()
    assert lock.broken is not None and lock.broken.run_id == "other-run"
    assert lock.read().run_id == "mine"
    lock.release()


def test_reused_pid_is_told_apart_by_process_start_time(tmp_path):
    write_lock(tmp_path / "job.lock", process_start=psutil.Process().create_time() - 3600)
    lock = RunLock(tmp_path / "job.lock")
    assert lock.is_stale(lock.read())
    write_lock(tmp_path / "job.lock")
    assert not lock.is_stale(lock.read())


def test_other_host_is_stale_only_after_its_heartbeat_stops(tmp_path):
    path = tmp_path / "job.lock"
    write_lock(path, hostname="pod-retrain-abc", pid=1)
    lock = RunLock(path, stale_after_s=60)
    with pytest.raises(LockHeld, match="pod-retrain-abc"):
        lock.acquire()
    old = time.time() - 120
    os.utime(path, (old, old))
    lock.acquire()
    assert lock.broken.hostname == "pod-retrain-abc"
    lock.release()


def test_heartbeat_keeps_the_lock_fresh(tmp_path):
    lock = RunLock(tmp_path / "job.lock", heartbeat_s=0.05)
    lock.acquire()
    try:
        old = time.time() - 1000
        os.utime(lock.path, (old, old))
        deadline = time.time() + 5
        while lock.path.stat().st_mtime < time.time() - 100 and time.time() < deadline:
            time.sleep(0.05)
        assert lock.path.stat().st_mtime > time.time() - 100
    finally:
        lock.release()


def test_release_never_removes_someone_elses_lock(tmp_path):
    lock = RunLock(tmp_path / "job.lock")
    lock.acquire()
    write_lock(lock.path, token="taken-over")
    lock.release()
    assert json.loads(lock.path.read_text())["token"] == "taken-over"


def test_garbage_lock_file_is_reported_not_overwritten(tmp_path):
    (tmp_path / "job.lock").write_text("not json")
    with pytest.raises(ValueError, match="not a marft-lg lock"):
        RunLock(tmp_path / "job.lock").acquire()
    assert (tmp_path / "job.lock").read_text() == "not json"
