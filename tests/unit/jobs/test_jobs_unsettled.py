"""A retraining window never passes an episode still waiting for a server record (mined column `settled` False):
it ends just before it, so that episode and every later one go to the next run; one that waited past
`unsettled_wait_s` has lost its record and is trained on as it is."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from jobs_fakes import dataset_from

from marft_lg._config import ConfigError
from marft_lg.jobs.config import RetrainJob
from marft_lg.jobs.watermark import Window, hold_unsettled, select_window, window_for

NOW = datetime(2026, 3, 2, 2, 0, tzinfo=UTC)


def _mined(settled: dict[str, bool], ends: dict[str, timedelta]):
    ds = dataset_from([{"episode_id": e, "end_time": (NOW + d).isoformat()} for e, d in ends.items()])
    ds.episodes["settled"] = [settled[e] for e in ds.episodes["episode_id"]]
    return ds


def test_the_window_ends_before_the_first_unsettled_episode():
    window = window_for(None, NOW, settle_s=60)
    ends = {"a": -timedelta(minutes=5), "late_record": -timedelta(minutes=3), "b": -timedelta(minutes=2)}
    mined = _mined({"a": True, "late_record": False, "b": True}, ends)
    held = hold_unsettled(mined, window, wait_s=600)
    assert held.start is None and held.end < NOW - timedelta(minutes=3)
    assert select_window(mined, held).episode_ids == ["a"]
    nxt = Window(start=held.end, end=NOW + timedelta(hours=1))  # the next run starts at this run's watermark
    assert select_window(mined, nxt).episode_ids == ["late_record", "b"]


def test_an_episode_that_waited_past_the_limit_is_taken_as_it_is():
    window = window_for(None, NOW, settle_s=60)
    mined = _mined({"lost": False, "b": True}, {"lost": -timedelta(hours=2), "b": -timedelta(minutes=2)})
    assert hold_unsettled(mined, window, wait_s=600) == window
    settled_only = _mined({"a": True}, {"a": -timedelta(minutes=2)})
    assert hold_unsettled(settled_only, window, wait_s=600) == window


def test_job_settings_are_checked(tmp_path):
    base = {"name": "j", "model": "m", "agents": ["planner"], "traces": [str(tmp_path)]}
    job = RetrainJob(**base, server_records_only=True, unsettled_wait_s=30.0)
    assert job.server_records_only and job.unsettled_wait_s == 30.0
    with pytest.raises(ConfigError, match="unsettled_wait_s"):
        RetrainJob(**base, unsettled_wait_s=-1.0)
