"""Small hand-built trajectory datasets and a transparent reward for the evaluation tests."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from marft_lg.trajectories.dataset import ACTION_COLUMNS, EPISODE_COLUMNS, TrajectoryDataset


def make_dataset(episodes: list[dict]) -> TrajectoryDataset:
    """episodes: [{"episode_id", "scenario_id", "actions": [{"agent", "completion", ...}], "status"?, "metadata"?}]."""
    ep_rows, act_rows = [], []
    t0 = pd.Timestamp("2026-01-01", tz="UTC")
    for i, ep in enumerate(episodes):
        acts = ep["actions"]
        ep_rows.append({
            "episode_id": ep["episode_id"], "scenario_id": ep.get("scenario_id"),
            "start_time": t0 + pd.Timedelta(seconds=i), "end_time": t0 + pd.Timedelta(seconds=i + 1),
            "n_actions": len(acts), "agents": list(dict.fromkeys(a["agent"] for a in acts)),
            "status": ep.get("status", "ok"), "outcome": None, "feedback": {}, "metadata": ep.get("metadata", {}),
        })
        for order, a in enumerate(acts):
            act_rows.append({
                "episode_id": ep["episode_id"], "order": order, "step": order, "agent": a["agent"],
                "span_id": f"{i:08x}{order:08x}", "messages": a.get("messages", [{"role": "user", "content": "q"}]),
                "completion": a.get("completion", ""), "prompt_token_ids": None, "completion_token_ids": None,
                "completion_logprobs": None, "depends_on": list(range(order)), "tool_calls": a.get("tool_calls", []),
                "tool_errors": sum(1 for t in a.get("tool_calls", []) if t.get("error")),
                "input_tokens": a.get("input_tokens", 10), "output_tokens": a.get("output_tokens", 5),
                "latency_s": 0.1, "model": "tiny", "adapter_version": a.get("adapter_version"),
            })
    return TrajectoryDataset(pd.DataFrame(ep_rows, columns=list(EPISODE_COLUMNS)),
                             pd.DataFrame(act_rows, columns=list(ACTION_COLUMNS)))


@dataclass
class FakeRewardResult:
    episodes: pd.DataFrame
    action_rewards: dict = field(default_factory=dict)


class FormatAndAnswerReward:
    """reward = 0.5 * format (final answer looks like 'ANSWER: x') + 0.5 * correct (x == reference).

    The same shape as CompositeReward.score: one column per component, reward on the last action.
    """

    components = ("format", "correct")

    def __init__(self, fail_on: set[str] | None = None):
        self.fail_on = fail_on or set()

    def score(self, dataset: TrajectoryDataset, scenarios=None) -> FakeRewardResult:
        rows, per_action = [], {}
        for ep in dataset.iter_episodes(scenarios):
            if ep.episode_id in self.fail_on:
                rows.append({"episode_id": ep.episode_id, "reward": np.nan, "scored": False, "error": "boom",
                             "format": np.nan, "correct": np.nan})
                continue
            m = re.fullmatch(r"ANSWER: (\S+)", ep.final_completion.strip())
            fmt = float(m is not None)
            ref = (ep.scenario or {}).get("reference")
            correct = float(m is not None and ref is not None and m.group(1) == str(ref))
            reward = 0.5 * fmt + 0.5 * correct
            rows.append({"episode_id": ep.episode_id, "reward": reward, "scored": True, "error": None,
                         "format": fmt, "correct": correct})
            arr = np.zeros(len(ep.actions))
            if len(arr):
                arr[-1] = reward
            per_action[ep.episode_id] = arr
        return FakeRewardResult(pd.DataFrame(rows), per_action)


def team_run(tag: str, scenario_ids: list[str], answers: dict[str, str], *, writer_tokens: int = 5,
             loops: int = 0, tool: dict | None = None) -> TrajectoryDataset:
    """A planner -> writer team; the writer's completion per scenario is `answers[sid]`."""
    eps = []
    for sid in scenario_ids:
        acts = [{"agent": "planner", "completion": "plan", "tool_calls": [tool] if tool else []}]
        for _ in range(loops):
            acts += [{"agent": "writer", "completion": "?"}, {"agent": "planner", "completion": "again"}]
        acts.append({"agent": "writer", "completion": answers[sid], "output_tokens": writer_tokens})
        eps.append({"episode_id": f"{tag}-{sid}", "scenario_id": sid, "actions": acts})
    return make_dataset(eps)
