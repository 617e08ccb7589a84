"""Which agent is to blame: how much the team's return moves when one agent's step is resampled or replaced.

For every action of the episodes (run fresh from scenarios, or mined), its step is replayed with the upstream held
(`training.credit`, `serving.replay`) from a reference policy: the agent's own current adapter (resampling), another
adapter version, the base model without adapter, or another endpoint. Per action, the *shift* is the mean return of
its replays minus the episode's own return; per agent, the mean shift over its actions with a bootstrap CI, on all,
failed and successful episodes. The verdict reads the shift over *all* episodes: the agent whose replacement raises
the team's return most is to blame, and the blame is *significant* when that shift's CI lies above 0. The failed
and successful columns say where the change happens, but a failed episode alone is a biased sample: a failure is
partly bad luck, so any agent's replay tends to do better there (regression to the mean; in benchmarks/blame.py
every agent of an unbroken team shows a positive shift on failed episodes). Resampling an agent from itself shows
how much its own randomness matters; a systematically bad agent shows only when it is *replaced* (`reference`),
which is why the reference is a choice.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from marft_lg.evaluation.stats import PairedCI, bootstrap_ci, format_ci
from marft_lg.graph.replays import ReplayBudget, episode_returns, plan_replays, sibling_returns
from marft_lg.trajectories.dataset import TrajectoryDataset
from marft_lg.trajectories.scenarios import Scenario


@dataclass
class AgentBlame:
    """One agent's shifts: mean (replays' return - episode's return) over its replayed actions, with CIs."""

    agent: str
    actions: int
    shift: PairedCI
    shift_failed: PairedCI
    shift_successful: PairedCI

    def to_dict(self) -> dict[str, Any]:
        return {"agent": self.agent, "actions": self.actions, "shift": self.shift.to_dict(),
                "shift_failed": self.shift_failed.to_dict(), "shift_successful": self.shift_successful.to_dict()}


@dataclass
class Attribution:
    """The blame table and what it cost: replays planned, used, diverged, failed, skipped (reason -> count)."""

    agents: list[AgentBlame]
    reference: str | dict[str, str]
    episodes: int
    failed_episodes: int
    replays: int
    used: int
    diverged: int
    failed: int
    skipped: dict[str, int] = field(default_factory=dict)
    success_at: float = 1.0

    @property
    def blamed(self) -> str | None:
        """The agent whose replacement raises the return most over all episodes, when that rise is above zero; None
        when no agent's replacement helps. (Not read on failed episodes alone: see the module docstring.)"""
        best = max(self.agents, key=lambda a: -np.inf if np.isnan(a.shift.mean) else a.shift.mean, default=None)
        return best.agent if best is not None and best.shift.mean > 0 else None

    @property
    def significant(self) -> bool:
        """Whether the blamed agent's shift over all episodes has its CI above zero."""
        by = {a.agent: a for a in self.agents}
        return self.blamed is not None and by[self.blamed].shift.defined and by[self.blamed].shift.low > 0

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "agents"}
        return {**out, "agents": [a.to_dict() for a in self.agents], "blamed": self.blamed,
                "significant": self.significant}


def attribute(runner: Any, dataset: TrajectoryDataset, scenarios: Mapping[str, Scenario], scorer: Any, *,
              budget: ReplayBudget, seed: int = 0, success_at: float = 1.0) -> Attribution:
    """Replay every action of `dataset` (`budget`: replays per action, agents, reference, tools) through `runner`
    (a collector's ``run(jobs)``), score everything with `scorer`, and tabulate the shifts per agent."""
    scen = {k: v.to_dict() for k, v in scenarios.items()}
    returns = episode_returns(scorer.score(dataset, scen).action_rewards)
    batch = plan_replays(dataset, scenarios, budget, seed=seed, tag="-blame")
    replayed = runner.run(batch.jobs) if batch.jobs else TrajectoryDataset()
    replay_returns = episode_returns(scorer.score(replayed, scen).action_rewards) if len(replayed) else {}
    plans = {j.episode_id: j.replay for j in batch.jobs}
    siblings, lost = sibling_returns(replayed, replay_returns, plans)
    agent_of = {(str(e), int(o)): str(a) for e, o, a in zip(dataset.actions["episode_id"], dataset.actions["order"],
                                                         dataset.actions["agent"], strict=True)}
    shifts: dict[str, list[tuple[float, bool]]] = {}
    for (eid, order), got in siblings.items():
        if eid not in returns:
            continue
        shift = float(np.mean([r for _, r in got])) - returns[eid]
        shifts.setdefault(agent_of[(eid, order)], []).append((shift, returns[eid] < success_at))
    agents = []
    for agent in sorted(shifts):
        values = shifts[agent]
        agents.append(AgentBlame(
            agent, len(values), bootstrap_ci([s for s, _ in values], seed=seed),
            bootstrap_ci([s for s, f in values if f], seed=seed),
            bootstrap_ci([s for s, f in values if not f], seed=seed)))
    ref = dict(budget.reference) if isinstance(budget.reference, Mapping) else budget.reference or "self"
    return Attribution(agents=agents, reference=ref, episodes=len(returns),
                       failed_episodes=sum(r < success_at for r in returns.values()), replays=len(batch.jobs),
                       used=sum(len(v) for v in siblings.values()), diverged=lost["diverged"], failed=lost["failed"],
                       skipped=dict(batch.skipped), success_at=success_at)


def _ci(ci: PairedCI) -> str:
    if not ci.n:
        return "-"
    if not ci.defined:
        return f"{ci.mean:+.3f} (n={ci.n})"
    return f"{format_ci(ci.mean, ci.low, ci.high)} (n={ci.n})"


def _reference_text(reference: Any) -> str:
    if isinstance(reference, Mapping):
        pinned = ", ".join(f"{r}: `{v}`" for r, v in reference.items())
        return f"each role's reference version ({pinned}; other roles resampled from themselves)"
    return {"self": "its own current adapter (resampled)", "base": "the base model without adapter",
            "engine": "the reference endpoint"}.get(reference, f"`{reference}`")


def blame_markdown(result: Attribution) -> str:
    """The blame section (Markdown): the table per agent and how to read it."""
    ref = _reference_text(result.reference)
    lines = ["## Which agent is to blame", "",
             f"Each agent's step was replayed with everything before it held as recorded, the step drawn from {ref}. "
             "*Shift*: mean return of the replays minus the episode's own return (95% bootstrap CI over the agent's "
             f"actions). The verdict reads the shift over all episodes. On failed episodes (return < "
             f"{result.success_at:g}) any agent's replay tends to do better, a failure being partly bad luck: compare "
             "agents there, do not read one alone.", "",
             "| agent | actions | shift (all) | shift (failed episodes) | shift (successful episodes) |",
             "|---|---:|---|---|---|"]
    for a in result.agents:
        lines.append(f"| {a.agent} | {a.actions} | {_ci(a.shift)} | {_ci(a.shift_failed)} | {_ci(a.shift_successful)} |")
    lines += ["", f"Most to blame: **{result.blamed or 'no agent (no replacement raised the return)'}**"
              + (" (its CI is above 0). " if result.significant else " (not significant: its CI includes 0). "
                 if result.blamed else ". ")
              + f"{result.episodes} episodes ({result.failed_episodes} failed), {result.replays} replays: "
              f"{result.used} used, {result.diverged} did not hold their upstream, {result.failed} failed"
              + (f", not planned: {result.skipped}" if result.skipped else "") + "."]
    return "\n".join(lines) + "\n"


def plot_blame(result: Attribution, path: Path) -> Path:
    """Bars of each agent's shift on all, failed and successful episodes, with their CIs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(4.0, 1.6 * len(result.agents) + 2), 3.2))
    x = np.arange(len(result.agents))
    for k, (name, attr) in enumerate((("all", "shift"), ("failed", "shift_failed"), ("successful", "shift_successful"))):
        cis = [getattr(a, attr) for a in result.agents]
        means = [0.0 if np.isnan(c.mean) else c.mean for c in cis]
        err = [[max(0.0, m - c.low) if c.defined else 0.0 for m, c in zip(means, cis, strict=True)],
               [max(0.0, c.high - m) if c.defined else 0.0 for m, c in zip(means, cis, strict=True)]]
        ax.bar(x + (k - 1) * 0.27, means, 0.27, yerr=err, capsize=3, label=f"{name} episodes")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks(x, [a.agent for a in result.agents])
    ax.set_ylabel("return shift when replaced")
    ax.set_title("blame: each step replaced by " + (result.reference if isinstance(result.reference, str)
                                                     else "the reference versions"))
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_blame(result: Attribution, out: str | Path) -> dict[str, Path]:
    """`attribution.json`, `attribution.md`, `attribution.html` and `attribution.png` in `out`."""
    import json

    from marft_lg._durable import write_atomic
    from marft_lg.evaluation.report import markdown_to_html

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    md = blame_markdown(result)
    files = {"json": out / "attribution.json", "markdown": out / "attribution.md", "html": out / "attribution.html"}
    write_atomic(files["json"], json.dumps(result.to_dict(), indent=2, default=str))
    write_atomic(files["markdown"], "# Blame report\n\n" + md + "\n![shifts](attribution.png)\n")
    write_atomic(files["html"], markdown_to_html(md, title="Blame report"))
    files["plot"] = plot_blame(result, out / "attribution.png")
    return files


def print_blame(result: Attribution, console: Any = None) -> None:
    """The blame table in the terminal."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"blame: each agent's step replaced by {_reference_text(result.reference)}")
    for col in ("agent", "actions", "shift (all)", "failed episodes", "successful episodes"):
        table.add_column(col)
    for a in result.agents:
        table.add_row(a.agent, str(a.actions), _ci(a.shift), _ci(a.shift_failed), _ci(a.shift_successful))
    console.print(table)
    verdict = "" if result.blamed is None else " (CI above 0)" if result.significant else " (not significant)"
    console.print(f"most to blame: {result.blamed or 'no agent'}{verdict} ({result.replays} replays, {result.used} used, "
                  f"{result.diverged} diverged, {result.failed} failed)", markup=False, highlight=False)
