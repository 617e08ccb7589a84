"""RetrainScheduler: cron parsing, fires on a controllable clock, persisted entries catch up after downtime."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta

import apscheduler.executors.base
import apscheduler.schedulers.base
import pytest
from apscheduler.events import EVENT_JOB_ERROR, EVENT_JOB_EXECUTED
from jobs_fakes import FakeStages, append_episodes, make_job

from marft_lg.jobs import store as st
from marft_lg.jobs.config import RetrainJob
from marft_lg.jobs.pipeline import run_once
from marft_lg.jobs.scheduler import RetrainScheduler, cron_trigger
from marft_lg.jobs.store import JobStore


class Clock:
    """The time APScheduler sees (it reads `datetime.now` in these two modules)."""

    def __init__(self, start: datetime):
        self.t = start
        clock = self

        class FakeDatetime(datetime):
            @classmethod
            def now(cls, tz=None):
                return clock.t.astimezone(tz) if tz else clock.t.replace(tzinfo=None)

        self.datetime = FakeDatetime

    def set(self, t: datetime) -> None:
        self.t = t


@pytest.fixture()
def clock(monkeypatch):
    c = Clock(datetime(2026, 3, 1, 0, 0, tzinfo=UTC))
    monkeypatch.setattr(apscheduler.schedulers.base, "datetime", c.datetime)
    monkeypatch.setattr(apscheduler.executors.base, "datetime", c.datetime)
    return c


class Runner:
    """Runs the real pipeline in-process with fake stages at the scheduler's clock time."""

    def __init__(self, job, clock):
        self.job, self.clock = job, clock
        self.results = []
        self.done = threading.Semaphore(0)

    def __call__(self):
        result = run_once(self.job, stages=FakeStages(self.job), now=self.clock.t, log=lambda m: None)
        self.results.append(result)
        return result.status

    def wait(self, n_more: int = 1, timeout: float = 10.0) -> bool:
        return all(self.done.acquire(timeout=timeout) for _ in range(n_more))


@pytest.fixture()
def job(tmp_path):
    path = make_job(tmp_path / "job", schedule="0 2 * * *", misfire_grace_s=3600)
    append_episodes(tmp_path / "job" / "traces" / "spans.jsonl",
                    [f"2026-02-28T{h:02d}:00:00+00:00" for h in (1, 2, 3)], "a")
    return RetrainJob.from_yaml(path)


@pytest.fixture()
def schedulers():
    made: list[RetrainScheduler] = []
    yield made
    for s in made:
        s.stop()


def start(job, clock, schedulers):
    runner = Runner(job, clock)
    sched = RetrainScheduler(job, runner=runner, log=lambda m: None)
    # a run counts as done once APScheduler has closed its instance (max_instances 1): a clock moved on before that
    # would find the next fire time's instance still "running" and skip it
    sched.scheduler.add_listener(lambda event: runner.done.release(), EVENT_JOB_EXECUTED | EVENT_JOB_ERROR)
    schedulers.append(sched)
    sched.start()
    return sched, runner


def test_cron_expressions():
    t = cron_trigger("30 2 * * 1-5", "UTC")
    sat = datetime(2026, 2, 28, 12, 0, tzinfo=UTC)  # a Saturday
    assert t.get_next_fire_time(None, sat) == datetime(2026, 3, 2, 2, 30, tzinfo=UTC)
    sun = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
    assert cron_trigger("0 2 * * 0", "UTC").get_next_fire_time(None, sat) == datetime(2026, 3, 1, 2, 0, tzinfo=UTC)
    assert cron_trigger("0 2 * * 7", "UTC").get_next_fire_time(None, sat) == datetime(2026, 3, 1, 2, 0, tzinfo=UTC)
    assert cron_trigger("0 2 * * 5-7", "UTC").get_next_fire_time(None, sun) == datetime(2026, 3, 6, 2, 0, tzinfo=UTC)
    assert cron_trigger("0 2 * * */2", "UTC").get_next_fire_time(None, sun) == datetime(2026, 3, 3, 2, 0, tzinfo=UTC)
    assert cron_trigger("0 2 * * sat", "UTC").get_next_fire_time(None, sun) == datetime(2026, 3, 7, 2, 0, tzinfo=UTC)
    six = cron_trigger("*/10 * * * * *", "UTC")
    assert six.get_next_fire_time(None, sat + timedelta(seconds=1)) == sat + timedelta(seconds=10)
    with pytest.raises(ValueError, match="has 3 fields"):
        cron_trigger("* * *")
    with pytest.raises(ValueError, match="invalid cron expression"):
        cron_trigger("99 * * * *")


def test_fires_when_the_clock_reaches_the_schedule(job, clock, schedulers):
    sched, runner = start(job, clock, schedulers)
    assert sched.next_run_time() == datetime(2026, 3, 1, 2, 0, tzinfo=UTC)
    clock.set(datetime(2026, 3, 1, 1, 59, tzinfo=UTC))
    sched.wakeup()
    assert not runner.wait(timeout=0.5)
    clock.set(datetime(2026, 3, 1, 2, 0, 5, tzinfo=UTC))
    sched.wakeup()
    assert runner.wait()
    assert [r.status for r in runner.results] == [st.PROMOTED]
    assert sched.next_run_time() == datetime(2026, 3, 2, 2, 0, tzinfo=UTC)
    clock.set(datetime(2026, 3, 2, 2, 0, 1, tzinfo=UTC))
    sched.wakeup()
    assert runner.wait()
    assert runner.results[-1].status == st.SKIPPED  # nothing new since the first run: idempotent


def test_a_run_missed_while_down_is_caught_up_once(job, clock, schedulers):
    sched, runner = start(job, clock, schedulers)
    sched.stop()
    clock.set(datetime(2026, 3, 3, 2, 10, tzinfo=UTC))  # missed 03-01, 03-02 and 03-03 02:00
    sched2, runner2 = start(job, clock, schedulers)
    assert runner2.wait()
    assert not runner2.wait(timeout=0.5)
    assert len(runner2.results) == 1 and runner.results == []
    assert sched2.next_run_time() == datetime(2026, 3, 4, 2, 0, tzinfo=UTC)
    assert len(JobStore(job.store_path).runs()) == 1


def test_a_run_missed_beyond_the_grace_time_is_dropped(job, clock, schedulers):
    sched, _ = start(job, clock, schedulers)
    sched.stop()
    clock.set(datetime(2026, 3, 1, 4, 0, tzinfo=UTC))  # 2 h late, grace is 1 h
    sched2, runner2 = start(job, clock, schedulers)
    assert not runner2.wait(timeout=0.5)
    assert sched2.next_run_time() == datetime(2026, 3, 2, 2, 0, tzinfo=UTC)


def test_a_changed_schedule_replaces_the_persisted_entry(job, clock, schedulers):
    sched, _ = start(job, clock, schedulers)
    sched.stop()
    job.schedule = "0 5 * * *"
    clock.set(datetime(2026, 3, 1, 3, 0, tzinfo=UTC))
    sched2, runner2 = start(job, clock, schedulers)
    assert not runner2.wait(timeout=0.5)
    assert sched2.next_run_time() == datetime(2026, 3, 1, 5, 0, tzinfo=UTC)


def test_short_real_time_schedule_runs_repeatedly_one_at_a_time(tmp_path, schedulers):
    job = RetrainJob.from_yaml(make_job(tmp_path / "job", schedule="* * * * * *"))
    active, overlaps, count = [0], [0], [0]
    lock = threading.Lock()

    def runner():
        with lock:
            active[0] += 1
            overlaps[0] = max(overlaps[0], active[0])
        time.sleep(1.5)  # longer than the 1 s period: the next fire must not overlap
        with lock:
            active[0] -= 1
            count[0] += 1

    sched = RetrainScheduler(job, runner=runner, log=lambda m: None)
    schedulers.append(sched)
    sched.start()
    deadline = time.time() + 20
    while count[0] < 2 and time.time() < deadline:
        time.sleep(0.1)
    assert count[0] >= 2 and overlaps[0] == 1
