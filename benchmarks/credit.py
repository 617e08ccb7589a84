"""Credit estimators at equal training time: the math team (reasoner -> actor, the demo's app, reward and settings)
trained with `credit: group` and with `credit: counterfactual`, one run per estimator and seed, each given the same
on-policy wall-clock budget; the tuned team is then shadow-compared with the untuned one on held-out problems
(greedy, paired), as the demo's stage 6 does.

    python benchmarks/credit.py --seeds 0,1,2 --online-minutes 5 --heldout 128

Writes benchmarks/results/credit.json: top-level `commit`, the settings, and `runs: [{estimator, seed, minutes,
iterations, gain, ci_low, ci_high, minutes_to_significance, ...}]`. `minutes` is the training time the run spent
(offline + on-policy: rollouts, updates and replays; `replay_minutes` the replays' share); the held-out comparison
is made once, at the end of the budget, so `minutes_to_significance` is that time when the CI excludes 0 and null
otherwise (an upper bound, not a curve).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "credit.json"
# Each estimator's MARFT credit settings and the demo budget fields it changes. Counterfactual credit runs 2 episodes
# per scenario instead of 4 (4 problems per iteration either way): with one replay per action that is 8 episodes and
# 16 replays per iteration, about group's 16 episodes in rollout time, so both make a similar number of updates in
# the same minutes (with 4 per scenario a counterfactual iteration took ~2.5x as long: 1 update to group's 4).
# dynamic sampling (the demo's default since) stays off: the estimators are compared as credit.json measured them
ESTIMATORS = {
    "group": {"credit": {"credit": "group", "dynamic_sampling": False}, "budget": {}},
    "counterfactual": {"credit": {"credit": "counterfactual", "replays_per_action": 1, "dynamic_sampling": False},
                       "budget": {"group_size": 2}},
}


def one_run(estimator: str, seed: int, online_minutes: float, heldout: int, work: Path) -> dict:
    from rich.console import Console

    from marft_lg.demo import BUDGETS, run_demo
    from marft_lg.training.metrics import read_metrics

    budget = replace(BUDGETS["full"], name=f"credit-{online_minutes:g}min", online_minutes=online_minutes,
                     n_heldout=heldout, minutes=online_minutes + 3, deadline=False, **ESTIMATORS[estimator]["budget"])
    run_dir = work / f"{estimator}-s{seed}"
    load_before = os.getloadavg()[0]
    summary = run_demo(budget, run_dir, model="embedded:smollm2-135m-instruct", seed=seed, trace_root=work / "traces",
                       console=Console(quiet=True), credit=ESTIMATORS[estimator]["credit"])
    rows = read_metrics(run_dir / "train" / "metrics.jsonl")
    online = [r for r in rows if r.get("phase") == "online"]
    train_s = sum(float(r.get(k) or 0) for r in rows for k in ("time_s", "rollout_s", "replay_s"))  # replays too
    d = summary["heldout"]["difference"]
    significant = d.get("low") is not None and d["low"] > 0
    return {
        "estimator": estimator, "seed": seed, "minutes": round(train_s / 60, 2), "iterations": len(online),
        "gain": d["mean"], "ci_low": d.get("low"), "ci_high": d.get("high"), "pairs": d.get("n"),
        "minutes_to_significance": round(train_s / 60, 2) if significant else None,
        "replays": sum(int(r.get("replays") or 0) for r in rows),
        "replay_minutes": round(sum(float(r.get("replay_s") or 0) for r in rows) / 60, 2),
        "heldout_accuracy": summary["heldout"].get("accuracy"), "wall_minutes": summary["minutes"],
        "code": summary.get("code"),
        "load_avg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],  # the machine's load before / after
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--estimators", default="group,counterfactual")
    ap.add_argument("--online-minutes", type=float, default=5.0)
    ap.add_argument("--heldout", type=int, default=128)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    runs = []
    work = Path(tempfile.mkdtemp(prefix="marft-credit-"))
    try:
        for seed in seeds:  # estimators interleaved per seed: a slower stretch of the machine hits both alike
            for estimator in args.estimators.split(","):
                run = one_run(estimator, seed, args.online_minutes, args.heldout, work)
                runs.append(run)
                print(json.dumps({k: run[k] for k in ("estimator", "seed", "minutes", "iterations", "gain", "ci_low",
                                                      "ci_high", "replays")}), flush=True)
                _write(args, runs)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _write(args: argparse.Namespace, runs: list[dict]) -> None:
    from marft_lg._durable import write_atomic

    commit = runs[0]["code"].get("commit") if runs and runs[0].get("code") else None
    out = {
        "commit": commit, "benchmark": "credit", "machine": (runs[0]["code"] or {}).get("machine") if runs else None,
        "settings": {"online_minutes": args.online_minutes, "heldout": args.heldout,
                     "estimators": {k: ESTIMATORS[k] for k in args.estimators.split(",")},
                     "app": "marft_lg.examples.math_team (the demo's budget 'full' but for online_minutes / heldout)"},
        "runs": [{k: v for k, v in r.items() if k != "code"} for r in runs],
        "summary": _summary(runs),
    }
    write_atomic(args.out, json.dumps(out, indent=2) + "\n")


def _summary(runs: list[dict]) -> dict:
    out = {}
    for est in sorted({r["estimator"] for r in runs}):
        mine = [r for r in runs if r["estimator"] == est]
        out[est] = {"runs": len(mine), "significant": sum(r["minutes_to_significance"] is not None for r in mine),
                    "mean_gain": round(sum(r["gain"] for r in mine) / len(mine), 4),
                    "mean_minutes": round(sum(r["minutes"] for r in mine) / len(mine), 2)}
    return out


if __name__ == "__main__":
    sys.exit(main())
