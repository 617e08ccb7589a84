"""Cost of the comparison itself (no LLM): scoring both sides, paired bootstrap CIs for every quantity,
the gate, and the Markdown/HTML/PNG report, on synthetic 3-agent episodes.

    python benchmarks/compare.py [--units 200 1000] [--actions 6] [--resamples 2000]

writes benchmarks/results/compare.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from marft_lg.evaluation.comparison import compare_datasets
from marft_lg.evaluation.gate import PromotionGate
from marft_lg.evaluation.report import write_report
from marft_lg.evaluation.stats import bootstrap_ci
from marft_lg.rewards import CompositeReward
from marft_lg.trajectories.dataset import ACTION_COLUMNS, EPISODE_COLUMNS, TrajectoryDataset

RESULTS = Path(__file__).resolve().parent / "results" / "compare.json"
AGENTS = ("planner", "researcher", "writer")
REWARD = {"weights": {"format_compliance": 1.0, "step_count": -0.05},
          "components": {"format_compliance": {"agents": {"writer": {"regex": r"ANSWER: \d+", "fullmatch": True}}}}}


def synthetic(tag: str, n_units: int, n_actions: int, p_format: float, seed: int) -> TrajectoryDataset:
    """One episode per unit; agents take turns; the writer follows the format with probability p_format."""
    rng = random.Random(seed)
    eps: list[dict[str, Any]] = []
    acts: list[dict[str, Any]] = []
    t0 = pd.Timestamp("2026-01-01", tz="UTC")
    for u in range(n_units):
        eid = f"{tag}-{u}"
        n = max(2, n_actions + rng.randint(-1, 1))
        agents = [AGENTS[k % 2] for k in range(n - 1)] + ["writer"]
        for order, agent in enumerate(agents):
            text = f"ANSWER: {u}" if agent == "writer" and rng.random() < p_format else f"thinking about {u}"
            acts.append({"episode_id": eid, "order": order, "step": order, "agent": agent, "span_id": f"{u:08x}{order:08x}",
                         "messages": [{"role": "user", "content": f"q{u}"}], "completion": text,
                         "prompt_token_ids": None, "completion_token_ids": None, "completion_logprobs": None,
                         "depends_on": list(range(order)), "tool_calls": [{"name": "lookup", "args": {}}] if agent == "researcher" else [],
                         "tool_errors": 0, "input_tokens": 100 + order, "output_tokens": rng.randint(5, 40),
                         "latency_s": 0.05, "model": "bench", "adapter_version": "v1"})
        eps.append({"episode_id": eid, "scenario_id": f"s{u}", "start_time": t0 + pd.Timedelta(seconds=u),
                    "end_time": t0 + pd.Timedelta(seconds=u + 1), "n_actions": n, "agents": list(dict.fromkeys(agents)),
                    "status": "ok", "outcome": None, "feedback": {}, "metadata": {}})
    return TrajectoryDataset(pd.DataFrame(eps, columns=list(EPISODE_COLUMNS)), pd.DataFrame(acts, columns=list(ACTION_COLUMNS)))


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--units", type=int, nargs="+", default=[200, 1000])
    ap.add_argument("--actions", type=int, default=6)
    ap.add_argument("--resamples", type=int, default=2000)
    args = ap.parse_args()
    reward = CompositeReward.from_yaml(REWARD)
    rows = []
    for n in args.units:
        base = synthetic("b", n, args.actions, 0.5, seed=1)
        cand = synthetic("c", n, args.actions, 0.8, seed=2)
        _, t_boot = timed(lambda n=n: bootstrap_ci(np.random.default_rng(0).normal(size=n), n_resamples=args.resamples))
        result, t_cmp = timed(lambda b=base, c=cand: compare_datasets(b, c, reward, n_resamples=args.resamples))
        decision, t_gate = timed(lambda r=result: PromotionGate().evaluate(r))
        with tempfile.TemporaryDirectory() as d:
            _, t_report = timed(lambda r=result, dec=decision, d=d: write_report(r, d, dec))
        n_cis = 1 + len(result.components) + len(result.episode_metrics) + sum(len(m) for m in result.agents.values())
        rows.append({"units": n, "actions_per_episode": args.actions, "paired_cis": n_cis,
                     "bootstrap_one_ci_s": round(t_boot, 4), "compare_s": round(t_cmp, 3), "gate_s": round(t_gate, 4),
                     "report_s": round(t_report, 3), "team_delta": round(result.team.mean, 4),
                     "decision": "promote" if decision.promote else "reject"})
        print(rows[-1])
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    from marft_lg._provenance import code_state

    RESULTS.write_text(json.dumps({**code_state(), "benchmark": "compare", "resamples": args.resamples, "cpu_count": os.cpu_count(),
                                   "python": platform.python_version(), "results": rows}, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
