"""Running planned on-policy episodes through a wrapped LangGraph app and reading them back as trajectories: the
in-process collector the trainer uses, and what each Ray rollout worker runs (`marft_lg.distributed`)."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from marft_lg.trajectories.dataset import TrajectoryDataset
from marft_lg.trajectories.scenarios import Scenario


def episode_id(run_id: str, iteration: int, scenario_id: str, j: int) -> str:
    return f"{run_id}-it{iteration}-{scenario_id}-{j}"


@dataclass(frozen=True)
class EpisodeJob:
    """One episode to run: its scenario, id and seed; for a comparison's replays also pinned adapter versions and
    run metadata."""

    scenario: Scenario
    episode_id: str
    seed: int
    versions: dict[str, str] | None = None
    metadata: dict[str, Any] | None = None


def plan_episodes(run_id: str, scenarios: list[Scenario], k: int, iteration: int, seed: int) -> list[EpisodeJob]:
    """K episodes per scenario, each with its id and seed: the same plan whichever process or worker runs them, so
    the same seeds give the same episodes in one process and on a cluster."""
    pairs = [(s, j) for s in scenarios for j in range(k)]
    return [EpisodeJob(s, episode_id(run_id, iteration, s.scenario_id, j), seed * 1_000_003 + iteration * 10_007 + i)
            for i, (s, j) in enumerate(pairs)]


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
        return self.run(plan_episodes(self.run_id, scenarios, k, iteration, seed))

    def run(self, jobs: list[EpisodeJob]) -> TrajectoryDataset:
        """Run the planned episodes (up to `concurrency` at once) and return their trajectories (in mining order: by episode)."""
        ids = [j.episode_id for j in jobs]
        capture = getattr(self.app, "capture", None)
        if capture is None:
            from marft_lg.trajectories.mining import mine

            since = datetime.now(UTC)
            self._run_all(jobs)
            if hasattr(self.app, "flush"):
                self.app.flush()
            return mine([str(self.trace_dir)], since=since).select(ids)
        with capture() as captured:
            self._run_all(jobs)
        return captured.dataset(ids)

    def _run_all(self, jobs: list[EpisodeJob]) -> None:
        def run(job: EpisodeJob) -> None:
            extra: dict[str, Any] = {} if job.versions is None else {"versions": dict(job.versions)}
            if job.metadata is not None:
                extra["metadata"] = dict(job.metadata)
            try:
                self.app.invoke(job.scenario.inputs, episode_id=job.episode_id, scenario_id=job.scenario.scenario_id,
                                seed=job.seed, **extra)
            except Exception as exc:  # a failed episode is still traced (status error) and scored by the reward
                self.errors.append(f"{job.episode_id}: {type(exc).__name__}: {exc}")

        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            list(pool.map(run, jobs))
