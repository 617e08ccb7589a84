"""How a finished `marft-lg demo` run's held-out gain grew with training time (`marft-lg demo-curve RUN_DIR`,
`marft-lg demo --curve-every N`; the demo renders it into the run's report).

Every on-policy iteration publishes the team it trained (`MARFTTrainer._publish`), so the run's registry holds the
whole path. At every `every`-th on-policy iteration and the last one, the team published by then is shadow-compared
with the untuned team on the run's held-out problems, exactly as the demo's comparison (same app, reward, greedy
decoding and episode seeds): the last checkpoint reproduces the demo's own result. The untuned side is the same
replay at every checkpoint, so it runs once. The x axis is on-policy minutes (rollouts + updates, from
`train/metrics.jsonl`); the first checkpoint whose CI lies above 0 is the run's minutes to a significant gain.

Only `curve.json`, `curve.png` and `summary.json`'s ``curve`` are written here; the registry is read
(its aliases and versions are checked unchanged) and the replays' traces go to a temporary directory.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from marft_lg._durable import write_atomic


# ---- reading the run (pure) ---------------------------------------------------------------------------------------
def online_rows(rows: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The on-policy metrics rows, in iteration order."""
    return sorted((r for r in rows if r.get("phase") == "online"), key=lambda r: int(r["iteration"]))


def online_minutes(rows: Iterable[Mapping[str, Any]]) -> dict[int, float]:
    """iteration -> minutes of on-policy training up to and including it: the running sum of `rollout_s + time_s`
    over the online rows (offline rows add nothing)."""
    out, total = {}, 0.0
    for r in online_rows(rows):
        total += float(r.get("rollout_s") or 0.0) + float(r.get("time_s") or 0.0)
        out[int(r["iteration"])] = total / 60
    return out


def offline_minutes(rows: Iterable[Mapping[str, Any]]) -> float:
    """Minutes of offline updates (`time_s` of the offline rows)."""
    return sum(float(r.get("time_s") or 0.0) for r in rows if r.get("phase") == "offline") / 60


def _vnum(version: str) -> int:
    return int(version.lstrip("v"))


def version_iterations(manifests: Mapping[str, Mapping[str, Mapping[str, Any]]], rows: Iterable[Mapping[str, Any]],
                       untuned: Mapping[str, str]) -> tuple[dict[str, dict[str, int]], str]:
    """({role: {version: metrics-row iteration that published it}}, how it was told).

    `manifests` is {role: {version: manifest}}; versions up to the untuned one are not training's. The trainer
    writes `metrics.iteration` = the iteration count after the update, i.e. row iteration + 1 ("manifest"): a
    version the offline stage published (before on-policy training) maps to its offline row, so it is the team from
    the first on-policy iteration on; when a role's manifests lack it, its n-th published version is the n-th
    online row that trained it ("order"). Raises ValueError when the two disagree with the rows (a version past the
    last row, a reward mismatch).
    """
    online = online_rows(rows)
    by_iter = {int(r["iteration"]): r for r in rows}
    out: dict[str, dict[str, int]] = {}
    methods = set()
    for role, versions in manifests.items():
        floor = _vnum(untuned[role]) if role in untuned else 0
        published = sorted((v for v in versions if _vnum(v) > floor), key=_vnum)
        iters = [(versions[v].get("metrics") or {}).get("iteration") for v in published]
        out[role] = {}
        if published and all(i is not None for i in iters):
            methods.add("manifest")
            for v, i in zip(published, iters, strict=True):
                it = int(i) - 1
                row = by_iter.get(it)
                if row is None:
                    raise ValueError(f"{role}/{v}: manifest iteration {i} -> metrics row {it}, which the run's "
                                     "metrics do not hold")
                want, got = row.get("reward_mean"), (versions[v].get("metrics") or {}).get("reward_mean")
                if want is not None and got is not None and not math.isclose(float(want), float(got), abs_tol=1e-9):
                    raise ValueError(f"{role}/{v}: manifest reward_mean {got} but metrics row {it} has {want}")
                out[role][v] = it
        elif published:
            methods.add("order")
            trained = [int(r["iteration"]) for r in online if role in (r.get("trained_agents") or [])]
            if len(published) > len(trained):
                raise ValueError(f"{role}: {len(published)} published versions but only {len(trained)} online rows "
                                 "trained it")
            out[role] = dict(zip(published, trained, strict=False))
    return out, "+".join(sorted(methods)) or "none"


def versions_at(iteration: int, published: Mapping[str, Mapping[str, int]], untuned: Mapping[str, str]
                ) -> dict[str, str]:
    """The team after `iteration`: per role the newest version published at or before it, else the untuned one."""
    out = dict(untuned)
    for role, versions in published.items():
        done = [v for v, it in versions.items() if it <= iteration]
        if done:
            out[role] = max(done, key=_vnum)
    return out


def checkpoint_iterations(iterations: Sequence[int], every: int) -> list[int]:
    """Every `every`-th of the (online) iterations, and the last one."""
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    its = sorted(iterations)
    picked = [it for n, it in enumerate(its, start=1) if n % every == 0]
    if its and (not picked or picked[-1] != its[-1]):
        picked.append(its[-1])
    return picked


def excludes_zero(low: float | None, high: float | None) -> bool:
    return (low is not None and low > 0) or (high is not None and high < 0)


def first_significant(checkpoints: Sequence[Mapping[str, Any]]) -> float | None:
    """The on-policy minutes of the first checkpoint (by minutes) whose CI low is above 0, else None."""
    for c in sorted(checkpoints, key=lambda c: c["online_minutes"]):
        if c.get("low") is not None and c["low"] > 0:
            return c["online_minutes"]
    return None


def median_minutes(values: Sequence[float | None]) -> float | None:
    """Median over runs, a None (never significant) counting as infinity; None if the median is infinite."""
    if not values:
        return None
    m = statistics.median([math.inf if v is None else v for v in values])
    return None if math.isinf(m) else m


# ---- the replays ------------------------------------------------------------------------------------------------
def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _node_roles(run_dir: Path, roles: list[str]) -> dict[str, str]:
    for row in _read_jsonl(run_dir / "demo_log.jsonl"):
        if row.get("event") == "start" and row.get("node_roles"):
            return dict(row["node_roles"])
    return {r: r for r in roles}


def _registry_state(root: Path) -> dict[str, Any]:
    """What must not change: the alias file's bytes and the version directories."""
    aliases = root / "aliases.json"
    return {"aliases": aliases.read_bytes() if aliases.exists() else None,
            "versions": sorted(str(p.relative_to(root)) for p in root.glob("*/v*"))}


def evaluate_run(run_dir: Path, every: int = 2, *, rerun_baseline: bool = False, progress: Any = None,
                 console: Any = None) -> dict[str, Any]:
    """The checkpoints of one finished demo run, each shadow-compared with the untuned team on its held-out problems.

    Raises ValueError when the run is unfinished or its registry does not match its metrics (the last checkpoint's
    versions must be the run's tuned team), RuntimeError when the registry changed during the replays.
    """
    from marft_lg.evaluation.shadow import BaselineOnce, shadow_compare
    from marft_lg.serving.registry.store import AdapterRegistry
    from marft_lg.serving.team import Team
    from marft_lg.training.metrics import read_metrics
    from marft_lg.trajectories.scenarios import ScenarioSet

    if not (run_dir / "summary.json").is_file():
        raise ValueError(f"{run_dir} is not a finished demo run (no summary.json)")
    summary = json.loads((run_dir / "summary.json").read_text())
    seed, model, budget = int(summary["seed"]), summary["model"], summary["budget"]
    untuned, tuned = dict(summary["versions"]["untuned"]), dict(summary["versions"]["tuned"])
    rows = read_metrics(run_dir / "train" / "metrics.jsonl")
    minutes = online_minutes(rows)
    if not minutes:
        raise ValueError(f"{run_dir / 'train' / 'metrics.jsonl'}: no on-policy rows, so no curve")
    heldout = ScenarioSet.load(run_dir / "scenarios.jsonl").split("heldout")
    registry = AdapterRegistry(run_dir / "registry", create=False)
    before = _registry_state(registry.root)
    manifests = {role: {v: registry.manifest(role, v) for v in registry.versions(role)} for role in registry.roles()}
    published, method = version_iterations(manifests, rows, untuned)
    online_its = sorted(minutes)
    if versions_at(online_its[-1], published, untuned) != tuned:
        raise ValueError(f"{run_dir}: the versions published by the last online iteration "
                         f"{versions_at(online_its[-1], published, untuned)} are not the run's tuned team {tuned}")
    picks = checkpoint_iterations(online_its, every)

    from marft_lg.examples.math_team import graph, reward

    roles = list(graph.ROLES)
    score = reward.math_reward()
    max_tokens = int(budget["max_tokens"])
    concurrency = min(2 * len(heldout), 48)
    trace_dir = Path(tempfile.mkdtemp(prefix=f"curve-{run_dir.name}-"))
    task = progress.add_task(f"{run_dir.name}: checkpoints", total=len(picks)) if progress is not None else None
    checkpoints = []
    t0 = time.perf_counter()
    team = Team(model, roles, registry=registry, versions=untuned, seed=seed)
    greedy = runner = None
    try:
        greedy = graph.app_spec(max_tokens, 0.0, _node_roles(run_dir, roles)).build_app(team, trace_dir / "compare")
        runner = None if rerun_baseline else BaselineOnce(greedy, concurrency)
        for it in picks:
            cand = versions_at(it, published, untuned)
            t = time.perf_counter()
            result = shadow_compare(greedy, untuned, cand, heldout, score, samples_per_scenario=1, seed=seed,
                                    run_id=f"curve-{run_dir.name}", concurrency=concurrency, drift=False,
                                    progress=False, runner=runner)
            d = result.team.to_dict()
            row = {"iteration": it, "online_iteration": online_its.index(it) + 1,
                   "online_minutes": round(minutes[it], 3), "versions": cand, "mean": d.get("mean"),
                   "low": d.get("low"), "high": d.get("high"), "n": d.get("n"),
                   "excludes_zero": excludes_zero(d.get("low"), d.get("high")),
                   "baseline_reward": result.side_mean("baseline", "reward"),
                   "candidate_reward": result.side_mean("candidate", "reward"),
                   "invoke_failures": result.meta.get("invoke_failures"), "eval_s": round(time.perf_counter() - t, 1)}
            checkpoints.append(row)
            if console is not None:
                console.print(f"{run_dir.name} it {it} ({row['online_minutes']:.2f} on-policy min, {cand}): "
                              f"{ci_text(row)}", highlight=False, markup=False)
            if progress is not None:
                progress.advance(task)
    finally:
        if greedy is not None:
            greedy.close()
        team.close()
        shutil.rmtree(trace_dir, ignore_errors=True)
    if _registry_state(registry.root) != before:
        raise RuntimeError(f"{registry.root} changed during the evaluation")
    return {
        "run_dir": str(run_dir), "seed": seed, "model": model, "budget": budget.get("name"),
        "demo_minutes": summary.get("minutes"), "offline_minutes": round(offline_minutes(rows), 3),
        "online_minutes": round(minutes[online_its[-1]], 3), "online_minutes_budget": budget.get("online_minutes"),
        "online_iterations": len(online_its), "every": every,
        "heldout_problems": len(heldout), "untuned": untuned, "tuned": tuned,
        "version_iteration_source": method, "baseline_reused": runner is not None,
        "demo_heldout_difference": summary.get("heldout", {}).get("difference"),
        "checkpoints": checkpoints, "minutes_to_significant_gain": first_significant(checkpoints),
        "eval_minutes": round((time.perf_counter() - t0) / 60, 2),
    }


def ci_text(c: Mapping[str, Any]) -> str:
    """``diff +0.109, 95% CI [+0.012, +0.217], n=128`` for one checkpoint."""
    def f(v: Any) -> str:
        return "n/a" if v is None else f"{v:+.3f}"

    return f"diff {f(c['mean'])}, 95% CI [{f(c['low'])}, {f(c['high'])}], n={c['n']}"


def plot(runs: Sequence[Mapping[str, Any]], path: Path, *, goal_minutes: float | None = None,
         title: str = "held-out gain over on-policy training time") -> Path:
    """The paired CI at each checkpoint against on-policy minutes, one line per run, a line at 0 (and at
    `goal_minutes`); each line starts at the untuned team (0 minutes, no gain by definition)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for k, run in enumerate(runs):
        cps = [c for c in run["checkpoints"] if c["mean"] is not None]
        if not cps:
            continue
        x = [0.0] + [c["online_minutes"] + 0.03 * k for c in cps]  # a little offset so runs' bars do not overlap
        y = [0.0] + [c["mean"] for c in cps]
        err = [[0.0] + [c["mean"] - (c["low"] if c["low"] is not None else c["mean"]) for c in cps],
               [0.0] + [(c["high"] if c["high"] is not None else c["mean"]) - c["mean"] for c in cps]]
        label = f"seed {run['seed']}" + (f" ({Path(run['run_dir']).name})" if len(runs) > 1 else "")
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=label)
    ax.axhline(0, color="black", linewidth=1)
    if goal_minutes is not None:
        ax.axvline(goal_minutes, color="grey", linestyle="--", linewidth=1, label=f"{goal_minutes:g} min")
    ax.set_xlabel("on-policy training minutes (rollouts + updates)")
    ax.set_ylabel("held-out team reward, tuned - untuned (95% CI)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def summary_curve(curve: dict[str, Any]) -> dict[str, Any]:
    """What a run's `summary.json` keeps of its curve (`curve.json` has the rest)."""
    return {k: curve[k] for k in ("every", "checkpoints", "minutes_to_significant_gain", "eval_minutes")}


def write_curve(run_dir: Path, every: int = 2, *, rerun_baseline: bool = False,
                console: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """`evaluate_run`, then `curve.json` and `curve.png` in the run directory and the curve in its `summary.json`
    (`marft_lg.demo.add_curve` also renders it into the report). Returns the curve and the updated summary."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from marft_lg._provenance import code_state

    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=console is None) as progress:
        curve = evaluate_run(run_dir, every, rerun_baseline=rerun_baseline, progress=progress, console=console)
    curve["code"] = code_state()
    write_atomic(run_dir / "curve.json", json.dumps(curve, indent=2, default=str) + "\n")
    plot([curve], run_dir / "curve.png", goal_minutes=curve["online_minutes_budget"],
         title=f"held-out gain over on-policy training time (seed {curve['seed']})")
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text())
    summary["curve"] = summary_curve(curve)
    write_atomic(summary_path, json.dumps(summary, indent=2, default=str))
    return curve, summary

