"""TrajectoryDataset: multi-agent episodes and their ordered agent actions, as two pandas tables.

This is the one data type between mining, rewards, training and evaluation. An *action* is one
LLM call made by one agent inside an episode (Flex-POMDP); `order` is its place in the episode and
`depends_on` lists the `order` of earlier actions whose output it could see (the dependency
function D of the paper).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from marft_lg.trajectories.columns import ACTION_COLUMNS, EPISODE_COLUMNS, JSON_COLUMNS, json_texts


def scenario_of(scenario_id: Any) -> str | None:
    """A table's scenario id as text (a scenario file may number them), or None where the episode ran none (None,
    NaN after a concat or parquet, "")."""
    if isinstance(scenario_id, str):
        return scenario_id or None
    if scenario_id is None or (pd.api.types.is_scalar(scenario_id) and pd.isna(scenario_id)):
        return None
    return str(scenario_id)


def scenario_key(episode_id: str, scenario_id: Any) -> str:
    """What groups an episode with others: its scenario, or without one its own id (a group of one)."""
    return scenario_of(scenario_id) or episode_id


@dataclass
class Episode:
    """One episode as the reward components see it: its row, its actions in order, its scenario."""

    episode_id: str
    info: dict[str, Any]
    actions: list[dict[str, Any]]
    scenario: dict[str, Any] | None = None

    @property
    def agents(self) -> list[str]:
        return [a["agent"] for a in self.actions]

    @property
    def final_completion(self) -> str:
        return self.actions[-1]["completion"] if self.actions else ""


@dataclass
class TrajectoryDataset:
    """Two DataFrames (`episodes`, `actions`) with a fixed set of columns; parquet in and out."""

    episodes: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=list(EPISODE_COLUMNS)))
    actions: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=list(ACTION_COLUMNS)))

    def __post_init__(self) -> None:
        for name, frame, cols in (("episodes", self.episodes, EPISODE_COLUMNS), ("actions", self.actions, ACTION_COLUMNS)):
            missing = [c for c in cols if c not in frame.columns]
            if missing:
                raise ValueError(f"TrajectoryDataset.{name} is missing columns {missing}; expected at least {list(cols)}")
        self.actions = self.actions.sort_values(["episode_id", "order"], kind="stable").reset_index(drop=True)
        self.episodes = self.episodes.sort_values(["start_time", "episode_id"], kind="stable").reset_index(drop=True)

    def __len__(self) -> int:
        return len(self.episodes)

    @property
    def episode_ids(self) -> list[str]:
        return self.episodes["episode_id"].tolist()

    def iter_episodes(self, scenarios: dict[str, dict[str, Any]] | None = None) -> Iterator[Episode]:
        """Yield `Episode` views in table order, joined to their scenario data when given."""
        # One to_dict over the whole table: per-group conversion costs ~20 ms an episode.
        by_episode: dict[str, list[dict[str, Any]]] = {}
        for action in self.actions.to_dict("records"):
            by_episode.setdefault(action["episode_id"], []).append(action)
        for row in self.episodes.to_dict("records"):
            eid = row["episode_id"]
            actions = by_episode.get(eid, [])
            sid = row.get("scenario_id")
            scenario = scenarios.get(sid) if scenarios and sid is not None else None
            yield Episode(episode_id=eid, info=row, actions=actions, scenario=scenario)

    def scenario_groups(self) -> dict[str, list[str]]:
        """Episode ids by the scenario they ran, in table order: the group whose mean return is an episode's
        baseline. An episode without a scenario (mined from production traces) is a group of its own."""
        groups: dict[str, list[str]] = {}
        for eid, sid in zip(self.episodes["episode_id"], self.episodes["scenario_id"], strict=True):
            groups.setdefault(scenario_key(eid, sid), []).append(eid)
        return groups

    def select(self, episode_ids: list[str]) -> TrajectoryDataset:
        """A dataset holding only the given episodes."""
        keep = set(episode_ids)
        return TrajectoryDataset(
            episodes=self.episodes[self.episodes["episode_id"].isin(keep)].copy(),
            actions=self.actions[self.actions["episode_id"].isin(keep)].copy(),
        )

    @staticmethod
    def concat(datasets: list[TrajectoryDataset]) -> TrajectoryDataset:
        """Join datasets; an episode present twice keeps its first copy."""
        if not datasets:
            return TrajectoryDataset()
        eps = pd.concat([d.episodes for d in datasets], ignore_index=True).drop_duplicates("episode_id")
        acts = pd.concat([d.actions for d in datasets], ignore_index=True).drop_duplicates(["episode_id", "order"])
        return TrajectoryDataset(episodes=eps, actions=acts)

    def to_parquet(self, directory: str | Path) -> None:
        """Write `episodes.parquet` and `actions.parquet` into `directory` (atomic per file)."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        for name, frame in (("episodes", self.episodes), ("actions", self.actions)):
            tmp = out / f".{name}.parquet.tmp"
            _to_parquet_frame(frame).to_parquet(tmp, index=False)
            tmp.replace(out / f"{name}.parquet")

    @classmethod
    def from_parquet(cls, directory: str | Path) -> TrajectoryDataset:
        """Read a dataset written by `to_parquet`."""
        d = Path(directory)
        for name in ("episodes", "actions"):
            if not (d / f"{name}.parquet").exists():
                raise FileNotFoundError(f"{d / (name + '.parquet')} not found: is {d} a directory written by `marft-lg mine --out`?")
        episodes = _from_parquet_frame(pd.read_parquet(d / "episodes.parquet"))
        actions = _from_parquet_frame(pd.read_parquet(d / "actions.parquet"))
        return cls(episodes=episodes, actions=actions)


def _to_parquet_frame(frame: pd.DataFrame) -> pd.DataFrame:
    out = frame.copy()
    for col in JSON_COLUMNS & set(out.columns):
        out[col] = json_texts(out[col])
    return out


def _from_parquet_frame(frame: pd.DataFrame) -> pd.DataFrame:
    import json

    import numpy as np

    out = frame.copy()
    for col in JSON_COLUMNS & set(out.columns):
        out[col] = [None if v is None else json.loads(v) for v in out[col]]
    for col in out.columns:
        if out[col].dtype == object:
            out[col] = [v.tolist() if isinstance(v, np.ndarray) else v for v in out[col]]
    if "constraint" in out.columns:  # null when free: a typed text column in one file, an all-null one in another
        out["constraint"] = pd.Series([v if isinstance(v, str) else None for v in out["constraint"]], dtype=object,
                                      index=out.index)
    return out
