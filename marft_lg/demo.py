"""`marft-lg demo`: the main job, end to end on the embedded 135M model.

serve the math team (reasoner -> actor, one LoRA each on one base model) -> run the untuned team on
a few training problems with tracing -> mine the traces -> offline MARFT from them -> on-policy MARFT
through the live graph on a stream of fresh problems (new ones every iteration, so the team cannot
memorise them) -> shadow-compare untuned vs tuned on held-out problems -> promote if the gate passes
-> write a report (Markdown + PNG plots) into the run directory.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import typer

from marft_lg._durable import write_atomic

if TYPE_CHECKING:
    from marft_lg.trajectories.scenarios import ScenarioSet


@dataclass(frozen=True)
class DemoBudget:
    """How much work each stage does and the wall time it has. `minutes` is the run's deadline, counted from when the
    team is served (a first run converts the model before): the on-policy stage gets what the other stages leave of
    it, the comparison stage predicted from its untuned side's measured time (`DemoRun.online_budget`), and at
    most `online_minutes`.

    The training problems are `n_traced` (run untuned and traced: the offline stage's data) followed
    by `n_stream` fresh ones for on-policy MARFT, `scenarios_per_iteration` new ones per iteration.
    """

    name: str
    minutes: float
    n_traced: int  # training problems the untuned team runs on, traced (the offline data)
    n_heldout: int  # held-out problems for the comparison
    traces_per_problem: int  # untuned episodes per traced problem
    offline_passes: int
    online_iterations: int
    online_minutes: float  # online MARFT stops at whichever comes first (of these and the deadline)
    scenarios_per_iteration: int  # fresh problems per on-policy iteration (none seen before)
    group_size: int  # K episodes per scenario per online iteration (group-relative baseline)
    max_tokens: int
    deadline: bool = True  # False: on-policy gets `online_minutes` whatever the rest takes (equal-training-time runs)

    @property
    def n_stream(self) -> int:
        """On-policy problems: enough for every iteration to get new ones, so none repeats."""
        return self.online_iterations * self.scenarios_per_iteration

    @property
    def n_train(self) -> int:
        """The whole training split: the traced problems, then the on-policy stream."""
        return self.n_traced + self.n_stream

    def to_dict(self) -> dict[str, Any]:
        """The fields plus the derived split sizes (what summary.json and the log record)."""
        return {**asdict(self), "n_stream": self.n_stream, "n_train": self.n_train}


# With a fixed 8 on-policy minutes the full budget took 16.1-18.4 min on 2 quiet cores (b4b9d1a), over its 15;
# with the deadline, 13.9-15.05 (demo.json at 51e968e and before: 4-7 on-policy iterations of 16 episodes,
# 18-79 s of rollouts + 39-63 s of update each).
BUDGETS: dict[str, DemoBudget] = {
    "full": DemoBudget("full", 15, n_traced=16, n_heldout=128, traces_per_problem=2, offline_passes=1,
                       online_iterations=40, online_minutes=12.0, scenarios_per_iteration=4, group_size=4,
                       max_tokens=32),
    "quick": DemoBudget("quick", 3, n_traced=4, n_heldout=8, traces_per_problem=2, offline_passes=1,
                        online_iterations=2, online_minutes=0.5, scenarios_per_iteration=2, group_size=2,
                        max_tokens=32),
    # CI's end-to-end test: every stage runs, on as little work as still exercises it.
    "smoke": DemoBudget("smoke", 2, n_traced=2, n_heldout=5, traces_per_problem=2, offline_passes=1,
                        online_iterations=1, online_minutes=0.2, scenarios_per_iteration=1, group_size=2,
                        max_tokens=16),
}

# MARFT settings the demo adds over the math team's. Dynamic sampling: all-equal groups leave the update (6% of the
# trained actions at a zero advantage against 24% without, learn.json); its held-out gain was ahead on seeds 0-2 on
# 2026-11-28 and level within noise when re-run at one commit on 2026-11-29 (demo.json against learn.json's baseline).
# Reward-to-go credit: each action's return counts only the rewards from it on (the math team places each component
# on the action that earned it), so the actor is not paid for the reasoner's set-up; over group on seeds 0 / 1,
# +0.324 / +0.195 against +0.188 / +0.109, the answer's own gain +0.172 / +0.094 against +0.047 / +0.016
# (learn_credit.json at bdbaf5f).
DEMO_SETTINGS: dict[str, Any] = {"dynamic_sampling": True, "credit": "reward_to_go"}


def marft_settings(credit: dict[str, Any] | None = None) -> dict[str, Any]:
    """The demo trainer's MARFT settings: the math team's, then `DEMO_SETTINGS`, then the caller's `credit`."""
    from marft_lg.examples.math_team.settings import MARFT_SETTINGS

    return {**MARFT_SETTINGS, **DEMO_SETTINGS, **(credit or {})}


_REPORT_RESERVE_S = 15.0
"""Seconds the deadline keeps for the gate, the report and its plots (under 2 s measured; the rest is margin)."""
_TUNED_SIDE_FACTOR = 1.2
"""The comparison stage's time predicted from its untuned side's: measured 0.92x-1.42x of it (5 full runs, d3d4123 to
51e968e, the same answer lengths on both sides; the stage also measures drift and runs the statistics)."""

DEMO_GATE = {
    "min_team_reward_gain": 0.0,
    "require_ci_lower_above_zero": True,
    "min_pairs": 5,
    "component_tolerance": {"*": 0.05},
    "max_cost_ratio": 1.5,
}


class DemoProblems(NamedTuple):
    """The demo's problems: `traced` (offline data), `stream` (on-policy, in order), `heldout` (comparison)."""

    all: ScenarioSet
    traced: ScenarioSet
    stream: ScenarioSet
    heldout: ScenarioSet


def demo_problems(budget: DemoBudget, seed: int) -> DemoProblems:
    """Split `make_problems(budget.n_train, budget.n_heldout, seed)`: the first `n_traced` training problems
    are traced, the rest are the on-policy stream, one batch per iteration, never repeated (fit_online takes
    the next `scenarios_per_iteration` of the list each iteration), and none of them was traced."""
    from marft_lg.examples.math_team.problems import make_problems
    from marft_lg.trajectories.scenarios import ScenarioSet

    problems = make_problems(budget.n_train, budget.n_heldout, seed)
    train = list(problems.split("train"))
    return DemoProblems(problems, ScenarioSet(train[:budget.n_traced]), ScenarioSet(train[budget.n_traced:]),
                        problems.split("heldout"))


def _examples() -> Any:
    """The math team (app, problems, reward, settings): it ships inside the package, so the demo runs anywhere."""
    import marft_lg.examples.math_team as math_team
    from marft_lg.examples.math_team import graph, problems, reward, settings

    math_team.graph, math_team.problems, math_team.reward, math_team.settings = graph, problems, reward, settings
    return math_team


class _Log:
    """Prints stage headers with rich and keeps a JSON log of every number the report shows."""

    def __init__(self, run_dir: Path, console: Any):
        self.path = run_dir / "demo_log.jsonl"
        self.console = console
        self.t0 = time.perf_counter()

    def stage(self, title: str) -> None:
        self.console.rule(f"[bold]{title}[/bold]  [dim]{(time.perf_counter() - self.t0) / 60:.1f} min[/dim]")

    def record(self, event: str, **data: Any) -> None:
        row = {"event": event, "elapsed_s": round(time.perf_counter() - self.t0, 2), **data}
        with self.path.open("a") as f:
            f.write(json.dumps(row, default=str) + "\n")


def run_demo(budget: DemoBudget, run_dir: Path, *, model: str, seed: int = 0, trace_root: Path = Path("traces"),
             console: Any = None, node_roles: dict[str, str] | str | None = None,
             report_to: list[str] | None = None, credit: dict[str, Any] | None = None,
             warm_start: dict[str, Any] | None = None, lora: dict[str, Any] | None = None,
             rollout_temperature: float | None = None, curve_every: int = 0) -> dict[str, Any]:
    """Run every stage of the main job; returns the summary written to `run_dir/summary.json`.

    `node_roles` (``{node: role}`` or ``"node=role,..."``) maps the math team's graph nodes to agent roles for
    both wrapped apps (default: each node is the role of its name, ``reasoner`` and ``actor``); `report_to`: trackers;
    `credit`: MARFT settings over the math team's and the demo's `DEMO_SETTINGS` (``{"credit": "counterfactual",
    "replays_per_action": 1}``, ``{"dynamic_sampling": False}``); `warm_start`: `WarmStartConfig` keys: the traced episodes' best teach each agent
    before offline MARFT (None: no warm start); `lora`: `LoraSettings` keys of the agents' fresh adapters (None: the
    defaults); `rollout_temperature`: the on-policy sampler's (None: the math team's ``ROLLOUT_TEMPERATURE``);
    `curve_every` > 0: after the report, the held-out gain at every `curve_every`-th on-policy iteration
    (`marft_lg.demo_curve`), into the report; its minutes are not the demo's.
    """
    run = DemoRun(budget, run_dir, model=model, seed=seed, trace_root=trace_root, console=console,
                  node_roles=node_roles, report_to=report_to, credit=credit, warm_start=warm_start, lora=lora,
                  rollout_temperature=rollout_temperature)
    try:
        for stage in (run.serve, run.trace, run.mine, run.train_offline, run.run_untuned_heldout, run.train_online,
                      run.compare, run.gate):
            stage()
        summary = run.report()
    finally:
        run.close()
    if curve_every:
        summary = _add_curve(run_dir, curve_every, run.console, summary)
    return summary


def _add_curve(run_dir: Path, every: int, console: Any, summary: dict[str, Any]) -> dict[str, Any]:
    """`add_curve` at the end of a demo; the summary with the curve, or as it was when the run has no on-policy
    iteration to replay (said, not fatal: the demo itself finished)."""
    from marft_lg.demo_curve import summary_curve

    console.rule("[bold]held-out gain over training time[/bold]")
    try:
        curve = add_curve(run_dir, every, console=console)
    except ValueError as exc:
        console.print(f"no curve: {exc}", markup=False, highlight=False)
        return summary
    return {**summary, "curve": summary_curve(curve)}


def add_curve(run_dir: Path, every: int = 2, *, rerun_baseline: bool = False, console: Any = None) -> dict[str, Any]:
    """A finished run's held-out gain at every `every`-th on-policy iteration (`demo_curve.write_curve`), rendered
    into its report; returns the curve. ValueError when the run is unfinished or has no on-policy iteration."""
    from marft_lg.demo_curve import write_curve

    curve, summary = write_curve(run_dir, every, rerun_baseline=rerun_baseline, console=console)
    render_report(run_dir, summary)
    if console is not None:
        first = curve["minutes_to_significant_gain"]
        console.print(("no checkpoint's 95% CI lies above 0" if first is None
                       else f"first significant held-out gain after {first:.2f} on-policy minutes")
                      + f" ({len(curve['checkpoints'])} checkpoints, {curve['eval_minutes']} min of replays); "
                      f"report {run_dir / 'report.md'}, plot {run_dir / 'curve.png'}", markup=False, highlight=False,
                      soft_wrap=True)
    return curve


def _lora_settings(lora: dict[str, Any] | None) -> Any:
    """`LoraSettings` from the demo's `lora` keys (None: the team's defaults); ``target_modules`` may join module
    names with ``+`` (``q_proj+v_proj``). An unknown key or a bad value is a ValueError naming it, before any model
    loads."""
    if lora is None:
        return None
    from marft_lg.serving.registry.lora import LoraSettings

    lora = dict(lora)
    targets = lora.get("target_modules")
    if isinstance(targets, str) and "+" in targets:
        lora["target_modules"] = [t.strip() for t in targets.split("+") if t.strip()]
    return LoraSettings.from_dict(lora, source="lora")


def _rollout_temperature(value: float | None, default: float) -> float:
    if value is None:
        return float(default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 2:
        raise ValueError(f"rollout_temperature must be in (0, 2], got {value!r}")
    return float(value)


class DemoRun:
    """The main job's stages, in the retraining pipeline's order (serve the live team, trace it, mine, train,
    compare, gate and promote) plus the report; each stage records its numbers in the run's log."""

    def __init__(self, budget: DemoBudget, run_dir: Path, *, model: str, seed: int, trace_root: Path, console: Any,
                 node_roles: dict[str, str] | str | None, report_to: list[str] | None = None,
                 credit: dict[str, Any] | None = None, warm_start: dict[str, Any] | None = None,
                 lora: dict[str, Any] | None = None, rollout_temperature: float | None = None):
        import torch
        from rich.console import Console

        from marft_lg.loading import parse_node_roles

        self.console = console or Console()
        self.math_team = _examples()
        roles = list(self.math_team.graph.ROLES)
        try:
            self.node_roles = parse_node_roles(node_roles, key="node_roles", roles=roles) or {r: r for r in roles}
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--node-roles") from None
        self.budget, self.run_dir, self.model, self.seed, self.roles = budget, run_dir, model, seed, roles
        self.report_to, self.trainer = list(report_to or []), None
        self.credit = dict(credit or {})
        self.warm_start = None if warm_start is None else dict(warm_start)
        self.lora = _lora_settings(lora)
        self.rollout_temperature = _rollout_temperature(rollout_temperature, self.math_team.settings.ROLLOUT_TEMPERATURE)
        self.trace_dir = trace_root / f"demo-{run_dir.name}"
        if self.trace_dir.exists() and any(self.trace_dir.iterdir()):  # mining it would mix an earlier run in
            raise typer.BadParameter(f"{self.trace_dir} already holds the traces of an earlier run named "
                                     f"{run_dir.name!r}; remove it or choose another run directory",
                                     param_hint="--run-dir")
        run_dir.mkdir(parents=True, exist_ok=True)
        self.log = _Log(run_dir, self.console)
        from marft_lg._provenance import code_state, machine

        self.code = {**code_state(), "machine": machine()}  # what ran: a results file built from this run cites it
        self.log.record("start", budget=budget.to_dict(), model=model, seed=seed, node_roles=self.node_roles,
                        code=self.code, credit=self.credit, warm_start=self.warm_start,
                        lora=None if self.lora is None else asdict(self.lora),
                        rollout_temperature=self.rollout_temperature)
        torch.manual_seed(seed)
        self.problems = demo_problems(budget, seed)
        self.reward = self.math_team.reward.math_reward()
        self.team: Any = None
        self.apps: list[Any] = []
        self.served_at: float | None = None  # when the team was up: the budget's deadline counts from here
        self.online_plan: dict[str, float] = {}
        self.untuned_heldout_s = 0.0

    def _app(self, temperature: float, trace_dir: Path) -> Any:
        """The math team's app (`math_team.graph.app_spec`) on the team, at `temperature`, traced into `trace_dir`."""
        spec = self.math_team.graph.app_spec(self.budget.max_tokens, temperature, self.node_roles)
        app = spec.build_app(self.team, trace_dir)
        self.apps.append(app)
        return app

    def serve(self) -> None:
        """1: the team on one base model, its untuned adapters saved and promoted as `live`."""
        from marft_lg.serving.team_factory import TeamSpec

        self.log.stage(f"1/9 serve the math team on {self.model}")
        self.problems.all.save(self.run_dir / "scenarios.jsonl")
        self.team = TeamSpec(model=self.model, agents=self.roles, registry=str(self.run_dir / "registry"),
                             versions=None, seed=self.seed, lora=self.lora).build_team()
        self.untuned = {r: self.team.save_version(r, run_id="untuned") for r in self.roles}
        self.team.registry.promote(self.untuned, reason="demo: the untuned team is live")
        for r, v in self.untuned.items():
            self.team.load_version(r, v)
        self.served_at = time.perf_counter()
        self.log.record("served", roles=self.roles, live=self.untuned)
        self.console.print(f"team {self.roles} on one base model; live = {self.untuned}")
        self.sampling = self._app(self.rollout_temperature, self.trace_dir)

    def trace(self) -> None:
        """2: the untuned team on the traced training problems, every episode traced."""
        traced = self.problems.traced
        self.log.stage(f"2/9 run the untuned team on {len(traced)} training problems (traced to {self.trace_dir})")
        jobs = [(s, k) for k in range(self.budget.traces_per_problem) for s in traced]
        self.n_traced = _run_episodes(self.sampling, jobs, seed=self.seed, console=self.console,
                                      concurrency=min(len(jobs), 32))
        self.log.record("traced", episodes=self.n_traced, trace_dir=str(self.trace_dir))

    def mine(self) -> None:
        """3: the traces as multi-agent trajectories, scored."""
        from marft_lg.trajectories.mining import mine

        self.log.stage("3/9 mine the traces into multi-agent trajectories")
        self.dataset = mine([self.trace_dir], quarantine=self.run_dir / "quarantine.jsonl")
        self.dataset.to_parquet(self.run_dir / "trajectories")
        self.per_agent = self.dataset.actions["agent"].value_counts().to_dict()
        scored = self.reward.score(self.dataset, self.problems.traced)
        self.untuned_reward = float(scored.episodes["reward"].mean())
        self.log.record("mined", episodes=len(self.dataset), actions_per_agent=self.per_agent,
                        untuned_train_reward=self.untuned_reward)
        self.console.print(f"{len(self.dataset)} episodes, actions per agent {self.per_agent}; untuned train reward "
                           f"{self.untuned_reward:.3f}")

    def train_offline(self) -> None:
        """4: MARFT from the traces, the behaviour log-probs as the engine recorded them."""
        from marft_lg.training.config import MARFTConfig
        from marft_lg.training.trainer import MARFTTrainer

        self.log.stage("4/9 offline MARFT from the traces")
        b = self.budget
        cfg = MARFTConfig(**marft_settings(self.credit), group_size=b.group_size,
                          max_new_tokens=b.max_tokens, max_context=1024, seed=self.seed,
                          offline_passes=b.offline_passes, offline_episodes_per_iteration=max(8, self.n_traced // 2),
                          checkpoint_every=1000, rollout_concurrency=b.scenarios_per_iteration * b.group_size,
                          report_to=self.report_to)
        self.trainer = MARFTTrainer(self.team, self.reward, cfg, self.run_dir / "train", run_id="demo")
        if self.warm_start is not None:
            self._warm_start()
        replays = {"replay_app": self.sampling} if cfg.credit == "counterfactual" else {}  # the traced episodes again
        rows = self.trainer.fit_offline(self.dataset, self.problems.traced, **replays)
        # the trainer changed the served adapters in place, under the untuned version's name: published now, the
        # comparison's untuned side (next) is served `live`'s own weights from the registry, not the trained ones
        published = self.trainer.publish()
        self.log.record("offline", iterations=len(rows), reward_mean=[r["reward_mean"] for r in rows],
                        published=published)

    def _warm_start(self) -> None:
        """The traced episodes' best teach each agent first (`training.warm_start`); nothing kept is logged, not
        fatal (the untuned team may solve no problem better than its other tries)."""
        from marft_lg.training.checks import TrainingDataError
        from marft_lg.training.warm_start import WarmStartConfig

        try:
            row = self.trainer.fit_warm_start(self.dataset, self.problems.traced, WarmStartConfig(**self.warm_start))
        except TrainingDataError as exc:
            self.log.record("warm_start", kept_episodes=0, why=str(exc))
            self.console.print(f"warm start skipped: {exc}", markup=False, highlight=False)
            return
        self.log.record("warm_start", kept_episodes=row["kept_episodes"], selection=row["selection"],
                        agents=row["warm_start_agents"])
        self.console.print(f"warm start: kept {row['kept_episodes']} of {row['episodes']} traced episodes "
                           f"({row['keep']})", markup=False, highlight=False)

    def run_untuned_heldout(self) -> None:
        """5: the comparison's untuned side (greedy, the held-out problems), run now: its time predicts the tuned
        side's, so the on-policy stage can be given what is left of the deadline."""
        from marft_lg.evaluation.shadow import BaselineOnce

        heldout = self.problems.heldout
        self.log.stage(f"5/9 the untuned team on the {len(heldout)} held-out problems (greedy: the comparison's "
                       "untuned side, timed so the on-policy stage knows what the tuned side will take)")
        self.greedy = self._app(0.0, self.trace_dir / "compare")
        self.compare_runner = BaselineOnce(self.greedy, concurrency=min(2 * len(heldout), 48))
        t0 = time.perf_counter()
        ran = self.compare_runner.run_ahead("live", heldout, samples_per_scenario=1, seed=self.seed,
                                            run_id=self.compare_run_id)
        self.untuned_heldout_s = time.perf_counter() - t0
        self.log.record("untuned_heldout", episodes=len(ran), failed=len(self.compare_runner.failures),
                        seconds=round(self.untuned_heldout_s, 2))

    @property
    def compare_run_id(self) -> str:
        return f"demo-{self.run_dir.name}"

    def online_budget(self) -> dict[str, float]:
        """The on-policy stage's seconds and how they were reached: the deadline (`budget.minutes` from when the
        team was served) less the time spent since, the comparison's stage (`_TUNED_SIDE_FACTOR` times what its
        untuned side took) and `_REPORT_RESERVE_S` for the gate and report; at most `online_minutes` (all of it with
        `deadline` off), at least 0 (then one iteration runs: `fit_online` always runs the first)."""
        b = self.budget
        spent = time.perf_counter() - (self.served_at if self.served_at is not None else self.log.t0)
        tuned_side = _TUNED_SIDE_FACTOR * self.untuned_heldout_s
        left = b.minutes * 60 - spent - tuned_side - _REPORT_RESERVE_S if b.deadline else float("inf")
        return {"deadline_s": b.minutes * 60 if b.deadline else None, "spent_s": round(spent, 1),
                "tuned_side_s": round(tuned_side, 1), "reserve_s": _REPORT_RESERVE_S,
                "cap_s": b.online_minutes * 60, "online_s": round(max(0.0, min(b.online_minutes * 60, left)), 1)}

    def train_online(self) -> None:
        """6: on-policy MARFT on a stream of fresh problems, for what the deadline leaves; the tuned versions become
        `candidate`."""
        b = self.budget
        plan = self.online_budget()
        self.log.stage(f"6/9 on-policy MARFT, {b.scenarios_per_iteration} fresh problems per iteration (up to "
                       f"{b.online_iterations} iterations / {plan['online_s'] / 60:.1f} min"
                       + (f": what the {b.minutes:g}-minute budget leaves)" if b.deadline else ")"))
        self.log.record("online_budget", **plan)
        self.online_plan = plan
        if plan["online_s"] <= 0:
            self.console.print(f"the {b.minutes:g}-minute budget leaves no time for on-policy MARFT after "
                               f"{plan['spent_s'] / 60:.1f} min of earlier stages and a comparison stage of about "
                               f"{plan['tuned_side_s'] / 60:.1f} min to come: one iteration runs", markup=False,
                               highlight=False)
        from marft_lg.training.checks import TrainingDataError

        try:
            rows = self.trainer.fit_online(self.sampling, self.problems.stream, b.online_iterations,
                                           scenarios_per_iteration=b.scenarios_per_iteration,
                                           time_budget_s=plan["online_s"])
        except TrainingDataError as exc:  # e.g. dynamic sampling found nothing informative: compare what there is
            self.console.print(f"on-policy MARFT trained nothing: {exc}", markup=False, highlight=False)
            rows = [r for r in self.trainer.metrics.rows() if r.get("phase") == "online"]
        self.online_seen = min(len(rows) * b.scenarios_per_iteration, len(self.problems.stream))
        self.trainer.publish()  # a warm start's or offline update's changes no on-policy iteration published
        self.tuned = self.team.versions()
        self.team.registry.set_alias("candidate", self.tuned, reason="demo: tuned by MARFT")
        self.log.record("online", iterations=len(rows), reward_mean=[r["reward_mean"] for r in rows],
                        problems_seen=self.online_seen, candidate=self.tuned)

    def compare(self) -> None:
        """7: untuned (`live`) vs tuned (`candidate`), greedy, on the held-out problems; the untuned side's episodes
        are stage 5's (the same ids, seeds and versions), so only the tuned side runs now."""
        from marft_lg.evaluation.shadow import shadow_compare

        heldout = self.problems.heldout
        self.log.stage(f"7/9 shadow-compare untuned vs tuned on {len(heldout)} held-out problems (the tuned side)")
        t0 = time.perf_counter()
        self.result = shadow_compare(self.greedy, "live", "candidate", heldout, self.reward, samples_per_scenario=1,
                                     seed=self.seed, run_id=self.compare_run_id, runner=self.compare_runner)
        self.log.record("compare", stage_s=round(time.perf_counter() - t0, 2),
                        predicted_s=self.online_plan.get("tuned_side_s"), **self.result.to_dict())
        self.accuracy = _side_accuracy(self.result, heldout)
        self.log.record("accuracy", **self.accuracy)

    def gate(self) -> None:
        """8: the promotion gate; `live` flips to the tuned team when it passes."""
        from marft_lg.evaluation.gate import PromotionGate
        from marft_lg.evaluation.promotion import promote

        self.log.stage("8/9 promotion gate")
        gate = PromotionGate.from_dict(DEMO_GATE, source="marft_lg.demo.DEMO_GATE")
        self.decision = gate.evaluate(self.result, context={"baseline": self.untuned, "candidate": self.tuned})
        self.decision.write(self.run_dir / "decision.json")
        if self.decision.promote:
            promote(self.team.registry, self.tuned, reason="demo: gate passed", decision=self.decision,
                    run_dir=self.run_dir)
        self.live_now = self.team.registry.alias("live")
        self.log.record("gate", promote=self.decision.promote, reasons=self.decision.reasons, live=self.live_now)

    def report(self) -> dict[str, Any]:
        """9: summary.json, the report (Markdown + HTML + plots) and the closing lines; returns the summary."""
        from marft_lg.evaluation.report import log_comparison, print_summary, write_report

        self.log.stage("9/9 report")
        write_report(self.result, self.run_dir / "compare", self.decision)
        if self.report_to:  # the comparison, a child run of the training run
            log_comparison(self.trainer.tracker.child("compare", self.run_dir / "compare"), self.result,
                           self.decision, self.run_dir / "compare", finish=True)
        summary = self._summary()
        write_atomic(self.run_dir / "summary.json", json.dumps(summary, indent=2, default=str))
        report = render_report(self.run_dir, summary)
        self.log.record("done", report=str(report), minutes=summary["minutes"])
        print_summary(self.result, self.decision, console=self.console)
        for line in _summary_lines(summary):
            self.console.print(line, markup=False, highlight=False)
        ci = self.result.team.to_dict()
        why = (f"the tuned team's held-out reward is higher, paired 95% CI [{_fmt(ci.get('low'))}, "
               f"{_fmt(ci.get('high'))}]" if self.decision.promote
               else (self.decision.reasons[0] if self.decision.reasons else "the gate rejected it"))
        self.console.print(f"\n[bold]decision:[/bold] {'PROMOTE' if self.decision.promote else 'REJECT'}: {why}",
                           soft_wrap=True)
        self.console.print(f"[bold green]report:[/bold green] {report} ({report.with_suffix('.html').name} beside it)",
                           soft_wrap=True)
        return summary

    def _summary(self) -> dict[str, Any]:
        from marft_lg.training.metrics import read_metrics

        train_rows = read_metrics(self.run_dir / "train" / "metrics.jsonl")
        p, result = self.problems, self.result
        return {
            "budget": self.budget.to_dict(), "model": self.model, "seed": self.seed, "run_dir": str(self.run_dir),
            "trace_dir": str(self.trace_dir), "episodes_traced": self.n_traced, "episodes_mined": len(self.dataset),
            "actions_per_agent": self.per_agent, "untuned_train_reward": self.untuned_reward,
            "problems": {"traced": len(p.traced), "stream": len(p.stream), "online_seen": self.online_seen,
                         "heldout": len(p.heldout)},
            "train_iterations": len(train_rows),
            "train_reward_curve": [r.get("reward_mean") for r in train_rows],
            "heldout": {"pairs": result.n_pairs, "baseline_reward": result.side_mean("baseline", "reward"),
                        "candidate_reward": result.side_mean("candidate", "reward"),
                        "difference": result.team.to_dict(), "mde": result.team_detectable_effect().to_dict(),
                        "accuracy": self.accuracy},
            "gate": {"promote": self.decision.promote, "reasons": self.decision.reasons},
            "versions": {"untuned": self.untuned, "tuned": self.tuned, "live": self.live_now},
            "online_budget": self.online_plan, "untuned_heldout_s": round(self.untuned_heldout_s, 2),
            "minutes": round((time.perf_counter() - self.log.t0) / 60, 2), "code": self.code,
        }

    def close(self) -> None:
        if self.report_to and self.trainer is not None:
            self.trainer.close()
        for app in self.apps:
            app.close()
        if self.team is not None:
            self.team.close()


def _run_episodes(app: Any, jobs: list[tuple[Any, int]], *, seed: int, console: Any, concurrency: int = 8) -> int:
    """Run (scenario, repeat) episodes through the one episode runner, concurrently so the engine batches them; a
    failed episode is traced with error status by `wrap`, counted here, and does not stop the demo."""
    from rich.progress import Progress

    from marft_lg.graph.collect import EpisodeJob, GraphCollector

    planned = [EpisodeJob(s, f"untuned-{s.scenario_id}-{k}", seed * 1000 + i) for i, (s, k) in enumerate(jobs)]
    with Progress(console=console) as progress:
        task = progress.add_task("untuned episodes", total=len(planned))
        runner = GraphCollector(app, concurrency=concurrency, read_back=lambda ids: None,
                                progress=lambda: progress.advance(task))
        runner.run(planned)
    app.flush()
    if runner.failures:
        console.print(f"[yellow]{len(runner.failures)} of {len(jobs)} untuned episodes failed (traced with error "
                      "status)[/yellow]")
    return len(jobs)


def _side_accuracy(result: Any, scenarios: ScenarioSet) -> dict[str, dict[str, Any]]:
    """Strict / lenient answer accuracy of each side of the comparison, over the episodes it compared (a run that
    left no trace counts as wrong, as it does in the comparison)."""
    from marft_lg.examples.math_team.accuracy import answer_accuracy

    return {side: answer_accuracy(result.datasets[side], scenarios) for side in ("baseline", "candidate")}


def _fmt(value: Any) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _summary_lines(s: dict[str, Any]) -> list[str]:
    """The demo's closing numbers, each under 80 columns: held-out accuracy before/after, and the observed
    team-reward gain next to the smallest gain this many held-out pairs could detect."""
    acc, d, e = s["heldout"]["accuracy"], s["heldout"]["difference"], s["heldout"]["mde"]
    b, c = acc["baseline"], acc["candidate"]
    return [
        "",
        f"held-out answer accuracy ({b['n']} problems)      untuned    tuned",
        f"  strict  (\\boxed{{N}} = reference)         {_fmt(b['strict']):>7}  {_fmt(c['strict']):>7}",
        f"  lenient (last number = reference)       {_fmt(b['lenient']):>7}  {_fmt(c['lenient']):>7}",
        f"team reward gain {_signed(d.get('mean'))}, 95% CI [{_signed(d.get('low'))}, {_signed(d.get('high'))}]",
        f"smallest gain detectable at n={e['n']} (80% power, 5% two-sided): {_fmt(e['mde'])} "
        f"(SD {_fmt(e['sd'])})",
    ]


def _signed(value: Any) -> str:
    return "n/a" if value is None else f"{value:+.3f}"


def _online_budget_lines(plan: dict[str, Any] | None) -> list[str]:
    """The report's line on what the deadline gave the on-policy stage (none for a run without the plan)."""
    if not plan:
        return []
    why = "what the deadline left" if plan.get("deadline_s") is not None else "no deadline"
    return [f"  - on-policy MARFT given {plan['online_s'] / 60:.1f} min ({why}; at most {plan['cap_s'] / 60:g})"]


def render_report(run_dir: Path, s: dict[str, Any]) -> Path:
    """`report.md` (and `report.html`) at the top of the run from its summary: what ran, the curves, before/after
    with CIs, the held-out curve when measured (`demo_curve`), the decision.

    Lines stay near 80 columns (long facts are split into sub-items) so the Markdown reads in a terminal.
    """
    d, e, acc, p = s["heldout"]["difference"], s["heldout"]["mde"], s["heldout"]["accuracy"], s["problems"]
    b, c, v = acc["baseline"], acc["candidate"], s["versions"]
    lines = [
        "# marft_lg demo run", "",
        f"- budget **{s['budget']['name']}** (about {s['budget']['minutes']:g} min on 2 CPU cores), "
        f"seed {s['seed']}, took {s['minutes']} min",
        *_online_budget_lines(s.get("online_budget")),
        f"- model `{s['model']}`",
        f"- traced {s['episodes_traced']} untuned episodes, mined {s['episodes_mined']}",
        f"  - actions per agent {s['actions_per_agent']}",
        f"  - traces in `{s['trace_dir']}`",
        "- problems, all distinct (no held-out question is a training one):",
        f"  - {p['traced']} traced: the offline stage's data",
        f"  - {p['stream']} fresh for on-policy MARFT, {s['budget']['scenarios_per_iteration']} new per "
        f"iteration ({p['online_seen']} used, none twice)",
        f"  - {p['heldout']} held out for the comparison",
        f"- untuned team reward on the traced problems: {_fmt(s['untuned_train_reward'])}",
        f"- MARFT iterations (offline + on-policy): {s['train_iterations']}",
        "", "## Training", "",
        "| iteration | team reward |", "|---|---|",
        *[f"| {i} | {_fmt(r)} |" for i, r in enumerate(s["train_reward_curve"])], "",
        "![team reward](train/reward.png)", "", "![per-agent KL and entropy](train/agents.png)", "",
        "## Held-out comparison (untuned = baseline, tuned = candidate)", "",
        f"- paired problems: {s['heldout']['pairs']}",
        f"- team reward: baseline {_fmt(s['heldout']['baseline_reward'])}, candidate "
        f"{_fmt(s['heldout']['candidate_reward'])}",
        f"- paired difference {_fmt(d.get('mean'))}, 95% CI [{_fmt(d.get('low'))}, {_fmt(d.get('high'))}]",
        f"- minimum detectable gain at n={e['n']} (80% power, 5% two-sided): {_fmt(e['mde'])}",
        f"  - paired SD {_fmt(e['sd'])}; a smaller true gain would likely be missed",
        "",
        f"| answer accuracy (n={b['n']}) | untuned | tuned |", "|---|---|---|",
        f"| strict: `\\boxed{{N}}` = reference | {_fmt(b['strict'])} | {_fmt(c['strict'])} |",
        f"| lenient: last number = reference | {_fmt(b['lenient'])} | {_fmt(c['lenient'])} |",
        "", "![per-component deltas with CIs](compare/plots/component_deltas.png)", "",
        "![per-agent deltas](compare/plots/agent_deltas.png)", "",
        "Full comparison: [report.md](compare/report.md), [HTML](compare/report.html).", "",
        *_curve_lines(run_dir, s),
        "## Promotion", "",
        f"- gate: **{'promote' if s['gate']['promote'] else 'reject'}**",
        *[f"  - {r}" for r in s["gate"]["reasons"]],
        f"- live versions now: {v['live']}",
        f"  - untuned {v['untuned']}",
        f"  - tuned {v['tuned']}", "",
    ]
    if s["budget"]["name"] != "full":
        lines[2:2] = [f"> Reduced `{s['budget']['name']}` budget: too little training to expect a significant "
                      "gain.", "> Run `marft-lg demo` for the full budget.", ""]
    path = run_dir / "report.md"
    write_atomic(path, "\n".join(lines))
    from marft_lg.evaluation.report import markdown_to_html

    write_atomic(run_dir / "report.html", markdown_to_html("\n".join(lines), title="marft_lg demo run"))
    return path


def _curve_lines(run_dir: Path, s: dict[str, Any]) -> list[str]:
    """The report's section on how the held-out gain grew with on-policy minutes, or how to measure it."""
    head = ["## Held-out gain over training time", ""]
    c = s.get("curve")
    if not c:
        return [*head, "Not measured for this run: `marft-lg demo-curve RUN_DIR` (RUN_DIR: the folder",
                "of this report) replays the team every 2nd on-policy iteration had published",
                "on the held-out problems and adds the curve here.", ""]
    first = c["minutes_to_significant_gain"]
    rows = [f"| {cp['online_iteration']} | {cp['online_minutes']:.2f} | "
            f"{', '.join(f'{r} {v}' for r, v in cp['versions'].items())} | "
            f"{_signed(cp['mean'])} [{_signed(cp['low'])}, {_signed(cp['high'])}] |" for cp in c["checkpoints"]]
    return [*head, "The team published by each checkpoint against the untuned team, on the same",
            "held-out problems (greedy, paired 95% CI); the last row replays the", "comparison above.", "",
            "| on-policy iteration | on-policy minutes | versions | gain, 95% CI |", "|---:|---:|---|---|", *rows, "",
            "- first significant gain: " + ("none of these checkpoints" if first is None
                                             else f"after {first:.2f} on-policy minutes"),
            "", "![held-out gain over training time](curve.png)", ""]


def demo(
    quick: bool = typer.Option(False, "--quick", help="About 3 minutes: smaller, and says so in the report."),
    budget: str = typer.Option("", help="Budget name: full (default, ~15 min), quick (~3 min) or smoke (~2 min, for CI)."),
    run_dir: Path | None = typer.Option(None, help="Run directory (default runs/demo-<timestamp>)."),
    model: str = typer.Option("embedded:smollm2-135m-instruct", help="Model spec: embedded:NAME or a local HF dir."),
    seed: int = typer.Option(0, help="Seed for problems, sampling and training."),
    trace_root: Path = typer.Option(Path("traces"), help="Where the demo's traces go (a sub-directory per run)."),
    node_roles: str | None = typer.Option(None, "--node-roles",
                                          help="node=role,... mapping the math team's nodes to roles (default: same names)."),
    report_to: str | None = typer.Option(None, "--report-to", help="Trackers: tensorboard, mlflow, wandb (offline) or none."),
    warm_start: bool = typer.Option(False, "--warm-start", help="Before offline MARFT, fine-tune each agent on its "
                                    "own actions in the best traced episode of each problem (docs/training.md)."),
    dynamic_sampling: bool = typer.Option(True, "--dynamic-sampling/--no-dynamic-sampling",
                                          help="Groups whose K returns are all equal leave the update and on-policy "
                                          "iterations draw fresh problems instead (on by default; docs/training.md)."),
    curve_every: int = typer.Option(0, "--curve-every", min=0,
                                    help="After the report, replay the team of every N-th on-policy iteration on "
                                    "the held-out problems: the gain against training minutes, in the report "
                                    "(~1.5 min per checkpoint on 2 cores; `marft-lg demo-curve` does it later). "
                                    "0: off."),
) -> None:
    """The main job: serve, trace, mine, train offline then on-policy, compare, promote, report."""
    from rich.console import Console

    console = Console()
    name = budget or ("quick" if quick else "full")
    if name not in BUDGETS:
        raise typer.BadParameter(f"unknown budget {name!r}; choose one of {sorted(BUDGETS)}")
    b = BUDGETS[name]
    if name != "full":
        console.print(f"[yellow]{name} budget: about {b.minutes:g} minutes, too little training to expect a "
                      "significant gain; run without --quick for the full demo[/yellow]")
    out = run_dir or Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")
    from marft_lg.tracking.commands import report_to_option

    run_demo(b, out, model=model, seed=seed, trace_root=trace_root, console=console, node_roles=node_roles,
             report_to=report_to_option(report_to), credit=None if dynamic_sampling else {"dynamic_sampling": False},
             warm_start={} if warm_start else None, curve_every=curve_every)


def demo_curve(
    run_dir: Path = typer.Argument(..., help="A finished `marft-lg demo` run directory."),
    every: int = typer.Option(2, min=1, help="Replay every N-th on-policy iteration's team (and the last)."),
    rerun_baseline: bool = typer.Option(False, "--rerun-baseline",
                                        help="Replay the untuned side at every checkpoint instead of once."),
) -> None:
    """How a finished demo run's held-out gain grew with on-policy minutes: curve.json, curve.png, its report."""
    from rich.console import Console

    try:
        add_curve(run_dir, every, rerun_baseline=rerun_baseline, console=Console())
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="RUN_DIR") from None
