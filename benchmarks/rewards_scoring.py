"""Scoring throughput of CompositeReward on synthetic multi-agent episodes (rule-based components, no LLM).

Three rewards: the playbook composite (task completion on boxed numbers, trajectory score, step count,
tool error rate, goal progress) with terminal and with shaped credit, and task completion alone on
symbolic answers (sympy) — the slowest built-in matcher.

    python benchmarks/rewards_scoring.py [--episodes 2000] [--actions 6]

writes benchmarks/results/rewards_scoring.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from pathlib import Path
from typing import Any

import pandas as pd

from marft_lg.rewards import CompositeReward
from marft_lg.trajectories.dataset import ACTION_COLUMNS, EPISODE_COLUMNS, TrajectoryDataset
from marft_lg.trajectories.scenarios import Scenario, ScenarioSet

RESULTS = Path(__file__).resolve().parent / "results" / "rewards_scoring.json"
PLAYBOOK = {"task_completion": 1.0, "trajectory_score": 0.5, "step_count": -0.1, "tool_error_rate": -0.2,
            "goal_progress": 0.3}


def synthetic(n_episodes: int, n_actions: int, *, symbolic: bool, seed: int = 0) -> tuple[TrajectoryDataset, ScenarioSet]:
    """Reasoner/actor episodes with tool calls, some failing, half answering correctly."""
    rng = random.Random(seed)
    eps: list[dict[str, Any]] = []
    acts: list[dict[str, Any]] = []
    t0 = pd.Timestamp("2026-01-01", tz="UTC")
    for e in range(n_episodes):
        eid = f"ep{e:06d}"
        right = rng.random() < 0.5
        answer = (r"\frac{\sqrt{2}}{2}" if right else r"\frac{\sqrt{3}}{2}") if symbolic else ("42" if right else "41")
        for o in range(n_actions):
            agent = "reasoner" if o % 2 == 0 else "actor"
            calls = [{"name": "calc", "args": {}, "id": f"c{o}", "result": "6", "error": "boom" if rng.random() < 0.1 else None}
                     ] if agent == "actor" else []
            text = rf"step {o}: so \boxed{{{answer}}}" if o == n_actions - 1 else f"step {o}: think about {rng.random():.4f}"
            acts.append({"episode_id": eid, "order": o, "step": o, "agent": agent, "span_id": f"{e:08x}{o:08x}",
                         "messages": [{"role": "user", "content": "what is 6*7?"}], "completion": text,
                         "prompt_token_ids": None, "completion_token_ids": None, "completion_logprobs": None,
                         "depends_on": list(range(o)), "tool_calls": calls,
                         "tool_errors": sum(1 for c in calls if c["error"]), "input_tokens": 100 + o,
                         "output_tokens": 20, "latency_s": 0.1, "model": "bench", "adapter_version": "v1"})
        eps.append({"episode_id": eid, "scenario_id": "s1", "start_time": t0 + pd.Timedelta(seconds=e),
                    "end_time": t0 + pd.Timedelta(seconds=e + 1), "n_actions": n_actions,
                    "agents": ["reasoner", "actor"], "status": "ok", "outcome": None, "feedback": {}, "metadata": {}})
    reference = "1/sqrt(2)" if symbolic else "42"
    scenarios = ScenarioSet([Scenario("s1", {"q": "what is 6*7?"}, reference=reference, expected_tools=["calc"],
                                      checkpoints=["tool:calc", "step 1"])])
    return (TrajectoryDataset(pd.DataFrame(eps, columns=list(EPISODE_COLUMNS)), pd.DataFrame(acts, columns=list(ACTION_COLUMNS))),
            scenarios)


def timed(reward: CompositeReward, dataset: TrajectoryDataset, scenarios: ScenarioSet) -> dict[str, float]:
    start = time.perf_counter()
    result = reward.score(dataset, scenarios)
    wall = time.perf_counter() - start
    assert result.summary()["unscored"] == 0, result.summary()["error_examples"]
    n_actions = sum(len(v) for v in result.action_rewards.values())
    return {"episodes": len(dataset), "actions": n_actions, "wall_s": round(wall, 3),
            "episodes_per_s": round(len(dataset) / wall, 1), "actions_per_s": round(n_actions / wall, 1),
            "mean_reward": round(float(result.episodes["reward"].mean()), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=2000)
    parser.add_argument("--actions", type=int, default=6)
    parser.add_argument("--symbolic-episodes", type=int, default=200)
    args = parser.parse_args()

    plain, scenarios = synthetic(args.episodes, args.actions, symbolic=False)
    sym, sym_scenarios = synthetic(args.symbolic_episodes, args.actions, symbolic=True)
    CompositeReward({"task_completion": 1.0}).score(sym.select(sym.episode_ids[:2]), sym_scenarios)  # sympy import
    runs = {
        "playbook_terminal": timed(CompositeReward(PLAYBOOK, answer_agents=["actor"]), plain, scenarios),
        "playbook_shaped": timed(CompositeReward(PLAYBOOK, credit="shaped", answer_agents=["actor"]), plain, scenarios),
        "task_completion_symbolic": timed(CompositeReward({"task_completion": 1.0},
                                                          components={"task_completion": {"match": "symbolic"}}),
                                          sym, sym_scenarios),
    }
    from marft_lg._provenance import code_state

    out = {**code_state(), "benchmark": "rewards_scoring", "machine": {"python": platform.python_version(),
                                                       "cpu_count": os.cpu_count(), "platform": platform.platform()},
           "actions_per_episode": args.actions, "runs": runs}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
