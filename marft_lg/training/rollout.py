"""Where on-policy episodes come from: the wrapped LangGraph app (`graph.collect.GraphCollector`, in this process;
`distributed.RayCollector`, on rollout workers), or an in-process chain of agents (tests, benchmarks, quick
experiments) that records the same columns.

A collector has one method, `collect(scenarios, k, iteration, seed) -> TrajectoryDataset`: K
episodes per scenario, with token ids and behaviour log-probs as the engine produced them.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any

import pandas as pd

from marft_lg.graph.collect import EpisodeJob, GraphCollector, episode_id, plan_episodes
from marft_lg.training.protocols import Collector
from marft_lg.trajectories.dataset import TrajectoryDataset
from marft_lg.trajectories.scenarios import Scenario

__all__ = ["ChainCollector", "Collector", "EpisodeJob", "GraphCollector", "episode_id", "plan_episodes"]


PromptFn = Callable[[str, Scenario, list[dict[str, Any]]], list[dict[str, Any]]]


class ChainCollector:
    """Agents act in a fixed order; each sees the scenario and its predecessors' outputs.

    `prompt(role, scenario, previous_actions) -> chat messages` builds every rollout observation.
    Generation is batched over all K x scenarios episodes per role (`policy.generate`).
    """

    def __init__(self, policy: Any, roles: list[str], prompt: PromptFn, *, max_new_tokens: int = 32,
                 temperature: float = 1.0, run_id: str | None = None, outcome: Callable[[list[dict]], Any] | None = None):
        self.policy, self.roles, self.prompt = policy, list(roles), prompt
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.run_id = run_id or "chain"
        self.outcome = outcome

    def collect(self, scenarios: list[Scenario], k: int, iteration: int, seed: int) -> TrajectoryDataset:
        jobs = [(s, j) for s in scenarios for j in range(k)]
        history: list[list[dict[str, Any]]] = [[] for _ in jobs]
        t0 = pd.Timestamp.now(tz="UTC")
        for r_i, role in enumerate(self.roles):
            prompts = [self.prompt(role, s, history[i]) for i, (s, _) in enumerate(jobs)]
            start = time.perf_counter()
            outs = self.policy.generate(role, prompts, max_new_tokens=self.max_new_tokens,
                                        temperature=self.temperature, seed=seed * 1009 + iteration * 31 + r_i)
            latency = (time.perf_counter() - start) / max(1, len(jobs))
            for i, (msgs, out) in enumerate(zip(prompts, outs, strict=True)):
                history[i].append({
                    "agent": role, "order": r_i, "step": 0, "messages": msgs, "completion": out["text"],
                    "prompt_token_ids": out["prompt_token_ids"], "completion_token_ids": out["completion_token_ids"],
                    "completion_logprobs": out["logprobs"], "adapter_version": out.get("adapter_version"),
                    "latency_s": latency})
        episodes, actions = [], []
        for i, (s, j) in enumerate(jobs):
            eid = episode_id(self.run_id, iteration, s.scenario_id, j)
            outcome = self.outcome(history[i]) if self.outcome else {"answer": history[i][-1]["completion"]}
            episodes.append({"episode_id": eid, "scenario_id": s.scenario_id, "start_time": t0 + pd.Timedelta(microseconds=i),
                             "end_time": pd.Timestamp.now(tz="UTC"), "n_actions": len(self.roles),
                             "agents": list(self.roles), "status": "ok", "outcome": json.dumps(outcome),
                             "feedback": {}, "metadata": {"iteration": iteration}})
            for a in history[i]:
                actions.append({"episode_id": eid, "span_id": uuid.uuid4().hex[:16],
                                "depends_on": list(range(a["order"])), "tool_calls": [], "tool_errors": 0,
                                "input_tokens": len(a["prompt_token_ids"]), "output_tokens": len(a["completion_token_ids"]),
                                "model": "local", **a})
        return TrajectoryDataset(episodes=pd.DataFrame(episodes), actions=pd.DataFrame(actions))
