"""Compare two sets of episodes unit by unit: paired CIs for team reward, components and agent metrics.

A *unit* is what both sides ran on: a scenario (offline replay, averaged over its samples) or a
mirrored live/shadow pair. Both sides are scored by the same reward; each unit gives one paired
difference per quantity, and the CIs come from a bootstrap over units.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from marft_lg._durable import write_atomic
from marft_lg.evaluation.agent_metrics import AGENT_METRICS, EPISODE_METRICS, agent_metrics, episode_metrics
from marft_lg.evaluation.stats import DetectableEffect, PairedCI, bootstrap_ci, detectable_effect
from marft_lg.rewards.base import Scorer
from marft_lg.trajectories.dataset import TrajectoryDataset

_NON_COMPONENT_COLUMNS = frozenset({"episode_id", "reward", "scored", "error", "vetoed", "scenario_id"})


@dataclass
class SideScores:
    """One side's episodes, scored: per-episode reward/components/metrics and per-agent metrics."""

    episodes: pd.DataFrame  # episode_id, unit, reward, <components>, <EPISODE_METRICS>
    agents: pd.DataFrame  # episode_id, unit, agent, <AGENT_METRICS>
    components: list[str]
    reward_errors: int
    weights: dict[str, float] = field(default_factory=dict)  # the reward's weight per component, when it says
    unscored_reasons: list[str] = field(default_factory=list)
    """``episode: why`` of the first episodes the reward could not score (a gate with too few pairs says why)."""


@dataclass
class ComparisonResult:
    """Everything the gate, the report and the terminal summary read."""

    team: PairedCI
    components: dict[str, PairedCI]
    agents: dict[str, dict[str, PairedCI]]
    episode_metrics: dict[str, PairedCI]
    units: pd.DataFrame  # one row per paired unit: unit, baseline_reward, candidate_reward, ...
    baseline: SideScores
    candidate: SideScores
    unmatched: dict[str, list[str]] = field(default_factory=dict)  # side -> unit ids present on one side only
    drift: dict[str, dict[str, float]] = field(default_factory=dict)  # role -> {"kl", "n_tokens", "n_prompts"}
    # +1 when a rise of the component raises the reward, -1 for costs (negative weight, e.g. step_count)
    component_signs: dict[str, int] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    datasets: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    """The compared episodes, ``{"baseline": TrajectoryDataset, "candidate": ...}`` (in memory only: `save`
    writes the scores, not the trajectories)."""

    @property
    def n_pairs(self) -> int:
        return self.team.n

    def side_mean(self, side: str, column: str) -> float:
        frame = (self.baseline if side == "baseline" else self.candidate).episodes
        return float(frame[column].mean()) if column in frame and len(frame) else math.nan

    def team_detectable_effect(self, *, alpha: float = 0.05, power: float = 0.8) -> DetectableEffect:
        """The smallest team-reward gain these pairs could detect (from the per-unit differences `team` bootstraps),
        so a CI that spans 0 can be read as "no gain" or "too few pairs to tell"."""
        deltas = self.units.get("delta_reward", [])
        return detectable_effect(deltas, alpha=alpha, power=power)

    def cost_ratio(self, metric: str = "tokens") -> float:
        """Candidate mean cost over baseline mean cost (NaN when the baseline cost is 0)."""
        b, c = self.side_mean("baseline", metric), self.side_mean("candidate", metric)
        return c / b if b and not math.isnan(b) else math.nan

    def to_dict(self) -> dict[str, Any]:
        return {
            "meta": self.meta,
            "n_pairs": self.n_pairs,
            "team_reward": self.team.to_dict(),
            "team_reward_mde": self.team_detectable_effect().to_dict(),
            "baseline_reward_mean": self.side_mean("baseline", "reward"),
            "candidate_reward_mean": self.side_mean("candidate", "reward"),
            "components": {k: v.to_dict() for k, v in self.components.items()},
            "component_signs": self.component_signs,
            "agents": {a: {m: ci.to_dict() for m, ci in ms.items()} for a, ms in self.agents.items()},
            "episode_metrics": {k: v.to_dict() for k, v in self.episode_metrics.items()},
            "cost_ratio_tokens": _none_if_nan(self.cost_ratio("tokens")),
            "unmatched": self.unmatched,
            "drift": self.drift,
            "reward_errors": {"baseline": self.baseline.reward_errors, "candidate": self.candidate.reward_errors},
        }

    def save(self, run_dir: str | Path) -> Path:
        """Write `comparison.json`, and the per-episode tables as CSV, into `run_dir`."""
        out = Path(run_dir)
        out.mkdir(parents=True, exist_ok=True)
        path = write_atomic(out / "comparison.json", json.dumps(self.to_dict(), indent=2, default=_json_default))
        write_atomic(out / "units.csv", self.units.to_csv(index=False))
        for side in ("baseline", "candidate"):
            scores: SideScores = getattr(self, side)
            write_atomic(out / f"{side}_episodes.csv", scores.episodes.to_csv(index=False))
            write_atomic(out / f"{side}_agents.csv", scores.agents.to_csv(index=False))
        return path


def _none_if_nan(v: float) -> float | None:
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else v


def _json_default(o: Any) -> Any:
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, float) and math.isnan(o):
        return None
    return str(o)


def _reward_table(result: Any) -> tuple[pd.DataFrame, list[str], dict[str, Any] | None]:
    episodes = getattr(result, "episodes", result)
    if not isinstance(episodes, pd.DataFrame) or "episode_id" not in episodes or "reward" not in episodes:
        raise TypeError("reward.score(...) must return a RewardResult whose .episodes DataFrame has "
                        "'episode_id' and 'reward' columns (see marft_lg.rewards.composite)")
    declared = getattr(result, "components", None)
    if isinstance(declared, Mapping):
        declared = list(declared)
    components = [c for c in (declared or episodes.columns) if c in episodes.columns and c not in _NON_COMPONENT_COLUMNS]
    return episodes, components, getattr(result, "action_rewards", None)


def score_side(
    dataset: TrajectoryDataset,
    reward: Scorer,
    *,
    units: Mapping[str, str] | None = None,
    scenarios: Mapping[str, Mapping[str, Any]] | None = None,
    formats: Mapping[str, str] | None = None,
    agents: list[str] | None = None,
    prepared: bool = False,
) -> SideScores:
    """Score one side: reward + components per episode, episode metrics and per-agent metrics.

    `units` maps episode id -> unit id (default: the episode's scenario id). An episode the reward
    could not score keeps NaN reward/components (it is left out of the paired means, and counted).
    `prepared`: the reward's group step already ran over both sides (`judge_pairs`).
    """
    result = reward.score(dataset, scenarios, prepared=True) if prepared else reward.score(dataset, scenarios)
    table, components, action_rewards = _reward_table(result)
    weights = {k: float(v) for k, v in (getattr(result, "weights", None) or {}).items()}
    table = table.copy()
    if "scored" in table:
        unscored = ~table["scored"].fillna(False).astype(bool)
        table.loc[unscored, ["reward", *components]] = math.nan
        errors = int(unscored.sum())
        why = table["error"] if "error" in table else pd.Series([None] * len(table), index=table.index)
        reasons = [f"{e}: {w or 'not scored'}" for e, w in zip(table["episode_id"][unscored], why[unscored],
                                                                strict=True)][:3]
    else:
        errors = int(table["reward"].isna().sum())
        reasons = []
    if units is None:
        units = dict(zip(dataset.episodes["episode_id"], dataset.episodes["scenario_id"], strict=True))
    eps = episode_metrics(dataset).merge(table[["episode_id", "reward", *components]], on="episode_id", how="left")
    eps.insert(1, "unit", [units.get(e) for e in eps["episode_id"]])
    per_agent = agent_metrics(dataset, scenarios=scenarios, formats=formats, action_rewards=action_rewards, agents=agents)
    per_agent.insert(1, "unit", [units.get(e) for e in per_agent["episode_id"]])
    return SideScores(episodes=eps, agents=per_agent, components=components, reward_errors=errors, weights=weights,
                      unscored_reasons=reasons)


def _unit_means(frame: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    return frame.dropna(subset=["unit"]).groupby("unit", sort=True)[columns].mean()


def _paired(b: pd.DataFrame, c: pd.DataFrame, column: str, units: list[str], **ci: Any) -> PairedCI:
    bv = b[column].reindex(units).to_numpy(dtype=float) if column in b else np.full(len(units), math.nan)
    cv = c[column].reindex(units).to_numpy(dtype=float) if column in c else np.full(len(units), math.nan)
    return bootstrap_ci(cv - bv, **ci)


def compare_scores(
    baseline: SideScores,
    candidate: SideScores,
    *,
    confidence: float = 0.95,
    n_resamples: int = 2000,
    seed: int = 0,
    meta: Mapping[str, Any] | None = None,
) -> ComparisonResult:
    """Pair two scored sides by unit and bootstrap every difference (candidate - baseline)."""
    ci = {"confidence": confidence, "n_resamples": n_resamples, "seed": seed}
    components = [c for c in baseline.components if c in candidate.components]
    weights = {**baseline.weights, **candidate.weights}
    signs = {c: -1 if weights.get(c, 1.0) < 0 else 1 for c in components}
    cols = ["reward", *components, *EPISODE_METRICS]
    b_units, c_units = _unit_means(baseline.episodes, cols), _unit_means(candidate.episodes, cols)
    shared = sorted(set(b_units.index) & set(c_units.index), key=str)
    unmatched = {"baseline": sorted(map(str, set(b_units.index) - set(shared))),
                 "candidate": sorted(map(str, set(c_units.index) - set(shared)))}

    team = _paired(b_units, c_units, "reward", shared, **ci)
    comp = {name: _paired(b_units, c_units, name, shared, **ci) for name in components}
    epi = {name: _paired(b_units, c_units, name, shared, **ci) for name in EPISODE_METRICS}

    agents: dict[str, dict[str, PairedCI]] = {}
    all_agents = sorted(set(baseline.agents["agent"]) | set(candidate.agents["agent"]))
    for agent in all_agents:
        ba = _unit_means(baseline.agents[baseline.agents["agent"] == agent], list(AGENT_METRICS))
        ca = _unit_means(candidate.agents[candidate.agents["agent"] == agent], list(AGENT_METRICS))
        agents[agent] = {m: _paired(ba, ca, m, shared, **ci) for m in AGENT_METRICS}

    units = pd.DataFrame({"unit": shared})
    for name in ["reward", *components, "steps", "tokens"]:
        units[f"baseline_{name}"] = b_units[name].reindex(shared).to_numpy(dtype=float)
        units[f"candidate_{name}"] = c_units[name].reindex(shared).to_numpy(dtype=float)
        units[f"delta_{name}"] = units[f"candidate_{name}"] - units[f"baseline_{name}"]
    return ComparisonResult(team=team, components=comp, agents=agents, episode_metrics=epi, units=units,
                            component_signs=signs,
                            baseline=baseline, candidate=candidate, unmatched=unmatched, meta=dict(meta or {}))


def judge_pairs(reward: Scorer, baseline: TrajectoryDataset, candidate: TrajectoryDataset, *,
                scenarios: Mapping[str, Mapping[str, Any]] | None = None,
                baseline_units: Mapping[str, str] | None = None,
                candidate_units: Mapping[str, str] | None = None) -> bool:
    """Run a grouped reward's group step (a relative judge) over both sides at once, one group per paired unit: the
    judge sees the live and the candidate episodes of the same input side by side (in a shuffled order, both orders
    with `judge_twice`). Returns whether it ran (False: the reward judges episode by episode)."""
    if not getattr(reward, "grouped", False) or not callable(getattr(reward, "prepare", None)):
        return False
    unit_of: dict[str, Any] = {}
    for data, units in ((baseline, baseline_units), (candidate, candidate_units)):
        ids = data.episodes["episode_id"]
        unit_of.update(units if units is not None else dict(zip(ids, data.episodes["scenario_id"], strict=True)))
    episodes = [*baseline.iter_episodes(scenarios), *candidate.iter_episodes(scenarios)]
    def unit(ep: Any) -> Any:
        u = unit_of.get(ep.episode_id)
        return ep.episode_id if u is None or (isinstance(u, float) and math.isnan(u)) else u

    reward.prepare(episodes, key=unit)
    return True


def compare_datasets(
    baseline: TrajectoryDataset,
    candidate: TrajectoryDataset,
    reward: Scorer,
    *,
    scenarios: Mapping[str, Mapping[str, Any]] | None = None,
    baseline_units: Mapping[str, str] | None = None,
    candidate_units: Mapping[str, str] | None = None,
    formats: Mapping[str, str] | None = None,
    confidence: float = 0.95,
    n_resamples: int = 2000,
    seed: int = 0,
    meta: Mapping[str, Any] | None = None,
) -> ComparisonResult:
    """Score both datasets with the same reward and compare them unit by unit (see module doc). A reward that judges
    groups (`group_judge`) judges each unit's baseline and candidate episodes together (`judge_pairs`)."""
    roles = sorted(set(baseline.actions["agent"].dropna()) | set(candidate.actions["agent"].dropna()))
    joint = judge_pairs(reward, baseline, candidate, scenarios=scenarios, baseline_units=baseline_units,
                        candidate_units=candidate_units)
    b = score_side(baseline, reward, units=baseline_units, scenarios=scenarios, formats=formats, agents=roles,
                   prepared=joint)
    c = score_side(candidate, reward, units=candidate_units, scenarios=scenarios, formats=formats, agents=roles,
                   prepared=joint)
    return compare_scores(b, c, confidence=confidence, n_resamples=n_resamples, seed=seed, meta=meta)
