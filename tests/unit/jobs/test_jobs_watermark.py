"""Windows are (watermark, now - settle] over episode end times."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from jobs_fakes import dataset_from

from marft_lg.jobs.watermark import format_time, parse_time, select_window, window_for

NOW = datetime(2026, 3, 2, 2, 0, tzinfo=UTC)


def test_window_bounds_are_exclusive_start_inclusive_end():
    w = window_for(format_time(NOW - timedelta(hours=1)), NOW, settle_s=60)
    rows = [{"episode_id": name, "end_time": (NOW + d).isoformat()} for name, d in (
        ("at_start", -timedelta(hours=1)), ("inside", -timedelta(minutes=30)),
        ("at_end", -timedelta(seconds=60)), ("settling", -timedelta(seconds=30)))]
    assert select_window(dataset_from(rows), w).episode_ids == ["inside", "at_end"]


def test_first_window_uses_initial_watermark_or_everything():
    assert window_for(None, NOW, settle_s=0).start is None
    w = window_for(None, NOW, settle_s=0, initial="2026-03-01T00:00:00")
    assert w.start == datetime(2026, 3, 1, tzinfo=UTC)


def test_empty_window_when_clock_is_behind_the_watermark():
    assert window_for(format_time(NOW), NOW, settle_s=60).empty
    assert not window_for(format_time(NOW - timedelta(hours=1)), NOW, settle_s=60).empty


def test_parse_time_normalises_to_utc():
    assert parse_time("2026-03-01T03:00:00+01:00") == datetime(2026, 3, 1, 2, tzinfo=UTC)
    assert parse_time("2026-03-01T02:00:00") == datetime(2026, 3, 1, 2, tzinfo=UTC)
