"""The real pipeline stages: `mine` over the job's trace sources, the MARFT trainer starting from the live
adapters, `shadow_compare` + `PromotionGate`, and the registry's atomic `live` flip.

Heavy libraries (torch, the Team) are imported and built lazily, once per run, on first use.
"""

from __future__ import annotations

import glob
import importlib
from datetime import datetime
from pathlib import Path
from typing import Any

from marft_lg.jobs.config import RetrainJob
from marft_lg.jobs.pipeline import Comparison, RunContext
from marft_lg.trajectories.dataset import TrajectoryDataset


def trace_files(sources: list[str]) -> list[Path]:
    """Expand files, folders (their `*.jsonl`) and glob patterns; missing sources raise with their name."""
    out: list[Path] = []
    for src in sources:
        p = Path(src)
        if p.is_dir():
            out.extend(sorted(p.glob("*.jsonl")))
        elif p.is_file():
            out.append(p)
        else:
            matched = sorted(Path(m) for m in glob.glob(src))
            if not matched and not glob.has_magic(src):
                raise FileNotFoundError(f"trace source {src} does not exist (job setting `traces`)")
            out.extend(matched)
    return out


def load_object(spec: str, what: str) -> Any:
    """`module:attr` -> the attribute."""
    module_name, _, attr = spec.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load {what} {spec!r}: {exc}") from exc


class LibraryStages:
    """The stages wired to marft_lg's mining, training, evaluation and registry."""

    def __init__(self, job: RetrainJob):
        from marft_lg.serving.registry import AdapterRegistry

        self.job = job
        self.registry = AdapterRegistry(job.registry)
        self._team = None
        self._reward = None

    # --- helpers ------------------------------------------------------------------------------
    def roles(self) -> list[str]:
        return list(self.job.agents) or sorted(self.registry.alias("live"))

    def team(self, baseline: dict[str, str]):
        if self._team is None:
            from marft_lg.serving.team import Team

            self._team = Team(self.job.model, agents=self.roles(), registry=self.registry, versions=dict(baseline),
                              seed=self.job.seed)
        return self._team

    def reward(self):
        if self._reward is None:
            from marft_lg.rewards.composite import CompositeReward

            self._reward = CompositeReward.from_yaml(self.job.reward)
        return self._reward

    def app(self, ctx: RunContext, team: Any, name: str):
        """The job's LangGraph app on `team`, traced into the run folder."""
        if self.job.app is None:
            raise ValueError(f"job {self.job.name!r} needs `app: module:function` for shadow compare / online training")
        from marft_lg.graph.chat_model import TeamChatModel
        from marft_lg.graph.wrap import wrap

        graph = load_object(self.job.app, "app")(TeamChatModel(team=team))
        return wrap(graph, team=team, trace_dir=str(ctx.run_dir / name))

    def scenarios(self, split: str | None):
        from marft_lg.trajectories.scenarios import ScenarioSet

        scenarios = ScenarioSet.load(self.job.scenarios)
        return scenarios.split(split) if split else scenarios

    # --- stages -------------------------------------------------------------------------------
    def live_versions(self, ctx: RunContext) -> dict[str, str]:
        live = self.registry.alias("live")
        roles = self.roles()
        missing = [r for r in roles if r not in live]
        if missing:
            raise ValueError(
                f"registry {self.registry.root} has no live version for {missing}; "
                "promote a first version with `marft-lg promote` before scheduling retraining"
            )
        return {r: live[r] for r in roles}

    def mine(self, ctx: RunContext, since: datetime | None) -> TrajectoryDataset:
        from marft_lg.trajectories.mining import mine

        files = trace_files(self.job.traces)
        ctx.log(f"  {len(files)} trace file(s)")
        if not files:
            return TrajectoryDataset()
        return mine(files, since=since, quarantine=ctx.run_dir / "quarantine.jsonl")

    def train(self, ctx: RunContext, dataset: TrajectoryDataset, baseline: dict[str, str]) -> dict[str, str]:
        from marft_lg.training.config import MARFTConfig
        from marft_lg.training.trainer import MARFTTrainer

        team = self.team(baseline)
        trainer = MARFTTrainer(team, self.reward(), MARFTConfig.from_yaml(self.job.trainer), ctx.run_dir / "train")
        before = {r: set(self.registry.versions(r)) for r in self.roles()}
        trainer.fit_offline(dataset)
        if self.job.online_iterations:
            trainer.fit_online(self.app(ctx, team, "online_traces"), self.scenarios("train"),
                               iterations=self.job.online_iterations)
        return self._new_versions(trainer, before, baseline)

    def _new_versions(self, trainer: Any, before: dict[str, set[str]], baseline: dict[str, str]) -> dict[str, str]:
        """The candidate map: the versions the trainer saved for this run (a role it did not update keeps live)."""
        saver = getattr(trainer, "save_to_registry", None)
        if callable(saver):
            saved = saver(self.registry)
            if isinstance(saved, dict):
                return {**baseline, **saved}
        candidate = dict(baseline)
        for role, old in before.items():
            new = [v for v in self.registry.versions(role) if v not in old]
            if new:
                candidate[role] = new[-1]
        if candidate == baseline:
            raise RuntimeError("the trainer saved no new adapter version; nothing to compare")
        return candidate

    def compare(self, ctx: RunContext, baseline: dict[str, str], candidate: dict[str, str]) -> Comparison:
        from marft_lg.evaluation.gate import PromotionGate
        from marft_lg.evaluation.shadow import shadow_compare

        team = self.team(baseline)
        result = shadow_compare(self.app(ctx, team, "shadow_traces"), baseline, candidate,
                                self.scenarios(self.job.compare_split), self.reward(),
                                samples_per_scenario=self.job.samples_per_scenario, seed=self.job.seed)
        decision = PromotionGate.from_yaml(self.job.gate).decide(result)
        report_path = None
        writer = getattr(result, "write_report", None)
        if callable(writer):
            report_path = str(writer(ctx.run_dir / "report"))
        summary = getattr(result, "summary", None)
        metrics = summary() if callable(summary) else {}
        return Comparison(passed=bool(decision.passed), reasons=list(getattr(decision, "reasons", [])),
                          metrics=dict(metrics), report_path=report_path)

    def promote(self, ctx: RunContext, candidate: dict[str, str], reason: str) -> dict[str, str]:
        self.registry.promote(candidate, reason=reason)
        return {r: v for r, v in self.registry.alias("live").items() if r in candidate}

    def close(self) -> None:
        if self._team is not None:
            self._team.close()
            self._team = None
