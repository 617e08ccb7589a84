"""Per-agent counterfactual credit: replay one agent's step with its upstream held, compare the returns.

In the Flex-MG view of MARFT (sec. 3.1) an episode is the ordered actions a_1..a_n of the agents, each a_k seeing
the observation made of the actions it depends on (D). The group baseline compares whole episodes of one scenario,
so every agent of an episode gets the same advantage: the actor pays for the reasoner's mistakes. The
counterfactual estimator compares each action against *siblings*: the same episode replayed with every action
before a_k held as recorded (the same upstream, so the same observation o_k) and a_k sampled again from agent k's
policy, the rest of the graph running on to a new return R'. The advantage of a_k is its return minus the
leave-one-out mean of its siblings' returns, which only a_k's own choice (and what follows from it) can move.

What to replay and the replays' returns per action come from `graph.replays`; `counterfactual_credit` turns them into
an advantage per action (pure: tested against a hand computation); `replay_credit` is one iteration's whole round.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from marft_lg.graph.replays import ActionKey, ReplayBudget, episode_returns, plan_replays, sibling_returns
from marft_lg.serving.replay import ReplayPlan
from marft_lg.trajectories.dataset import TrajectoryDataset
from marft_lg.trajectories.scenarios import Scenario

log = logging.getLogger("marft_lg.training")


@dataclass
class Credit:
    """Advantages per action (`advantages`, keyed by (episode id, order)) and what the replays gave."""

    advantages: dict[ActionKey, float] = field(default_factory=dict)
    replays: int = 0
    used: int = 0
    diverged: int = 0
    failed: int = 0
    counterfactual_actions: int = 0
    fallback_actions: int = 0


def counterfactual_credit(dataset: TrajectoryDataset, returns: Mapping[str, float], replays: TrajectoryDataset,
                          replay_returns: Mapping[str, float], plans: Mapping[str, ReplayPlan], *,
                          agents: Collection[str] | None = None) -> Credit:
    """Advantage per action of `dataset` (the episodes trained on) and per replayed step of `replays`.

    The siblings of action k of episode e are e itself and the usable replays of (e, k) (upstream held, step found);
    each sibling's advantage is its return minus the mean of the others' (leave one out). An action without usable
    replays falls back to its episode's return minus the mean return of its scenario's episodes (the group baseline,
    unnormalised: `normalize_advantages` scales every advantage of the batch alike). `agents`: whose actions get an
    advantage (None: all).
    """
    siblings, lost = sibling_returns(replays, replay_returns, plans)
    credit = Credit(replays=len(plans), used=sum(len(v) for v in siblings.values()), diverged=lost["diverged"],
                    failed=lost["failed"])
    group = _group_baselines(dataset, returns)
    for eid, agent, order in zip(dataset.actions["episode_id"], dataset.actions["agent"], dataset.actions["order"],
                                 strict=True):
        if agents is not None and agent not in agents or eid not in returns:
            continue
        key = (str(eid), int(order))
        others = siblings.get(key)
        if others:
            members = [(key, returns[eid]), *others]
            total = sum(r for _, r in members)
            for k, r in members:
                credit.advantages[k] = r - (total - r) / (len(members) - 1)
            credit.counterfactual_actions += 1
        else:
            credit.advantages[key] = returns[eid] - group.get(eid, returns[eid])
            credit.fallback_actions += 1
    return credit


def _group_baselines(dataset: TrajectoryDataset, returns: Mapping[str, float]) -> dict[str, float]:
    """Each episode's scenario mean return (its own return when it is alone in its scenario)."""
    groups = [[e for e in members if e in returns] for members in dataset.scenario_groups().values()]
    return {e: float(np.mean([returns[m] for m in members])) for members in groups for e in members}


@dataclass
class Replayed:
    """An iteration's episodes plus its counterfactual replays, their rewards, each action's advantage, and what the
    replays cost (`stats`, joined to the iteration's metrics row)."""

    dataset: TrajectoryDataset
    action_rewards: dict[str, Any]
    advantages: dict[ActionKey, float]
    stats: dict[str, Any]


def replay_credit(runner: Any, dataset: TrajectoryDataset, action_rewards: Mapping[str, Any],
                  scenarios: Mapping[str, Scenario], budget: ReplayBudget, *,
                  score: Callable[[TrajectoryDataset, Any], tuple[Any, dict[str, Any]]], roles: Collection[str],
                  seed: int, tag: str = "") -> Replayed:
    """Replay the steps of `dataset`'s episodes through `runner` (a collector's ``run(jobs)``: in process or on Ray
    rollout workers), score the replays with `score`, and give every action of `roles` its counterfactual advantage."""
    t0 = time.perf_counter()
    batch = plan_replays(dataset, scenarios, budget, seed=seed, tag=tag)
    replayed = runner.run(batch.jobs) if batch.jobs else TrajectoryDataset()
    replay_rewards = score(replayed, {k: v.to_dict() for k, v in scenarios.items()})[1] if len(replayed) else {}
    plans = {j.episode_id: j.replay for j in batch.jobs}
    credit = counterfactual_credit(dataset, episode_returns(action_rewards), replayed, episode_returns(replay_rewards),
                                   plans, agents=roles)
    stats = {"replays": len(batch.jobs), "replay_s": round(time.perf_counter() - t0, 3), "replays_used": credit.used,
             "replays_diverged": credit.diverged, "replays_failed": credit.failed,
             "replays_skipped": dict(batch.skipped), "counterfactual_actions": credit.counterfactual_actions,
             "fallback_actions": credit.fallback_actions}
    if credit.diverged:
        log.warning("%d of %d replays did not hold their upstream (a tool or an external call answered differently); "
                    "their actions use the group baseline", credit.diverged, len(batch.jobs))
    return Replayed(TrajectoryDataset.concat([dataset, replayed]), {**action_rewards, **replay_rewards},
                    credit.advantages, stats)


def scenario_objects(scenarios: Any) -> dict[str, Scenario]:
    """``{scenario id: Scenario}`` from a `ScenarioSet`, a list of `Scenario`s or ``{id: Scenario}`` (plain dicts
    are left out: a replay needs the scenario's input)."""
    if scenarios is None:
        return {}
    values = scenarios.values() if isinstance(scenarios, dict) else scenarios
    return {s.scenario_id: s for s in values if isinstance(s, Scenario)}
