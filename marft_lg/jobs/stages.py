"""The real pipeline stages: `mine` over the job's trace sources, the MARFT trainer starting from the live
adapters, `shadow_compare` + `PromotionGate`, and the registry's atomic `live` flip.

Heavy libraries (torch, the Team) are imported and built lazily, once per run, on first use.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from marft_lg.jobs.config import RetrainJob
from marft_lg.jobs.pipeline import Comparison, RunContext
from marft_lg.loading import load_object
from marft_lg.tracing.files import trace_files
from marft_lg.trajectories.dataset import TrajectoryDataset


class LibraryStages:
    """The stages wired to marft_lg's mining, training, evaluation and registry.

    Training runs on its own `Team` (the trainer changes adapter weights in place, in memory); the
    trained roles are saved as new registry versions and that Team is closed. The comparison loads a
    fresh Team from the registry, so the baseline really is the stored live weights.
    """

    def __init__(self, job: RetrainJob):
        from marft_lg.serving.registry.store import AdapterRegistry

        self.job = job
        self.registry = AdapterRegistry(job.registry)
        self._reward = None
        self._scenarios = None
        self._signals: dict[str, Any] | None = None
        self._decision = None
        self._app_factory: Any = None
        if job.app is not None:
            self.app_factory()  # a bad `app` fails here, before mining and training
        self.check_configs()

    def check_configs(self) -> None:
        """Read the trainer and gate configs the job names (files that exist; inline mappings were checked with
        job.yaml), so a bad value stops the run before any work with `ConfigError` naming file:line: key."""
        for key in ("trainer", "gate"):
            value = getattr(self.job, key)
            if isinstance(value, str) and Path(value).is_file():
                getattr(self, f"{key}_config")()

    def trainer_config(self):
        from marft_lg.training.config import MARFTConfig

        if isinstance(self.job.trainer, dict):
            doc = self.job.config_doc.at("trainer") if self.job.config_doc is not None else None
            return MARFTConfig.from_dict(self.job.trainer, source="job.trainer", doc=doc)
        return MARFTConfig.from_yaml(self.job.trainer)

    def gate_config(self):
        from marft_lg.evaluation.gate import PromotionGate

        if isinstance(self.job.gate, dict):
            doc = self.job.config_doc.at("gate") if self.job.config_doc is not None else None
            return PromotionGate.from_dict(self.job.gate, source="job.gate", doc=doc)
        return PromotionGate.from_yaml(self.job.gate)

    # --- helpers ------------------------------------------------------------------------------
    def roles(self) -> list[str]:
        return list(self.job.agents) or sorted(self.registry.alias("live"))

    def app_spec(self) -> Any:
        """The job's team and app (`AppSpec`): `app` relative to job.yaml, its `chat_model` and `node_roles`."""
        from marft_lg.graph.app_spec import AppSpec

        return AppSpec(app=self.job.app, model=self.job.model, agents=self.roles(), registry=str(self.registry.root),
                       seed=self.job.seed, node_roles=self.job.node_roles, chat_model=dict(self.job.chat_model),
                       recursion_limit=self.job.recursion_limit, resume=self.job.resume,
                       base_dir=None if self.job.base_dir is None else str(self.job.base_dir),
                       source=self.job.where("app"), what="app")

    def new_team(self, versions: dict[str, str]):
        return self.app_spec().build_team(registry=self.registry, versions=dict(versions))

    def reward(self):
        if self._reward is None:
            from marft_lg.rewards.composite import CompositeReward
            from marft_lg.rewards.registry import relative_to

            # an inline reward mapping loads its custom components relative to job.yaml; a reward file, to itself
            with relative_to(self.job.base_dir):
                self._reward = CompositeReward.from_yaml(self.job.reward)
        return self._reward

    def app_factory(self) -> Any:
        """The job's `app` setting loaded (`module:function` or `file.py:function`, relative to job.yaml)."""
        if self.job.app is None:
            raise ValueError(f"job {self.job.name!r} needs `app: module:function` for shadow compare / online training")
        if self._app_factory is None:
            self._app_factory = load_object(self.job.app, base_dir=self.job.base_dir, what="app",
                                            source=self.job.config_path)
            self.app_spec().check_app()
        return self._app_factory

    def app(self, ctx: RunContext, team: Any, name: str):
        """The job's LangGraph app on `team` (`AppSpec.build_app`: an ``f(llm)`` factory gets a `TeamChatModel`
        with `chat_model`; an app on its own ChatOpenAI models runs as it is), traced into the run folder."""
        return self.app_spec().build_app(team, ctx.run_dir / name)

    @contextmanager
    def _wrapped(self, ctx: RunContext, team: Any, name: str, needed: bool = True) -> Iterator[Any]:
        """`app` for the length of a stage (closed after: its trace files flushed, its loopback server stopped)."""
        if not needed:
            yield None
            return
        app = self.app(ctx, team, name)
        try:
            yield app
        finally:
            app.close()

    @contextmanager
    def runner(self, ctx: RunContext, team: Any, name: str) -> Iterator[Any]:
        """Ray rollout workers for this stage when the job has a `ray:` section (None otherwise): they build the
        job's app and engine themselves and serve the versions `team` serves (the registry is shared)."""
        if self.job.ray is None:
            yield None
            return
        from marft_lg.distributed.rollout import RayCollector
        from marft_lg.distributed.worker import WorkerSpec

        spec = WorkerSpec.of(self.app_spec(), versions=team.versions(), trace_dir=str(ctx.run_dir / name))
        with RayCollector(self.job.ray, spec, versions=team.versions, run_id=f"{ctx.run_id}-{name}") as collector:
            yield collector

    def scenarios(self, split: str | None):
        """The job's scenarios (a file, or the users' inputs mined from `from_traces` once per stage object)."""
        from marft_lg.trajectories.scenario_sets import load_scenarios

        if self._scenarios is None:
            self._scenarios = load_scenarios(self.job.scenarios, max_line_bytes=int(self.job.max_line_mb * 2**20))
        return self._scenarios.split(split) if split else self._scenarios

    def has_scenarios(self) -> bool:
        """Whether the job's scenario source exists (a missing file: offline training scores without scenarios)."""
        spec = self.job.scenarios
        return Path(spec["from_traces"] if isinstance(spec, dict) else spec).exists()

    # --- stages -------------------------------------------------------------------------------
    def live_versions(self, ctx: RunContext) -> dict[str, str]:
        """The versions serving now: `live`, and for a role with no live version yet (nothing promoted) its
        initial adapter, as `marft-lg compare` does; the run's log says so."""
        from marft_lg.serving.team import FRESH

        live = self.registry.alias("live")
        roles = self.roles()
        if not roles:
            raise ValueError(f"job {self.job.name!r}: no agent roles; list them under `agents:` (registry "
                             f"{self.registry.root} has no live versions to take them from)")
        missing = [r for r in roles if r not in live]
        if missing:
            ctx.log(f"  registry {self.registry.root} has no live version for {missing} (nothing promoted yet): "
                    f"starting them from their initial adapters ({FRESH})")
        return {r: live.get(r, FRESH) for r in roles}

    def mine(self, ctx: RunContext, since: datetime | None) -> TrajectoryDataset:
        from marft_lg.trajectories.mining import mine_with_report

        try:
            files = trace_files(self.job.traces)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"{exc} (job setting `traces`)") from None
        ctx.log(f"  {len(files)} trace file(s)")
        if not files:
            return TrajectoryDataset()
        dataset, report = mine_with_report(files, since=since, quarantine=ctx.run_dir / "quarantine.jsonl",
                                           max_line_bytes=int(self.job.max_line_mb * 2**20),
                                           server_records_only=self.job.server_records_only)
        for note in (report.long_lines_note("max_line_mb in the job file"), *report.notes()):
            if note:
                ctx.log(f"  warning: {note}")
        return dataset

    def train(self, ctx: RunContext, dataset: TrajectoryDataset, baseline: dict[str, str]) -> dict[str, str]:
        from marft_lg.rewards.requirements import signal_counts
        from marft_lg.serving.team import FRESH
        from marft_lg.tracking.lineage import record_published
        from marft_lg.training.trainer import MARFTTrainer

        cfg = self.trainer_config()
        scenarios = self.scenarios(None) if self.has_scenarios() else None
        if isinstance(self.job.scenarios, dict):  # users' inputs: a question's episodes form one group
            from marft_lg.trajectories.scenario_sets import label_with_inputs

            dataset, _ = label_with_inputs(dataset, self.job.scenarios["input_keys"])
        team = self.new_team(baseline)
        reward = self.reward()
        reward.bind_default_engine(team)  # a judge given no endpoint asks this team's base model
        self._signals = signal_counts(reward, reward.score(dataset, scenarios).episodes)
        ctx.log(f"[{ctx.run_id}] reward signals on the mined episodes: " + ", ".join(
            f"{name} scored {c['scored']} of {c['episodes']}" for name, c in self._signals.items()))
        tracker = ctx.tracker.child("train", ctx.run_dir / "train", cfg.to_dict())
        status = "FAILED"
        try:
            trainer = MARFTTrainer(team, self.reward(), cfg, ctx.run_dir / "train", run_id=ctx.run_id, tracker=tracker)
            with self._wrapped(ctx, team, "replay_traces", cfg.credit == "counterfactual") as replay_app:
                rows = trainer.fit_offline(dataset, scenarios, replay_app=replay_app)
            if self.job.online_iterations:
                with self.runner(ctx, team, "online_traces") as runner, self._wrapped(ctx, team, "online_traces",
                                                                                      runner is None) as app:
                    rows += trainer.fit_online(runner or app, self.scenarios("train"),
                                               iterations=self.job.online_iterations)
            trained = {role for row in rows for role in row.get("updated_agents", [])}  # an optimizer step taken
            candidate = dict(baseline)  # a role no update reached keeps its version; a fresh one is published as is
            for role in sorted(trained | {r for r, v in baseline.items() if v == FRESH}):
                current = team.adapter_name(role).split("@", 1)[1]
                if current == baseline[role]:  # trained in memory (or initial weights): not in the registry yet
                    current = team.save_version(role, parent=None if current == FRESH else current,
                                                run_id=ctx.run_id)
                    record_published(tracker, self.registry, role, current, iteration=trainer.iteration)
                candidate[role] = current
            status = "FINISHED"
        finally:
            tracker.finish(status)
            team.close()
        if not trained:
            raise RuntimeError("training updated no adapter (no agent had actions in the mined episodes?); "
                               "nothing to compare")
        return candidate

    def compare(self, ctx: RunContext, baseline: dict[str, str], candidate: dict[str, str]) -> Comparison:
        from marft_lg.evaluation.report import log_comparison, write_report
        from marft_lg.evaluation.shadow import shadow_compare

        gate = self.gate_config()
        team = self.new_team(baseline)
        try:
            with self.runner(ctx, team, "shadow_traces") as runner, self._wrapped(ctx, team, "shadow_traces") as app:
                result = shadow_compare(app, baseline, candidate,
                                        self.scenarios(self.job.compare_split), self.reward(),
                                        samples_per_scenario=self.job.samples_per_scenario, seed=self.job.seed,
                                        run_id=f"{ctx.run_id}-cmp", runner=runner)
        finally:
            team.close()
        decision = gate.evaluate(result, context={"retrain_run": ctx.run_id})
        out = ctx.run_dir / "compare"
        result.save(out)
        decision.write(out)
        report = write_report(result, out, decision)
        tracker = ctx.tracker.child("compare", out, {"baseline": baseline, "candidate": candidate})
        log_comparison(tracker, result, decision, out)
        tracker.finish()
        self._decision = decision
        team_ci = result.team
        metrics = {"n_pairs": result.n_pairs, "team_reward_delta": team_ci.mean, "team_reward_ci": [team_ci.low, team_ci.high],
                   "baseline_reward_mean": result.side_mean("baseline", "reward"),
                   "candidate_reward_mean": result.side_mean("candidate", "reward"),
                   "cost_ratio_tokens": result.cost_ratio("tokens")}
        if self._signals is not None:
            metrics["signals"] = self._signals
        return Comparison(passed=decision.promote, reasons=list(decision.reasons), metrics=metrics,
                          report_path=str(report["markdown"]))

    def promote(self, ctx: RunContext, candidate: dict[str, str], reason: str) -> dict[str, str]:
        from marft_lg.evaluation.promotion import promote

        record = promote(self.registry, candidate, reason=reason, decision=self._decision,
                         server_url=self.job.server_url, run_dir=ctx.run_dir)
        return {r: v for r, v in record.after.items() if r in candidate}
