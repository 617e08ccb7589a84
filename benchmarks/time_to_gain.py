"""Time to a significant gain of the main job (`marft-lg demo`): minutes of on-policy MARFT on 2 CPU cores
until the held-out paired 95% CI of the math team's reward difference (tuned - untuned) excludes 0. Goal: 8 min.

For each finished demo run given, `marft_lg.demo.add_curve` (what `marft-lg demo-curve` runs) replays the team
every `--every`-th on-policy iteration had published against the untuned team on the run's held-out problems (the
demo's own comparison; the last checkpoint reproduces it) and writes the run's `curve.json`, `curve.png` and a
section of its report. This script then collects the runs: minutes to a significant gain per run and their median
(a run that never got there counting as infinitely slow, so the median is None when half or more never did), and
one plot of all runs.

Usage (a full demo run takes ~14 min on 2 cores; each checkpoint then replays the 128 held-out problems with the
candidate team, about 1.5 min on 2026-11-29's host, plus the untuned side once per run):

    python benchmarks/demo.py --seeds 0,1,2,3,4        # or any finished `marft-lg demo --run-dir` runs
    python benchmarks/time_to_gain.py --run-dir runs/demo-bench-seed0 --run-dir runs/demo-bench-seed1 [--every 2]

writes benchmarks/results/time_to_gain.json and a plot beside it (time_to_gain.png: the CI at each checkpoint
against on-policy minutes, one line per run).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results" / "time_to_gain.json"
GOAL_MINUTES = 8.0


def summarise(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per run its minutes to a significant gain, their median and how many runs got there."""
    from marft_lg.demo_curve import median_minutes

    per_seed = [r["minutes_to_significant_gain"] for r in runs]
    median = median_minutes(per_seed)
    return {"minutes_to_significant_gain": {
                "per_seed": [{"seed": r["seed"], "run_dir": r["run_dir"], "minutes": r["minutes_to_significant_gain"]}
                             for r in runs],
                "median": median, "seeds_significant": sum(m is not None for m in per_seed), "seeds": len(runs)},
            "meets_goal": median is not None and median <= GOAL_MINUTES}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", type=Path, action="append", required=True,
                    help="a finished `marft-lg demo` run directory; repeat for several seeds")
    ap.add_argument("--every", type=int, default=2, help="compare every N-th online iteration (and the last)")
    ap.add_argument("--rerun-baseline", action="store_true",
                    help="replay the untuned side at every checkpoint (as the demo does) instead of once")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results JSON (the plot goes beside it, .png)")
    args = ap.parse_args(argv)
    if args.every < 1:
        ap.error(f"--every must be >= 1, got {args.every}")
    for d in args.run_dir:
        if not (d / "summary.json").is_file():
            ap.error(f"{d} is not a finished demo run (no summary.json)")

    from rich.console import Console

    from marft_lg._provenance import code_state, machine
    from marft_lg.demo import add_curve
    from marft_lg.demo_curve import plot

    provenance = {**code_state(), "machine": machine()}
    console = Console()
    runs = [add_curve(d, args.every, rerun_baseline=args.rerun_baseline, console=console) for d in args.run_dir]
    result = {**provenance, "benchmark": "time_to_gain", "goal_minutes": GOAL_MINUTES, "every": args.every,
              "run_dirs": [str(d) for d in args.run_dir], "seeds": [r["seed"] for r in runs], "runs": runs,
              **summarise(runs)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    png = plot(runs, args.out.with_suffix(".png"), goal_minutes=GOAL_MINUTES,
               title="time to a significant gain (math team)")
    for r in runs:
        m = r["minutes_to_significant_gain"]
        console.print(f"seed {r['seed']} ({r['run_dir']}): "
                      f"{'never significant' if m is None else f'{m:.2f} on-policy min'} "
                      f"(on-policy {r['online_minutes']:.2f} min over {r['online_iterations']} iterations, offline "
                      f"{r['offline_minutes']:.2f} min, demo wall {r['demo_minutes']} min)", highlight=False)
    median = result["minutes_to_significant_gain"]["median"]
    console.print(f"median minutes to a significant gain: {'none' if median is None else f'{median:.2f}'} "
                  f"(goal {GOAL_MINUTES:g}); wrote {args.out} and {png}", highlight=False)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
