"""The episodes a wrapped app just ran, read back from its own span records: no file, no JSON."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from marft_lg.trajectories.dataset import TrajectoryDataset


class EpisodeCapture:
    """The spans a `WrappedGraph` finished inside ``with app.capture() as captured:``. They are exported to the trace
    files as usual; `dataset()` assembles them the way `mine` assembles those files, to the same tables."""

    def __init__(self, spans: list[Any]):
        self.spans = spans

    def dataset(self, episode_ids: Iterable[str] | None = None) -> TrajectoryDataset:
        """The captured episodes (only those of `episode_ids`, when given), in mining order."""
        from marft_lg.trajectories.in_memory import raw_spans
        from marft_lg.trajectories.mining import mine_spans

        dataset = mine_spans(raw_spans(list(self.spans)), replays=True, shadows=True)
        return dataset if episode_ids is None else dataset.select(list(episode_ids))
