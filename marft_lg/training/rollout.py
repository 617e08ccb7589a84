"""Where on-policy episodes come from: the wrapped LangGraph app (traced, then mined), or an
in-process chain of agents (tests, benchmarks, quick experiments) that records the same columns.

A collector has one method, `collect(scenarios, k, iteration, seed) -> TrajectoryDataset`: K
episodes per scenario, with token ids and behaviour log-probs as the engine produced them.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import pandas as pd

from marft_lg.trajectories.dataset import TrajectoryDataset
from marft_lg.trajectories.scenarios import Scenario


class Collector(Protocol):
    def collect(self, scenarios: list[Scenario], k: int, iteration: int, seed: int) -> TrajectoryDataset: ...


def episode_id(run_id: str, iteration: int, scenario_id: str, j: int) -> str:
    return f"{run_id}-it{iteration}-{scenario_id}-{j}"


class GraphCollector:
    """Runs K episodes per scenario through a `WrappedGraph` concurrently and reads them back from the app's own span
    records (`WrappedGraph.capture`: no file is read, so an iteration costs the same however many came before; the
    spans still go to the trace files). An app without `capture` is mined from its trace directory instead."""

    def __init__(self, app: Any, *, trace_dir: str | Path | None = None, concurrency: int = 8, run_id: str | None = None):
        self.app = app
        self.trace_dir = Path(trace_dir or getattr(app, "trace_dir", "traces"))
        self.concurrency = concurrency
        self.run_id = run_id or uuid.uuid4().hex[:8]
        self.errors: list[str] = []

    def collect(self, scenarios: list[Scenario], k: int, iteration: int, seed: int) -> TrajectoryDataset:
        jobs = [(s, j) for s in scenarios for j in range(k)]
        ids = [episode_id(self.run_id, iteration, s.scenario_id, j) for s, j in jobs]
        capture = getattr(self.app, "capture", None)
        if capture is None:
            return self._collect_from_files(jobs, ids, iteration, seed)
        with capture() as captured:
            self._run_all(jobs, ids, iteration, seed)
        return captured.dataset(ids)

    def _collect_from_files(self, jobs: list[tuple[Scenario, int]], ids: list[str], iteration: int,
                            seed: int) -> TrajectoryDataset:
        from marft_lg.trajectories.mining import mine

        since = datetime.now(UTC)
        self._run_all(jobs, ids, iteration, seed)
        if hasattr(self.app, "flush"):
            self.app.flush()
        dataset = mine([str(self.trace_dir)], since=since)
        return dataset.select([i for i in ids if i in set(dataset.episode_ids)])

    def _run_all(self, jobs: list[tuple[Scenario, int]], ids: list[str], iteration: int, seed: int) -> None:

        def run(i: int) -> None:
            s, j = jobs[i]
            try:
                self.app.invoke(s.inputs, episode_id=ids[i], scenario_id=s.scenario_id, seed=seed * 1_000_003 + iteration * 10_007 + i)
            except Exception as exc:  # a failed episode is still traced (status error) and scored by the reward
                self.errors.append(f"{ids[i]}: {type(exc).__name__}: {exc}")

        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            list(pool.map(run, range(len(jobs))))


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
