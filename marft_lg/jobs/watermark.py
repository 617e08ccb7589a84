"""Watermark windows: which mined episodes a run may train on.

A run owns the half-open window `(watermark, cutoff]` of episode END times, with
`cutoff = now - settle_s` (spans of just-finished episodes may still be in flight). Every episode
falls into exactly one window, so consecutive runs never train on an episode twice and never skip
one; a window whose run did not succeed is simply offered again to the next run.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pandas as pd

from marft_lg.trajectories.dataset import TrajectoryDataset


@dataclass(frozen=True)
class Window:
    """Episodes with `start < end_time <= end` (start None = from the beginning)."""

    start: datetime | None
    end: datetime

    @property
    def empty(self) -> bool:
        return self.start is not None and self.end <= self.start

    def describe(self) -> str:
        start = self.start.isoformat() if self.start else "the beginning"
        return f"episodes ending after {start} and up to {self.end.isoformat()}"


def parse_time(value: str | datetime | None) -> datetime | None:
    """ISO text (or datetime) -> aware UTC datetime; naive values are taken as UTC."""
    if value is None:
        return None
    dt = value if isinstance(value, datetime) else datetime.fromisoformat(str(value))
    return dt.replace(tzinfo=UTC) if dt.tzinfo is None else dt.astimezone(UTC)


def format_time(value: datetime) -> str:
    return value.astimezone(UTC).isoformat(timespec="microseconds")


def window_for(watermark: str | datetime | None, now: datetime, *, settle_s: float,
               initial: str | datetime | None = None) -> Window:
    """The window a run starting at `now` owns, given the stored watermark."""
    start = parse_time(watermark) if watermark is not None else parse_time(initial)
    return Window(start=start, end=parse_time(now) - timedelta(seconds=settle_s))


def hold_unsettled(dataset: TrajectoryDataset, window: Window, *, wait_s: float) -> Window:
    """`window`, ended just before its first episode that is not settled (a call still without its server record, or
    a run still without its root span: mined column `settled` False) when that episode ended less than `wait_s`
    before the window's end: it and every later one go to the next run, so the watermark never passes an episode
    still settling. One that waited longer has lost its record and is taken as it is (its calls without exact token
    ids; an incomplete one stays unscored)."""
    eps = dataset.episodes
    if eps.empty or "settled" not in eps:
        return window
    end = pd.to_datetime(eps["end_time"], utc=True)
    waiting = (eps["settled"] == False).to_numpy() & (end <= pd.Timestamp(window.end)).to_numpy()  # noqa: E712
    waiting &= (end > pd.Timestamp(window.end - timedelta(seconds=wait_s))).to_numpy()
    if window.start is not None:
        waiting &= (end > pd.Timestamp(window.start)).to_numpy()
    if not waiting.any():
        return window
    return Window(start=window.start, end=end[waiting].min().to_pydatetime() - timedelta(microseconds=1))


def select_window(dataset: TrajectoryDataset, window: Window) -> TrajectoryDataset:
    """The episodes of `dataset` that belong to `window` (by end time; start time when unfinished)."""
    eps = dataset.episodes
    if eps.empty:
        return dataset
    end = pd.to_datetime(eps["end_time"], utc=True)
    when = end.fillna(pd.to_datetime(eps["start_time"], utc=True))
    keep = when <= pd.Timestamp(window.end)
    if window.start is not None:
        keep &= when > pd.Timestamp(window.start)
    return dataset.select(eps.loc[keep.fillna(False).to_numpy(), "episode_id"].tolist())
