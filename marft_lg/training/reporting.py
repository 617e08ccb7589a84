"""What an iteration reports: its metrics row (`metrics_row`) and the progress bar of a training phase."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from marft_lg.training.checks import SHOWN, DataProblem, problem_counts
from marft_lg.training.sampling import ReturnGroups, return_groups

if TYPE_CHECKING:
    from marft_lg.training.buffer import RolloutBuffer
    from marft_lg.training.ppo import UpdateStats
    from marft_lg.trajectories.dataset import TrajectoryDataset

_STANDARD_EPISODE_COLUMNS = {"episode_id", "reward", "scored", "error"}


def metrics_row(*, iteration: int, phase: str, dataset: TrajectoryDataset, action_rewards: dict,
                table: pd.DataFrame | None, buffer: RolloutBuffer, stats: UpdateStats | None, agents: list[str],
                restored: list[str], elapsed: float, frozen_roles: list[str],
                agent_bases: dict[str, str], problems: Sequence[DataProblem] = (),
                groups: ReturnGroups | None = None, trained: int | None = None, zero_advantage: int | None = None,
                times: Mapping[str, float] | None = None, wall_s: float | None = None) -> dict[str, Any]:
    """One iteration's row of metrics.jsonl: rewards and reward components, what the buffer kept and left out, the
    actions the data checks left out (`data_check_failed`, by kind in `data_checks`, the first few named in
    `data_problems`), and, after an update, each agent's stats, the critic's and the throughput.

    The waste: `groups`, `equal_groups`, `single_groups` and `equal_groups_share` (the scenario groups of `dataset`
    whose returns are all equal, `sampling.return_groups`; `groups` given: those instead, e.g. every draw of a
    dynamic-sampling iteration), `trained_actions` and `zero_advantage_share` (the share of them whose advantage was
    exactly 0 before normalisation). Time: `times` (`rollout_s`, `scoring_s`, `replay_s`, `update_s`) joined as they
    are; `wall_s`, the whole iteration's wall time, is `iteration_s`, and `tokens_per_min` is tokens trained over it.
    """
    rewards = episode_rewards(dataset, action_rewards, table)
    row: dict[str, Any] = {
        "iteration": iteration, "phase": phase, "episodes": len(dataset), "actions": len(buffer.records),
        "reward_mean": float(np.mean(rewards)) if len(rewards) else None,
        "reward_std": float(np.std(rewards)) if len(rewards) else None,
        "components": reward_components(table), "trained_agents": agents, "restored": restored,
        "skipped": dict(buffer.skipped), "recomputed": dict(buffer.recomputed),
        "frozen_agents": sorted(set(frozen_roles) | set(buffer.frozen)),
        "frozen_actions": dict(buffer.frozen), "agent_bases": dict(agent_bases),
        "recomputed_logprobs": buffer.n_recomputed, "retokenised": dict(buffer.retokenised), "time_s": elapsed,
        "data_check_failed": len(problems), "data_checks": problem_counts(problems),
        "data_problems": [str(p) for p in problems[:SHOWN]],
        **(groups if groups is not None else return_groups(dataset, action_rewards)).counts(),
    }
    if trained is not None:
        row["trained_actions"] = trained
        row["zero_advantage_share"] = (zero_advantage or 0) / trained if trained else None
    row.update(times or {})
    if wall_s is not None:
        row["iteration_s"] = wall_s
    if stats is not None:
        row.update({"agents": {a: asdict(s) for a, s in stats.agents.items()}, "value_loss": stats.value_loss,
                    "critic_grad_norm": stats.critic_grad_norm, "explained_variance": stats.explained_variance,
                    "tokens": stats.tokens, "tokens_per_s": stats.tokens / elapsed if elapsed > 0 else None,
                    "nonfinite": stats.nonfinite})
        if wall_s is not None:
            row["tokens_per_min"] = stats.tokens / (wall_s / 60) if wall_s > 0 else None
    return row


def episode_rewards(dataset: TrajectoryDataset, action_rewards: dict, table: pd.DataFrame | None) -> list[float]:
    """The scored episodes' rewards: the scorer's table when there is one, else the sum of each episode's rewards."""
    if table is not None and "reward" in table.columns and len(table):
        ids = set(dataset.episode_ids)
        t = table[table["episode_id"].isin(ids)]
        if "scored" in t.columns:
            t = t[t["scored"].fillna(True).astype(bool)]
        return [float(x) for x in t["reward"] if x is not None and math.isfinite(float(x))]
    return [float(np.sum(action_rewards[e])) for e in dataset.episode_ids if e in action_rewards]


def reward_components(table: pd.DataFrame | None) -> dict[str, float]:
    """The mean of each numeric reward component column of the episode table."""
    if table is None or not len(table):
        return {}
    out = {}
    for col in table.columns:
        if col in _STANDARD_EPISODE_COLUMNS:
            continue
        values = pd.to_numeric(table[col], errors="coerce").dropna()
        if len(values):
            out[col] = float(values.mean())
    return out


@contextmanager
def progress_bar(total: int, label: str, enabled: bool = True) -> Iterator[Callable[..., None]]:
    """One bar for a phase; `advance(reward)` moves it and shows the latest team reward beside the ETA
    (`advance.note(text)` shows a note). Disabled: `advance` does nothing."""
    if not enabled:
        yield lambda reward=None: None
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    with Progress("[bold]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[reward]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                  TextColumn("{task.fields[note]}"), transient=False) as prog:
        task = prog.add_task(label, total=max(0, total), reward="", note="")

        def advance(reward: float | None = None) -> None:
            shown = f"reward {reward:.3f}" if isinstance(reward, int | float) and math.isfinite(reward) else ""
            prog.update(task, advance=1, reward=shown)

        advance.note = lambda text: prog.update(task, note=text)  # type: ignore[attr-defined]
        yield advance
