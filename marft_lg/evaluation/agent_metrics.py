"""Per-agent and per-episode behaviour metrics read off a TrajectoryDataset.

These expose what a team-level reward can hide: one agent taking more steps, spending more tokens,
calling the wrong tools, bouncing work back and forth, or breaking its output format.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from marft_lg.rewards.components.coordination import handoff_loops
from marft_lg.trajectories.dataset import TrajectoryDataset

AGENT_METRICS: tuple[str, ...] = (
    "steps",  # actions the agent took in the episode
    "input_tokens",
    "output_tokens",
    "tool_accuracy",  # correct tool calls / tool calls (NaN when it made none)
    "handoff_loops",  # excess hand-offs of handoff loops it received (rewards.components.coordination.handoff_loops)
    "format_compliance",  # share of its actions whose completion matches its format (NaN: no actions)
    "reward",  # sum of the per-action rewards it earned (NaN when the reward gave none)
)
EPISODE_METRICS: tuple[str, ...] = ("steps", "tokens", "latency_s", "handoff_loops", "tool_errors", "error")
# Metrics where a higher value is better (the rest are costs: lower is better).
HIGHER_IS_BETTER: frozenset[str] = frozenset({"tool_accuracy", "format_compliance", "reward"})


def _count_handoff_loops(actions: list[dict[str, Any]]) -> list[int]:
    """1 at position i when action i received an excess hand-off of a handoff loop (two agents passing control
    back and forth more than twice without progress: the rule of `handoff_loops`, shared with the reward)."""
    excess = {o for loop in handoff_loops(actions) for o in loop}
    return [int(int(a["order"]) in excess) for a in actions]


def _tool_score(calls: Any, expected: set[str]) -> tuple[int, int]:
    """(correct, total) tool calls: correct = no error and, when the scenario lists tools, an expected one."""
    total = correct = 0
    for call in calls or []:
        if not isinstance(call, Mapping):
            continue
        total += 1
        ok = not call.get("error") and (not expected or call.get("name") in expected)
        correct += int(ok)
    return correct, total


def _format_ok(completion: Any, pattern: re.Pattern[str] | None) -> bool:
    text = completion if isinstance(completion, str) else ""
    if pattern is None:
        return bool(text.strip())
    return pattern.search(text) is not None


def _compile_formats(formats: Mapping[str, str] | None) -> dict[str, re.Pattern[str]]:
    out: dict[str, re.Pattern[str]] = {}
    for role, pattern in (formats or {}).items():
        try:
            out[role] = re.compile(pattern, re.DOTALL)
        except re.error as exc:
            raise ValueError(f"format pattern for agent {role!r} is not a valid regex ({exc}): {pattern!r}") from exc
    return out


def _num(value: Any) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return 0.0
    return 0.0 if math.isnan(out) else out


def _actions_by_episode(dataset: TrajectoryDataset) -> dict[str, list[dict[str, Any]]]:
    """Episode id -> its actions as dicts, in `order` (one pass over the table, no per-group pandas)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for row in dataset.actions.to_dict("records"):
        out.setdefault(row["episode_id"], []).append(row)
    for acts in out.values():
        acts.sort(key=lambda a: a["order"])
    return out


def agent_metrics(
    dataset: TrajectoryDataset,
    *,
    scenarios: Mapping[str, Mapping[str, Any]] | None = None,
    formats: Mapping[str, str] | None = None,
    action_rewards: Mapping[str, Any] | None = None,
    agents: list[str] | None = None,
) -> pd.DataFrame:
    """One row per (episode, agent): the AGENT_METRICS for that agent in that episode.

    `formats` maps a role (or ``"*"`` for all) to a regex its completions must match; without one a
    completion complies when it is non-empty. `action_rewards` is `RewardResult.action_rewards`.
    Agents listed in `agents` that did not act get zero steps/tokens and NaN rates.
    """
    patterns = _compile_formats(formats)
    scenario_of = dict(zip(dataset.episodes["episode_id"], dataset.episodes["scenario_id"], strict=True))
    grouped = _actions_by_episode(dataset)
    all_agents = sorted(set(agents or []) | set(dataset.actions["agent"].dropna().unique()))
    rows: list[dict[str, Any]] = []
    for eid in dataset.episode_ids:
        acts = grouped.get(eid, [])
        scen = (scenarios or {}).get(scenario_of.get(eid)) or {}
        expected = set(scen.get("expected_tools") or [])
        loops = _count_handoff_loops(acts)
        per_action = None if action_rewards is None else action_rewards.get(eid)
        per_action = None if per_action is None else np.asarray(per_action, dtype=float)
        by_agent: dict[str, list[tuple[int, dict[str, Any]]]] = {}
        for i, a in enumerate(acts):
            by_agent.setdefault(a["agent"], []).append((i, a))
        for agent in all_agents:
            mine = by_agent.get(agent, [])
            correct = total = 0
            for _, a in mine:
                c, t = _tool_score(a.get("tool_calls"), expected)
                correct, total = correct + c, total + t
            pattern = patterns.get(agent, patterns.get("*"))
            reward = math.nan
            if per_action is not None and per_action.size == len(acts):
                reward = float(sum(per_action[i] for i, _ in mine))
            rows.append({
                "episode_id": eid,
                "agent": agent,
                "steps": len(mine),
                "input_tokens": sum(_num(a.get("input_tokens")) for _, a in mine),
                "output_tokens": sum(_num(a.get("output_tokens")) for _, a in mine),
                "tool_accuracy": correct / total if total else math.nan,
                "handoff_loops": sum(loops[i] for i, _ in mine),
                "format_compliance": (float(np.mean([_format_ok(a.get("completion"), pattern) for _, a in mine]))
                                      if mine else math.nan),
                "reward": reward,
            })
    return pd.DataFrame(rows, columns=["episode_id", "agent", *AGENT_METRICS])


def episode_metrics(dataset: TrajectoryDataset) -> pd.DataFrame:
    """One row per episode: EPISODE_METRICS (tokens = input + output over all actions; error = 0/1)."""
    grouped = _actions_by_episode(dataset)
    rows = []
    for info in dataset.episodes.to_dict("records"):
        eid = info["episode_id"]
        acts = grouped.get(eid, [])
        rows.append({
            "episode_id": eid,
            "steps": len(acts),
            "tokens": sum(_num(a.get("input_tokens")) + _num(a.get("output_tokens")) for a in acts),
            "latency_s": sum(_num(a.get("latency_s")) for a in acts),
            "handoff_loops": sum(_count_handoff_loops(acts)),
            "tool_errors": sum(_num(a.get("tool_errors")) for a in acts),
            "error": float(info.get("status") not in (None, "ok")),
        })
    return pd.DataFrame(rows, columns=["episode_id", *EPISODE_METRICS])
