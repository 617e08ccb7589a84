"""Hand-made TrajectoryDatasets for reward tests: write episodes as short dicts, get the real columns."""

from __future__ import annotations

from typing import Any

import pandas as pd

from marft_lg.trajectories.dataset import ACTION_COLUMNS, EPISODE_COLUMNS, Episode, TrajectoryDataset

_ACTION_DEFAULTS: dict[str, Any] = {
    "step": None, "span_id": None, "messages": None, "completion": "", "prompt_token_ids": None,
    "completion_token_ids": None, "completion_logprobs": None, "depends_on": None, "tool_calls": None,
    "tool_errors": 0, "input_tokens": 0, "output_tokens": 0, "latency_s": 0.0, "model": "tiny",
    "adapter_version": "v1",
}


def make_dataset(episodes: list[dict[str, Any]]) -> TrajectoryDataset:
    """`episodes`: dicts with `episode_id`, `actions` (dicts with at least `agent`) and any episode column."""
    ep_rows, act_rows = [], []
    for i, ep in enumerate(episodes):
        actions = ep.get("actions", [])
        ep_rows.append({
            "episode_id": ep["episode_id"],
            "scenario_id": ep.get("scenario_id"),
            "start_time": pd.Timestamp("2026-01-01", tz="UTC") + pd.Timedelta(seconds=i),
            "end_time": pd.Timestamp("2026-01-01", tz="UTC") + pd.Timedelta(seconds=i + 1),
            "n_actions": len(actions),
            "agents": list(dict.fromkeys(a["agent"] for a in actions)),
            "status": ep.get("status", "ok"),
            "outcome": ep.get("outcome"),
            "feedback": ep.get("feedback", {}),
            "metadata": ep.get("metadata", {}),
        })
        for order, a in enumerate(actions):
            row = {**_ACTION_DEFAULTS, **a, "episode_id": ep["episode_id"], "order": order}
            row["span_id"] = row["span_id"] or f"{ep['episode_id']}-{order:04x}"
            row["messages"] = row["messages"] or [{"role": "user", "content": "task"}]
            row["depends_on"] = row["depends_on"] if row["depends_on"] is not None else list(range(order))
            row["tool_calls"] = row["tool_calls"] or []
            act_rows.append(row)
    return TrajectoryDataset(episodes=pd.DataFrame(ep_rows, columns=list(EPISODE_COLUMNS)),
                             actions=pd.DataFrame(act_rows, columns=list(ACTION_COLUMNS)))


def make_episode(actions: list[dict[str, Any]], scenario: dict[str, Any] | None = None, **episode: Any) -> Episode:
    """One `Episode` view, as components receive it."""
    episode.setdefault("episode_id", "e0")
    ds = make_dataset([{**episode, "actions": actions}])
    ep = next(ds.iter_episodes())
    ep.scenario = scenario
    return ep


def tool(name: str, result: str = "ok", error: str | None = None) -> dict[str, Any]:
    """A tool call record as mining writes it."""
    return {"name": name, "args": {}, "id": f"call-{name}", "result": result, "error": error}


def scenario(**fields: Any) -> dict[str, Any]:
    """A scenario dict with the `Scenario` fields."""
    base = {"scenario_id": "s1", "inputs": {"question": "q"}, "reference": None, "expected_tools": [],
            "checkpoints": [], "split": "train", "meta": {}}
    return {**base, **fields}
