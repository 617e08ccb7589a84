"""Shadow comparison: the same scenarios (or the same mirrored live inputs) through two teams.

`shadow_compare` replays every scenario through the baseline and the candidate version maps of
one wrapped graph, with the same seed for each paired run, mines the traces both sides wrote and
compares them (`comparison.compare_datasets`). `compare_mirrored` does the same for the live/shadow
pairs that `wrap(..., shadow=..., sample_rate=...)` recorded.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from marft_lg.evaluation.comparison import ComparisonResult, compare_datasets
from marft_lg.graph.collect import EpisodeFailure, EpisodeJob, GraphCollector, check_failures, check_served
from marft_lg.graph.routing import derive_seed  # a paired replay's seed: (run seed, scenario id, sample)
from marft_lg.rewards.base import Scorer
from marft_lg.serving.types import ChatEngine, ServedTeam
from marft_lg.trajectories.dataset import EPISODE_COLUMNS, TrajectoryDataset
from marft_lg.trajectories.scenarios import Scenario, ScenarioSet

logger = logging.getLogger("marft_lg.evaluation")

VersionSpec = str | Mapping[str, str]
FRESH = "init"  # the version name of a freshly initialised adapter (marft_lg.serving.team.FRESH)
SIDE_KEY = "marft.compare.side"  # the episode metadata key naming a compared episode's side (baseline / candidate)


def resolve_versions(spec: VersionSpec, registry: Any, roles: Iterable[str] | None = None) -> dict[str, str]:
    """An alias name or a ``{role: ref}`` map -> concrete ``{role: "v<k>"}`` through the registry."""
    if isinstance(spec, str):
        if registry is None:
            raise ValueError(f"version alias {spec!r} needs an adapter registry; pass a {{role: version}} map instead")
        mapping = registry.alias(spec)
        if not mapping:
            raise ValueError(f"alias {spec!r} is not set in registry {registry.root}; "
                             f"known aliases: {sorted(registry.aliases()) or '(none)'}")
        return {r: v for r, v in mapping.items() if roles is None or r in set(roles)}
    out = {}
    for role, ref in spec.items():
        out[role] = ref if registry is None or ref == FRESH else registry.resolve(role, ref)
    return out


def _team_of(app: Any) -> ChatEngine | None:
    """The team an app's episodes run on (a `WrappedGraph`'s), or None (an app that serves itself, a test double)."""
    team = getattr(app, "team", None)
    return team if isinstance(team, ChatEngine) else None


def _versions_on(team: ChatEngine | None, spec: VersionSpec) -> dict[str, str]:
    """`resolve_versions` of `spec` through the team's registry (a served team's), for the team's roles."""
    registry = team.registry if isinstance(team, ServedTeam) else None
    return resolve_versions(spec, registry, team.agents() if team is not None else None)


def agent_bases(team: ChatEngine | None, datasets: Iterable[TrajectoryDataset]) -> dict[str, Any]:
    """``{"agent_bases": {role: base model}, "frozen_agents": [...]}`` for a comparison's meta: the base each
    served role runs on, and the agents that acted in the episodes without being served by the team (frozen:
    an external API, any chat model marft_lg does not train)."""
    roles = list(team.agents()) if team is not None else []
    bases = {r: team.base_of(r) for r in roles} if isinstance(team, ServedTeam) else {}
    acted = {str(a) for ds in datasets for a in ds.actions["agent"].dropna().unique()} if roles else set()
    return {"agent_bases": bases, "frozen_agents": sorted(acted - set(roles))}


def with_missing_as_errors(dataset: TrajectoryDataset, expected: Mapping[str, str]) -> TrajectoryDataset:
    """Add an ``error`` episode without actions for every expected episode id (-> scenario id) that
    left no trajectory (it crashed before its first LLM call), so a crash counts against its side."""
    missing = [e for e in expected if e not in set(dataset.episodes["episode_id"])]
    if not missing:
        return dataset
    now = pd.Timestamp.now(tz="UTC")
    rows = pd.DataFrame([{"episode_id": e, "scenario_id": expected[e], "start_time": now, "end_time": now,
                          "n_actions": 0, "agents": [], "status": "error", "outcome": None, "feedback": {},
                          "metadata": {"marft.compare.missing": True}} for e in missing], columns=list(EPISODE_COLUMNS))
    episodes = rows if dataset.episodes.empty else pd.concat([dataset.episodes, rows], ignore_index=True)
    return TrajectoryDataset(episodes=episodes, actions=dataset.actions)


def _progress(enabled: bool):
    from contextlib import nullcontext

    if not enabled:
        return nullcontext(None)
    from rich.progress import Progress

    return Progress(transient=True)


def shadow_compare(
    app: Any,
    baseline: VersionSpec,
    candidate: VersionSpec,
    scenarios: ScenarioSet | Iterable[Scenario],
    reward: Scorer,
    samples_per_scenario: int = 1,
    seed: int = 0,
    *,
    formats: Mapping[str, str] | None = None,
    drift: bool = True,
    drift_prompts: int = 8,
    collect: Callable[[list[str]], TrajectoryDataset] | None = None,
    confidence: float = 0.95,
    n_resamples: int = 2000,
    run_id: str | None = None,
    progress: bool = True,
    concurrency: int = 8,
    runner: Any = None,
) -> ComparisonResult:
    """Replay every scenario `samples_per_scenario` times through both version maps and compare.

    `runner` (an object with `run(jobs) -> TrajectoryDataset`, such as `distributed.RayCollector`) runs the replays
    instead of `app`, e.g. on Ray rollout workers; `app` then only resolves versions (and measures drift).

    `app` is a `WrappedGraph` (its `invoke(..., episode_id=, scenario_id=, seed=, versions=)` pins
    adapter versions per call); `baseline`/`candidate` are alias names (``"live"``) or
    ``{role: ref}`` maps. Paired runs share a seed. `collect(episode_ids)` overrides how the
    episodes are read back (default: the app's own records, `WrappedGraph.capture`; else its trace directory). Up to `concurrency` runs go at
    once so the serving engine batches them.
    """
    if samples_per_scenario < 1:
        raise ValueError(f"samples_per_scenario must be >= 1; got {samples_per_scenario}")
    scenario_list = list(scenarios)
    if not scenario_list:
        raise ValueError("no scenarios to compare on; give a scenario file with at least one scenario")
    from marft_lg.rewards.requirements import uncomputable

    problems = uncomputable(reward, scenarios=scenario_list, fresh=True,
                            resumes=None if runner is not None else getattr(app, "resume", None) is not None)
    if problems:
        raise ValueError("the reward can never be computed on the comparison's new episodes: " + "; ".join(problems))
    team = _team_of(app)
    bind = getattr(reward, "bind_default_engine", None)
    if callable(bind) and team is not None:  # a judge given no endpoint asks the served base model (adapters off)
        bind(team)
    roles = team.agents() if team is not None else None
    base_map = _versions_on(team, baseline)
    cand_map = {**base_map, **_versions_on(team, candidate)}
    run_id = run_id or f"cmp-{time.strftime('%Y%m%d%H%M%S')}-{uuid.uuid4().hex[:6]}"

    jobs, side_of = _plan_replays(scenario_list, samples_per_scenario, seed, run_id, base_map, cand_map)
    replayed, failed = _replay(app, jobs, runner, collect, concurrency, progress)
    failures = {"baseline": 0, "candidate": 0}
    for f in failed:
        failures[side_of[f.episode_id]] += 1
        logger.warning("shadow compare: %s run %s failed: %s", side_of[f.episode_id], f.episode_id, f.error)
    check_failures(len(jobs), failed, "shadow compare")
    expected = {side: {j.episode_id: j.scenario.scenario_id for j in jobs if side_of[j.episode_id] == side}
                for side in ("baseline", "candidate")}
    if roles:  # every action of a served role came from the version its side pins (or the app missed the team)
        current = dict(team.versions())
        check_served(replayed, {j.episode_id: {r: (j.versions or {}).get(r, current.get(r)) for r in roles}
                                for j in jobs}, roles, "shadow compare")
    datasets = {side: with_missing_as_errors(replayed.select(list(expected[side])), expected[side])
                for side in ("baseline", "candidate")}
    by_id = {s.scenario_id: s.to_dict() for s in scenario_list}
    meta = {"run_id": run_id, "baseline": base_map, "candidate": cand_map, "seed": seed,
            "samples_per_scenario": samples_per_scenario, "scenarios": len(scenario_list),
            "baseline_spec": baseline if isinstance(baseline, str) else dict(baseline),
            "candidate_spec": candidate if isinstance(candidate, str) else dict(candidate),
            "invoke_failures": failures, "mode": "replay", **agent_bases(team, datasets.values())}
    result = compare_datasets(datasets["baseline"], datasets["candidate"], reward, scenarios=by_id,
                              formats=formats, confidence=confidence, n_resamples=n_resamples, seed=seed, meta=meta)
    result.datasets = datasets
    if drift and isinstance(team, ServedTeam):
        from marft_lg.evaluation.drift import policy_drift

        try:
            result.drift = policy_drift(team, base_map, cand_map, datasets["baseline"], max_prompts=drift_prompts)
        except RuntimeError as exc:
            logger.warning("shadow compare: policy drift not computed: %s", exc)
    return result


def _plan_replays(scenarios: list[Scenario], samples: int, seed: int, run_id: str, base_map: dict[str, str],
                  cand_map: dict[str, str]) -> tuple[list[EpisodeJob], dict[str, str]]:
    """The paired jobs (same seed for both sides of a scenario's sample) and each episode's side."""
    jobs, side_of = [], {}
    for scen in scenarios:
        for j in range(samples):
            s = derive_seed(seed, scen.scenario_id, j)
            for side, versions in (("baseline", base_map), ("candidate", cand_map)):
                eid = f"{run_id}-{side}-{scen.scenario_id}-{j}"
                meta = {"marft.compare.run": run_id, SIDE_KEY: side, "marft.compare.sample": j}
                jobs.append(EpisodeJob(scen, eid, s, dict(versions), meta))
                side_of[eid] = side
    return jobs, side_of


def _replay(app: Any, jobs: list[EpisodeJob], runner: Any, collect: Callable[[list[str]], TrajectoryDataset] | None,
            concurrency: int, progress: bool) -> tuple[TrajectoryDataset, list[EpisodeFailure]]:
    """Run the jobs through `runner` (Ray rollout workers) or the app's own episode runner, concurrently so the
    engine batches them (each run's seed is its own: results do not depend on which runs share a batch)."""
    if runner is None:
        runner = GraphCollector(app, concurrency=concurrency, read_back=collect)
    with _progress(progress) as bar:
        if bar is not None and isinstance(runner, GraphCollector):
            task = bar.add_task("shadow compare: replaying scenarios", total=len(jobs))
            runner.progress = lambda: bar.advance(task)
        replayed = runner.run(jobs)
    if isinstance(runner, GraphCollector):  # an episode left paused at an interrupt has no outcome to compare
        replayed = runner.without_paused(replayed, len(jobs), "shadow compare")
    if collect is not None and not isinstance(runner, GraphCollector):
        replayed = collect([j.episode_id for j in jobs])
    return replayed, list(runner.failures)


class BaselineOnce:
    """A `shadow_compare` runner that runs the baseline side once: the replays run through the app (`GraphCollector`,
    as the trainer runs episodes), and a later call whose baseline jobs are the same (ids and pinned versions) reuses
    the first one's baseline episodes and runs only the candidate side. `run_ahead` runs the baseline side before
    there is a candidate (the demo measures it before training, so the candidate side's time is known)."""

    def __init__(self, app: Any, concurrency: int):
        self.collector = GraphCollector(app, concurrency=concurrency)
        self.app = app
        self.baseline: TrajectoryDataset | None = None
        self.baseline_jobs: dict[str, dict[str, str]] = {}
        self.baseline_failures: list[EpisodeFailure] = []
        self.failures: list[EpisodeFailure] = []
        """The episodes of the last call that raised (`EpisodeFailure`), the reused baseline's included: what
        `shadow_compare` reads from a runner, as from `GraphCollector`."""

    def run_ahead(self, baseline: VersionSpec, scenarios: ScenarioSet | Iterable[Scenario], *,
                  samples_per_scenario: int = 1, seed: int = 0, run_id: str) -> TrajectoryDataset:
        """The baseline side of a later ``shadow_compare(app, baseline, ..., scenarios, samples_per_scenario=,
        seed=, run_id=, runner=self)``, run now: the same episode ids, seeds and pinned versions."""
        base_map = _versions_on(_team_of(self.app), baseline)
        jobs, side_of = _plan_replays(list(scenarios), samples_per_scenario, seed, run_id, base_map, base_map)
        return self.run([j for j in jobs if side_of[j.episode_id] == "baseline"])

    def run(self, jobs: list[EpisodeJob]) -> TrajectoryDataset:
        base = {j.episode_id: dict(j.versions or {}) for j in jobs if (j.metadata or {}).get(SIDE_KEY) == "baseline"}
        reuse = self.baseline is not None and base == self.baseline_jobs
        todo = [j for j in jobs if not (reuse and j.episode_id in base)]
        ds = self.collector.run(todo) if todo else TrajectoryDataset()
        ran = list(self.collector.failures) if todo else []
        if not reuse:
            self.baseline, self.baseline_jobs = ds.select(sorted(base)), base
            self.baseline_failures = [f for f in ran if f.episode_id in base]
            self.failures = ran
            return ds
        self.failures = self.baseline_failures + ran
        return TrajectoryDataset.concat([self.baseline, ds])


# ---- mirrored live traffic ------------------------------------------------------------------

_PAIR_KEYS = ("marft.mirror.pair_id", "mirror_pair_id", "pair_id")
_SIDE_KEYS = ("marft.mirror.side", "mirror_side", "side")


def mirror_pairs(trace_paths: Any) -> dict[str, tuple[str, str]]:
    """episode id -> (pair id, side) for every episode root tagged as half of a mirrored pair."""
    from marft_lg.tracing import attributes as A
    from marft_lg.trajectories.otlp import iter_raw_spans
    from marft_lg.trajectories.quarantine import Quarantine

    out: dict[str, tuple[str, str]] = {}
    with Quarantine(None) as q:
        for raw in iter_raw_spans(trace_paths, q):
            pair = raw.attributes.get(A.MARFT_MIRROR_PAIR_ID)
            eid = raw.attributes.get(A.MARFT_EPISODE_ID)
            if pair and eid:
                out[str(eid)] = (str(pair), str(raw.attributes.get(A.MARFT_MIRROR_SIDE) or "live"))
    return out


def split_mirrored(dataset: TrajectoryDataset, pairs: Mapping[str, tuple[str, str]] | None = None
                   ) -> tuple[TrajectoryDataset, TrajectoryDataset, dict[str, str], dict[str, str]]:
    """(live, shadow, live units, shadow units): the mirrored episodes of `dataset` by side, each
    mapped to its pair id. Pair tags come from `pairs` or from the episodes' metadata."""
    tags = dict(pairs or {})
    for eid, meta in zip(dataset.episodes["episode_id"], dataset.episodes["metadata"], strict=True):
        if eid in tags or not isinstance(meta, Mapping):
            continue
        pair = next((meta[k] for k in _PAIR_KEYS if meta.get(k)), None)
        if pair:
            tags[eid] = (str(pair), str(next((meta[k] for k in _SIDE_KEYS if meta.get(k)), "live")))
    units = {"live": {}, "shadow": {}}
    for eid, (pair, side) in tags.items():
        units["shadow" if side == "shadow" else "live"][eid] = pair
    live = with_missing_as_errors(dataset.select(list(units["live"])), units["live"])
    shadow = with_missing_as_errors(dataset.select(list(units["shadow"])), units["shadow"])
    return live, shadow, units["live"], units["shadow"]


def compare_mirrored(
    trace_dir: str | Path,
    reward: Scorer,
    *,
    scenarios: ScenarioSet | None = None,
    formats: Mapping[str, str] | None = None,
    since: Any = None,
    confidence: float = 0.95,
    n_resamples: int = 2000,
    seed: int = 0,
) -> ComparisonResult:
    """Compare the live and shadow halves of every mirrored pair found under `trace_dir`
    (baseline = what users got, candidate = the shadow team)."""
    from marft_lg.trajectories.mining import mine

    dataset = mine(trace_dir, since=since, keep_shadows=True)  # the mirrors are what it compares
    live, shadow, live_units, shadow_units = split_mirrored(dataset, mirror_pairs(trace_dir))
    if not live_units and not shadow_units:
        raise ValueError(f"no mirrored pairs in {trace_dir}: spans carry no 'marft.mirror.pair_id'; record them with "
                         f"wrap(graph, team=..., shadow=CANDIDATE, sample_rate=P)")
    versions: dict[str, dict[str, set[str]]] = {"live": {}, "shadow": {}}
    for side, ds in (("live", live), ("shadow", shadow)):
        for agent, version in zip(ds.actions["agent"], ds.actions["adapter_version"], strict=True):
            versions[side].setdefault(agent, set()).add(str(version))
    meta = {"mode": "mirrored", "trace_dir": str(trace_dir),
            "baseline": {a: sorted(v) for a, v in versions["live"].items()},
            "candidate": {a: sorted(v) for a, v in versions["shadow"].items()},
            "pairs_tagged": len(set(live_units.values()) | set(shadow_units.values()))}
    by_id = scenarios.by_id() if scenarios is not None else None
    return compare_datasets(live, shadow, reward, scenarios=by_id, baseline_units=live_units,
                            candidate_units=shadow_units, formats=formats, confidence=confidence,
                            n_resamples=n_resamples, seed=seed, meta=meta)
