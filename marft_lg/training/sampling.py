"""Which scenario groups carry a learning signal (`return_groups`), and DAPO's dynamic sampling (`DynamicSample`).

An iteration's episodes are grouped by scenario (`TrajectoryDataset.scenario_groups`). Without a critic an episode's
advantage is its return against its group's mean: a group whose episodes all got the same return (every one solved,
or none) gives each of its actions advantage 0, and the rollouts spent on it teach nothing. `return_groups` sorts an
iteration's groups by that (the metrics row's `equal_groups_share` is the waste it measures); with
``dynamic_sampling: true`` the trainer keeps only the informative groups of one or more draws (`DynamicSample`) and
reports what it dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from marft_lg.training.gae import returns_equal
from marft_lg.trajectories.dataset import TrajectoryDataset

DRAW_STRIDE = 1_000_000
"""`draw_iteration`: extra draw `d` of trainer iteration `i` hands the collector iteration ``i + d * DRAW_STRIDE``."""


def draw_iteration(iteration: int, draw: int) -> int:
    """The iteration number extra collect round `draw` (1, 2, ...) of trainer iteration `iteration` hands the
    collector. Collectors make episode ids (``<run>-it<n>-<scenario>-<j>``) and episode seeds from it, so each draw's
    episodes are new ones with seeds of their own, even when a draw runs a scenario the iteration already ran (the
    cycling list wrapped): draw 1 of iteration 3 runs as iteration 1000003, draw 2 as 2000003."""
    return iteration + draw * DRAW_STRIDE


@dataclass
class ReturnGroups:
    """An iteration's scenario groups (episode ids) by the spread of their scored episodes' returns:
    `informative` (they differ), `equal` (2 or more scored episodes, all with one return: `gae.returns_equal`) and
    `single` (fewer than 2 scored episodes: an episode without a scenario, or a group whose others went unscored)."""

    informative: list[list[str]] = field(default_factory=list)
    equal: list[list[str]] = field(default_factory=list)
    single: list[list[str]] = field(default_factory=list)

    def extend(self, other: ReturnGroups) -> None:
        self.informative += other.informative
        self.equal += other.equal
        self.single += other.single

    def counts(self) -> dict[str, Any]:
        """The metrics row's keys: `groups` (all), `equal_groups`, `single_groups`, and `equal_groups_share`, the
        share of the comparable groups (2 or more scored episodes) whose returns are all equal (None without any)."""
        comparable = len(self.informative) + len(self.equal)
        return {"groups": comparable + len(self.single), "equal_groups": len(self.equal),
                "single_groups": len(self.single),
                "equal_groups_share": len(self.equal) / comparable if comparable else None}


def return_groups(dataset: TrajectoryDataset, action_rewards: dict[str, Any]) -> ReturnGroups:
    """`dataset`'s scenario groups sorted by their returns (an episode's return: the sum of its action rewards, the
    return the group baseline compares; an episode missing from `action_rewards` is unscored)."""
    out = ReturnGroups()
    for members in dataset.scenario_groups().values():
        scored = [float(np.sum(action_rewards[e])) for e in members if e in action_rewards]
        if len(scored) < 2:
            out.single.append(members)
        elif returns_equal(scored):
            out.equal.append(members)
        else:
            out.informative.append(members)
    return out


@dataclass
class Scored:
    """Episodes and what the reward made of them: the scorer's episode table and each episode's action rewards."""

    dataset: TrajectoryDataset
    table: pd.DataFrame | None
    action_rewards: dict[str, Any]


class DynamicSample:
    """An iteration's draws under ``dynamic_sampling``: what was collected, and the groups kept for the update.

    `wanted`: the informative groups the iteration is after (online: its scenarios per iteration; None offline, where
    nothing is drawn again). `drop_single`: whether groups with fewer than 2 scored episodes are dropped too (online:
    a group of K that lost its others has nothing to compare; offline: episodes without a scenario are kept).
    Every dropped group and episode is counted (`report`).
    """

    def __init__(self, wanted: int | None, *, drop_single: bool):
        self.wanted, self.drop_single = wanted, drop_single
        self.draws: list[Scored] = []
        self.groups = ReturnGroups()
        self._kept: list[str] = []

    def add(self, draw: Scored) -> ReturnGroups:
        """Take one draw's scored episodes; returns its groups."""
        groups = return_groups(draw.dataset, draw.action_rewards)
        self.draws.append(draw)
        self.groups.extend(groups)
        keep = groups.informative + ([] if self.drop_single else groups.single)
        self._kept += [e for members in keep for e in members]
        return groups

    @property
    def informative(self) -> int:
        return len(self.groups.informative)

    @property
    def missing(self) -> int:
        """Informative groups still wanted (0 offline)."""
        return max(0, (self.wanted or 0) - self.informative)

    def collected(self) -> Scored:
        """Every draw's episodes together (the metrics' rewards and waste are over these)."""
        if len(self.draws) == 1:
            return self.draws[0]
        tables = [d.table for d in self.draws if d.table is not None]
        rewards: dict[str, Any] = {}
        for d in self.draws:
            rewards.update(d.action_rewards)
        return Scored(TrajectoryDataset.concat([d.dataset for d in self.draws]),
                      pd.concat(tables, ignore_index=True) if tables else None, rewards)

    def kept(self) -> Scored:
        """The episodes of the kept groups, their table rows and rewards: what the update trains on."""
        everything = self.collected()
        ids = set(self._kept)
        table = everything.table
        if table is not None and "episode_id" in table.columns:
            table = table[table["episode_id"].isin(ids)]
        return Scored(everything.dataset.select(sorted(ids)), table,
                      {e: r for e, r in everything.action_rewards.items() if e in ids})

    def report(self) -> dict[str, Any]:
        """The metrics row's `dynamic_sampling`: collect rounds (`draws`), informative groups found and `wanted`,
        groups and episodes dropped (`dropped_groups` = `dropped_equal` + `dropped_single`), episodes kept, and
        `short`: the informative groups the budget of draws did not find (0: none missing)."""
        dropped = self.groups.equal + (self.groups.single if self.drop_single else [])
        return {"draws": len(self.draws), "wanted": self.wanted, "informative": self.informative,
                "dropped_groups": len(dropped), "dropped_equal": len(self.groups.equal),
                "dropped_single": len(self.groups.single) if self.drop_single else 0,
                "dropped_episodes": sum(len(m) for m in dropped), "kept_episodes": len(set(self._kept)),
                "short": self.missing}
