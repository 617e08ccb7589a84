"""The main job's own figures: `marft-lg demo` (full budget) per seed, timed stage by stage, with its decision.

    python benchmarks/demo.py --seeds 0,1,2              # runs the demo once per seed (about 15 min each)
    python benchmarks/demo.py --from-runs runs/s0 runs/s1 # collects finished run directories instead

Writes benchmarks/results/demo.json (top-level `commit`: the code the runs measured, taken from each
run's own summary) and prints the README's table. Every seed asked for is reported, whatever it shows.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from learn import _ci, _ci_cell, _components  # noqa: E402  (one reader of a demo run's component CIs)

STAGES = [("served", "serve"), ("traced", "trace untuned"), ("mined", "mine"), ("offline", "offline MARFT"),
          ("untuned_heldout", "untuned held-out"), ("online", "on-policy MARFT"), ("compare", "shadow compare"),
          ("done", "gate + report")]


def collect(run_dir: Path) -> dict:
    """One run's figures from its summary.json, demo_log.jsonl and train/metrics.jsonl."""
    summary = json.loads((run_dir / "summary.json").read_text())
    events = {}
    for line in (run_dir / "demo_log.jsonl").read_text().splitlines():
        row = json.loads(line)
        events[row["event"]] = row
    stage_min, last = {}, 0.0
    for event, label in STAGES:
        if event in events:
            stage_min[label] = round((events[event]["elapsed_s"] - last) / 60, 2)
            last = events[event]["elapsed_s"]
    rows = [json.loads(x) for x in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()]
    online = [r for r in rows if r.get("phase") == "online"]
    d = summary["heldout"]["difference"]
    return {
        "seed": summary["seed"], "run_dir": str(run_dir), "code": summary.get("code"),
        "minutes": summary["minutes"], "stage_minutes": stage_min, "online_budget": summary.get("online_budget"),
        "offline_iterations": sum(r.get("phase") == "offline" for r in rows), "online_iterations": len(online),
        "warm_start": next(({"kept_episodes": r.get("kept_episodes")} for r in rows if r.get("phase") == "warm_start"),
                           None),
        # an on-policy iteration whose update dynamic sampling skipped has rollouts but no update time
        "online_training_minutes": round(sum((r.get("rollout_s") or 0) + (r.get("time_s") or 0) for r in online)
                                         / 60, 2),
        # an iteration whose batch held no scored episode has no mean (None): kept as None, not dropped
        "train_reward_curve": [None if r.get("reward_mean") is None else round(r["reward_mean"], 3) for r in rows],
        "heldout_n": summary["heldout"]["pairs"],
        "baseline_reward": summary["heldout"]["baseline_reward"],
        "candidate_reward": summary["heldout"]["candidate_reward"],
        "difference": {k: d.get(k) for k in ("mean", "low", "high", "n")},
        "mde": summary["heldout"].get("mde"), "accuracy": summary["heldout"].get("accuracy"),
        "task_completion": _ci(_components(run_dir).get("task_completion")),
        "setup_split": setup_split(run_dir, summary),
        "promote": summary["gate"]["promote"], "reasons": summary["gate"]["reasons"],
    }


def setup_split(run_dir: Path, summary: dict) -> dict | None:
    """Per side of the held-out comparison: the share of episodes whose set-up was written in full (the reward's
    `goal_progress` = 1) and the answer's accuracy (`task_completion`) with and without it; so a gain in accuracy
    reads as "set the problem up more often" or "computed better once it was set up". None when the comparison's
    traces are gone."""
    from marft_lg.evaluation.shadow import SIDE_KEY
    from marft_lg.examples.math_team.reward import math_reward
    from marft_lg.trajectories.mining import mine
    from marft_lg.trajectories.scenarios import ScenarioSet

    traces = Path(summary["trace_dir"]) / "compare"
    traces = traces if traces.is_absolute() else ROOT / traces
    if not traces.is_dir():
        return None
    dataset = mine([traces])
    scored = math_reward().score(dataset, ScenarioSet.load(run_dir / "scenarios.jsonl").split("heldout")).episodes
    side = dataset.episodes.set_index("episode_id")["metadata"].map(lambda m: (m or {}).get(SIDE_KEY))
    scored = scored.assign(side=scored["episode_id"].map(side))
    out = {}
    for name, g in scored.groupby("side"):
        full = g["goal_progress"] >= 1.0
        out[name] = {"n": len(g), "answer": round(float(g["task_completion"].mean()), 4),
                     "setup": round(float(full.mean()), 4),
                     "answer_given_setup": round(float(g.loc[full, "task_completion"].mean()), 4) if full.any() else None,
                     "answer_without_setup": (round(float(g.loc[~full, "task_completion"].mean()), 4)
                                              if (~full).any() else None)}
    return out


def table(results: dict) -> str:
    lines = ["| seed | minutes | iterations (offline + on-policy) | held-out | team reward untuned -> tuned | "
             "paired diff, 95% CI | task_completion gain, 95% CI | MDE | strict accuracy | lenient accuracy | decision |",
             "|---:|---:|---:|---:|---|---|---|---:|---|---|---|"]
    for r in results["runs"]:
        d, acc, tc = r["difference"], r.get("accuracy") or {}, r.get("task_completion")
        b, c = acc.get("baseline", {}), acc.get("candidate", {})
        mde = (r.get("mde") or {}).get("mde")
        lines.append(
            f"| {r['seed']} | {r['minutes']:.1f} | {r['offline_iterations']} + {r['online_iterations']} | "
            f"{r['heldout_n']} | {r['baseline_reward']:.3f} -> {r['candidate_reward']:.3f} | "
            f"{d['mean']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}] | "
            f"{_ci_cell(tc)} | "
            f"{'n/a' if mde is None else f'{mde:.3f}'} | "
            f"{b.get('strict', float('nan')):.2f} -> {c.get('strict', float('nan')):.2f} | "
            f"{b.get('lenient', float('nan')):.2f} -> {c.get('lenient', float('nan')):.2f} | "
            f"{'**promote**' if r['promote'] else 'reject'} |")
    return "\n".join(lines)


def setup_table(results: dict) -> str:
    """Where the answers' accuracy came from, per seed: set-up written in full, and the answer right given it."""
    def cell(split: dict | None, side: str, key: str) -> str:
        v = ((split or {}).get(side) or {}).get(key)
        return "n/a" if v is None else f"{v:.2f}"

    lines = ["| seed | set-up written in full, untuned -> tuned | answer right given the set-up | "
             "answer right without it |", "|---:|---|---|---|"]
    for r in results["runs"]:
        sp = r.get("setup_split")
        lines.append(f"| {r['seed']} | " + " | ".join(f"{cell(sp, 'baseline', k)} -> {cell(sp, 'candidate', k)}" for k in
                                                 ("setup", "answer_given_setup", "answer_without_setup")) + " |")
    return "\n".join(lines)


def _newest(commits: set[str | None]) -> str | None:
    """The commit every other run's commit is an ancestor of (runs collected from several commits record the
    newest at the top level and each seed's own under `seed_commits`)."""
    known = sorted(c for c in commits if c)
    for c in known:
        if all(subprocess.run(["git", "merge-base", "--is-ancestor", o, c], cwd=ROOT).returncode == 0 for o in known):
            return c
    return known[-1] if known else None


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--from-runs", nargs="*", type=Path, default=None, help="finished run directories to collect")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "demo.json")
    args = ap.parse_args(argv)
    run_dirs = args.from_runs
    if run_dirs is None:
        run_dirs = []
        for seed in [int(s) for s in args.seeds.split(",") if s.strip()]:
            run_dir = ROOT / "runs" / f"demo-bench-seed{seed}"
            for owned in (run_dir, ROOT / "traces" / f"demo-{run_dir.name}"):  # a fresh run: nothing of an earlier one
                shutil.rmtree(owned, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "marft_lg.cli", "demo", "--seed", str(seed), "--run-dir",
                            str(run_dir)], check=True, cwd=ROOT)
            run_dirs.append(run_dir)
    from marft_lg._provenance import machine

    runs = sorted((collect(Path(d)) for d in run_dirs), key=lambda r: r["seed"])
    commits = {(r["code"] or {}).get("commit") for r in runs}
    results = {
        "commit": _newest(commits),
        "seed_commits": {r["seed"]: (r["code"] or {}).get("commit") for r in runs},
        "dirty": any((r["code"] or {}).get("dirty") for r in runs),
        # the host that ran the seeds (collected with --from-runs: the host that collected them)
        "machine": {**machine(), "ran_here": args.from_runs is None},
        "benchmark": "demo", "budget": "full", "goal": "issue #46: promote on 5 of seeds 0-4, mean held-out gain >= "
                                                   "+0.30, strict accuracy at least doubled and the task_completion "
                                                   "gain's 95% CI above 0 on every seed, each run <= 15 min on 2 cores",
        "promoted": sum(r["promote"] for r in runs), "seeds": [r["seed"] for r in runs],
        "max_minutes": max(r["minutes"] for r in runs), "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(table(results))
    print()
    print(setup_table(results))
    print(f"\npromoted on {results['promoted']} of {len(runs)} seeds; longest run {results['max_minutes']} min; "
          f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
