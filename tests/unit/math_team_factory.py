"""Hand-made math-team trajectories for the demo and accuracy tests: {episode id: (scenario id, [(agent, text)])}."""

from __future__ import annotations

import pandas as pd

from marft_lg.trajectories.dataset import ACTION_COLUMNS, EPISODE_COLUMNS, TrajectoryDataset


def math_dataset(episodes: dict[str, tuple[str, list[tuple[str, str]]]]) -> TrajectoryDataset:
    """A dataset with one episode per key; an episode without actions is a failed run (status error)."""
    t0 = pd.Timestamp("2026-01-01", tz="UTC")
    eps, acts = [], []
    for i, (eid, (sid, actions)) in enumerate(episodes.items()):
        eps.append({"episode_id": eid, "scenario_id": sid, "start_time": t0 + pd.Timedelta(seconds=i),
                    "end_time": t0 + pd.Timedelta(seconds=i + 1), "n_actions": len(actions),
                    "agents": list(dict.fromkeys(a for a, _ in actions)), "status": "ok" if actions else "error",
                    "outcome": None, "feedback": {}, "metadata": {}})
        acts += [{"episode_id": eid, "order": k, "step": k, "agent": agent, "span_id": f"{i:08x}{k:08x}",
                  "messages": [{"role": "user", "content": "q"}], "completion": text, "prompt_token_ids": None,
                  "completion_token_ids": None, "completion_logprobs": None, "depends_on": list(range(k)),
                  "tool_calls": [], "tool_errors": 0, "input_tokens": 10, "output_tokens": 5, "latency_s": 0.1,
                  "model": "fake", "adapter_version": "v1"}
                 for k, (agent, text) in enumerate(actions)]
    return TrajectoryDataset(pd.DataFrame(eps, columns=list(EPISODE_COLUMNS)),
                             pd.DataFrame(acts, columns=list(ACTION_COLUMNS)))
