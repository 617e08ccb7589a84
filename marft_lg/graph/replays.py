"""Counterfactual replays of a set of episodes: which steps to replay (`plan_replays`, as `EpisodeJob`s any collector
runs, in process or on Ray rollout workers), where the replayed step sits in a replay (`step_order`), and the usable
replays of each action with their returns (`sibling_returns`). The trainer's counterfactual credit
(`training.credit`) and the blame report (`evaluation.attribution`) are both built on these.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from marft_lg.graph.collect import EpisodeJob
from marft_lg.graph.routing import derive_seed
from marft_lg.serving.replay import REPLAY_OF, ReplayPlan, recorded_calls
from marft_lg.trajectories.dataset import TrajectoryDataset
from marft_lg.trajectories.scenarios import Scenario

ActionKey = tuple[str, int]
"""(episode id, action order)."""


@dataclass
class ReplayBudget:
    """What to replay: `per_action` replays of each action of `agents` (None: every agent), in a `fraction` of the
    episodes; `tools`: ``"refuse"`` (default) skips an action whose upstream made tool calls (a replay would run those
    tools again), ``"rerun"`` replays it anyway (tools without side effects only); `reference` as `ReplayPlan`."""

    per_action: int = 2
    agents: Collection[str] | None = None
    fraction: float = 1.0
    tools: str = "refuse"
    reference: str | Mapping[str, str] | None = None
    """One reference for every agent, or ``{role: reference}`` (e.g. each role's baseline version)."""
    versions: Mapping[str, str] | None = None
    """Version pins of the replays' other calls (those of the episodes being replayed), None: what the team serves."""


@dataclass
class ReplayBatch:
    """The planned replays and what could not be planned (reason -> count)."""

    jobs: list[EpisodeJob] = field(default_factory=list)
    skipped: Counter = field(default_factory=Counter)


def plan_replays(dataset: TrajectoryDataset, scenarios: Mapping[str, Scenario], budget: ReplayBudget, *,
                 seed: int, tag: str = "") -> ReplayBatch:
    """`budget.per_action` replay jobs per replayable action of the dataset's episodes (their scenario's input,
    a seed of their own). An episode without a known scenario (its input) or that failed is not replayed."""
    out = ReplayBatch()
    rng = random.Random(seed)
    actions = dataset.actions.sort_values(["episode_id", "order"], kind="stable")
    by_episode = {eid: part for eid, part in actions.groupby("episode_id", sort=False)}
    table = dataset.episodes.set_index("episode_id")
    for eid in dataset.episode_ids:
        if budget.fraction < 1.0 and rng.random() >= budget.fraction:
            continue
        sid = table.at[eid, "scenario_id"] if "scenario_id" in table else None
        scenario = scenarios.get(sid) if isinstance(sid, str) else None
        if scenario is None:
            out.skipped["no_scenario"] += 1
            continue
        if table.at[eid, "status"] == "error":
            out.skipped["failed_episode"] += 1
            continue
        part = by_episode.get(eid)
        if part is None:
            continue
        calls = recorded_calls(part)
        tools = [bool(tc) for tc in part["tool_calls"]]
        for k, call in enumerate(calls):
            if budget.agents is not None and call.agent not in budget.agents:
                continue
            if budget.tools == "refuse" and any(tools[:k]):
                out.skipped["upstream_tool_calls"] += 1
                continue
            for j in range(budget.per_action):
                ref = budget.reference
                plan = ReplayPlan(episode_id=eid, step=call.order, agent=str(call.agent), held=tuple(calls[:k]),
                                  target=call, reference=ref.get(str(call.agent)) if isinstance(ref, Mapping) else ref,
                                  index=j, later=tuple(calls[k + 1:]))
                out.jobs.append(EpisodeJob(scenario, f"{eid}-r{call.order}.{j}{tag}",
                                           derive_seed(seed, f"replay|{eid}|{call.order}", j),
                                           versions=dict(budget.versions) if budget.versions else None, replay=plan))
    return out


def step_order(actions: Any, plan: ReplayPlan) -> int | None:
    """The order of the replayed step among a replay episode's actions (rows of `TrajectoryDataset.actions`): the
    first action of the plan's agent asked the step's prompt once the held calls are accounted for."""
    held = Counter((c.agent, c.prompt_ids, c.completion_ids) for c in plan.held)
    target = plan.target
    for call in recorded_calls(actions.sort_values("order", kind="stable")):
        key = (call.agent, call.prompt_ids, call.completion_ids)
        if held[key] > 0:
            held[key] -= 1
            continue
        if call.agent == target.agent and target.asks(call.prompt_ids, call.messages_key):
            return call.order
    return None


def episode_returns(action_rewards: Mapping[str, Any]) -> dict[str, float]:
    """An episode's return: the sum of its actions' rewards."""
    return {eid: float(np.sum(r)) for eid, r in action_rewards.items()}


def sibling_returns(replays: TrajectoryDataset, replay_returns: Mapping[str, float],
                    plans: Mapping[str, ReplayPlan]) -> tuple[dict[ActionKey, list[tuple[ActionKey, float]]], Counter]:
    """``{(episode, order): [((replay, step order), R'), ...]}``: the usable replays of each replayed action (upstream
    held, step found, scored), and how many were not usable (`diverged`, `failed`)."""
    meta = _metadata(replays)
    out: dict[ActionKey, list[tuple[ActionKey, float]]] = {}
    lost: Counter = Counter()
    actions = replays.actions
    by_episode = {eid: part for eid, part in actions.groupby("episode_id", sort=False)} if len(actions) else {}
    for rid, plan in plans.items():
        info = meta.get(rid)
        if info is None or rid not in replay_returns:
            lost["failed"] += 1
            continue
        order = step_order(by_episode[rid], plan) if rid in by_episode and not info.get("replay_diverged") else None
        if order is None:
            lost["diverged"] += 1
            continue
        out.setdefault((plan.episode_id, plan.step), []).append(((rid, order), float(replay_returns[rid])))
    return out, lost


def _metadata(dataset: TrajectoryDataset) -> dict[str, dict[str, Any]]:
    """Replay episode id -> its metadata (only episodes marked as replays)."""
    table = dataset.episodes
    if not len(table):
        return {}
    return {eid: m for eid, m in zip(table["episode_id"], table["metadata"], strict=True)
            if isinstance(m, dict) and m.get(REPLAY_OF)}
