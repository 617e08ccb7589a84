"""The one episode runner: planned episodes through a wrapped LangGraph app, read back as trajectories. The trainer's
on-policy phase, a comparison's replays and each Ray rollout worker all run their episodes here.

Failures are typed records (`EpisodeFailure`); an episode that ran into LangGraph's recursion limit
(`wrap(..., recursion_limit=)`) is not one: it is kept as a truncated episode (traced, scored, trained on) and its id
listed in `GraphCollector.truncated`. An episode that stops at `interrupt()` is resumed on its thread with the app's
`ResumePolicy` (`wrap(..., resume=)`) until it ends; without one, or past the policy's `max_resumes`, it stays paused
and is listed in `GraphCollector.paused`. Two checks guard what a batch of episodes may be used for:
`check_failures` (a batch where fewer than half of the episodes succeeded is an error showing the first ones) and
`check_served` (every action of a served role must come from the adapter version the episode asked for, or the
app's calls did not reach the team under test).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from marft_lg.trajectories.dataset import TrajectoryDataset
from marft_lg.trajectories.scenarios import Scenario

logger = logging.getLogger("marft_lg.graph")


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
    replay: Any = None
    """A `serving.replay.ReplayPlan`: the episode re-runs a recorded one with one step resampled."""


@dataclass(frozen=True)
class EpisodeFailure:
    """An episode whose run raised: which one, and the exception as ``Type: message``."""

    episode_id: str
    scenario_id: str | None
    error: str

    @classmethod
    def of(cls, job: EpisodeJob, exc: BaseException) -> EpisodeFailure:
        return cls(job.episode_id, job.scenario.scenario_id, f"{type(exc).__name__}: {exc}")

    def __str__(self) -> str:
        return f"{self.episode_id}: {self.error}"


class RolloutError(RuntimeError):
    """The episodes of a batch cannot be used: most of them failed, or they were not served by the versions under
    test. `failures` holds the episodes that raised."""

    def __init__(self, message: str, failures: Iterable[EpisodeFailure] = ()):
        super().__init__(message)
        self.failures = list(failures)


def check_failures(planned: int, failures: list[EpisodeFailure], what: str) -> None:
    """Raise `RolloutError` when fewer than half of `planned` episodes succeeded, showing the first errors."""
    if not failures or 2 * len(failures) <= planned:
        return
    shown = "\n  ".join(str(f) for f in failures[:3])
    raise RolloutError(f"{what}: {len(failures)} of {planned} episodes failed; the first errors:\n  {shown}", failures)


def check_served(dataset: TrajectoryDataset, expected: Mapping[str, Mapping[str, str]], roles: Iterable[str],
                 what: str) -> None:
    """Every action of a served role in episode `e` must have been answered by ``expected[e][role]``; otherwise the
    app's calls went elsewhere (a `ChatOpenAI` asking for a model that is not a role, a URL nobody redirected) and
    the batch says nothing about the versions under test: `RolloutError` naming the first mismatches."""
    roles = set(roles)
    actions = dataset.actions
    if actions.empty or not roles:
        return
    wrong = []
    for eid, agent, version in zip(actions["episode_id"], actions["agent"], actions["adapter_version"], strict=True):
        want = expected.get(eid, {}).get(agent) if agent in roles else None
        version = version if isinstance(version, str) and version else None  # pandas gives NaN for "no version"
        if want is not None and version != want:
            wrong.append((eid, agent, version, want))
    if not wrong:
        return
    first = "; ".join(f"{e}: {a} answered by {v or 'nothing the team served'}, expected {w}" for e, a, v, w in wrong[:3])
    raise RolloutError(
        f"{what}: {len(wrong)} of {len(actions)} actions of the team's roles were not answered by the versions under "
        f"test ({first}). The app's LLM calls did not reach the served team: a ChatOpenAI / openai client must ask "
        f"for model='<role>' (the team serves {sorted(roles)}), and a TeamChatModel must be the team's")


def plan_episodes(run_id: str, scenarios: list[Scenario], k: int, iteration: int, seed: int) -> list[EpisodeJob]:
    """K episodes per scenario, each with its id and seed: the same plan whichever process or worker runs them, so
    the same seeds give the same episodes in one process and on a cluster."""
    pairs = [(s, j) for s in scenarios for j in range(k)]
    return [EpisodeJob(s, episode_id(run_id, iteration, s.scenario_id, j), seed * 1_000_003 + iteration * 10_007 + i)
            for i, (s, j) in enumerate(pairs)]


class GraphCollector:
    """Runs episodes through a `WrappedGraph` concurrently and reads them back from the app's own span records
    (`WrappedGraph.capture`: no file is read, so an iteration costs the same however many came before; the spans
    still go to the trace files). An app without `capture` is mined from its trace directory instead.

    `collect` (the trainer's call) runs K episodes per scenario on the versions the app's team serves and checks
    the batch (`check_failures`, `check_served`); `run` runs any planned jobs and leaves judging them to the caller.
    `failures` holds the episodes of the last call that raised, `truncated` the ids of those that stopped at the
    app's recursion limit.
    """

    def __init__(self, app: Any, *, trace_dir: str | Path | None = None, concurrency: int = 8, run_id: str | None = None,
                 progress: Callable[[], None] | None = None,
                 read_back: Callable[[list[str]], TrajectoryDataset] | None = None):
        self.app = app
        self.read_back = read_back  # how the episodes are read back instead (a test double's own records)
        self.trace_dir = Path(trace_dir or getattr(app, "trace_dir", "traces"))
        self.concurrency = concurrency
        self.run_id = run_id or uuid.uuid4().hex[:8]
        self.failures: list[EpisodeFailure] = []
        self.truncated: list[str] = []
        self.paused: list[str] = []
        self.resumes = 0
        self.progress = progress  # called with no argument after each episode, when set
        self._lock = threading.Lock()

    def collect(self, scenarios: list[Scenario], k: int, iteration: int, seed: int) -> TrajectoryDataset:
        jobs = plan_episodes(self.run_id, scenarios, k, iteration, seed)
        team = getattr(self.app, "team", None)
        versions = dict(team.versions()) if team is not None else {}
        dataset = self.run(jobs)
        check_failures(len(jobs), self.failures, f"on-policy iteration {iteration}")
        dataset = self.without_paused(dataset, len(jobs), f"on-policy iteration {iteration}")
        if team is not None:
            check_served(dataset, {j.episode_id: versions for j in jobs}, team.agents(),
                         f"on-policy iteration {iteration}")
        return dataset

    def run(self, jobs: list[EpisodeJob]) -> TrajectoryDataset:
        """Run the planned episodes (up to `concurrency` at once) and return their trajectories (in mining order: by
        episode); the ones that raised are in `failures`."""
        ids = [j.episode_id for j in jobs]
        capture = getattr(self.app, "capture", None)
        if self.read_back is not None:
            self.execute(jobs)
            return self.read_back(ids)
        if capture is None:
            from marft_lg.trajectories.mining import mine

            since = datetime.now(UTC)
            self.execute(jobs)
            if hasattr(self.app, "flush"):
                self.app.flush()
            return mine([str(self.trace_dir)], since=since).select(ids)
        with capture() as captured:
            self.execute(jobs)
        return captured.dataset(ids)

    def execute(self, jobs: list[EpisodeJob]) -> None:
        """Run the planned episodes (up to `concurrency` at once) without reading them back, for a caller whose
        product is the traces (`marft-lg run`); `failures`, `truncated`, `paused` and `resumes` say how they ended."""
        self.failures, self.truncated, self.paused, self.resumes = [], [], [], 0
        # imported here: the training code imports this module on GPU machines without LangGraph (test_device_bare.py)
        from langgraph.errors import GraphRecursionError

        def run(job: EpisodeJob) -> None:
            extra: dict[str, Any] = {} if job.versions is None else {"versions": dict(job.versions)}
            if job.metadata is not None:
                extra["metadata"] = dict(job.metadata)
            try:
                if job.replay is not None:
                    self.app.replay(job.replay, job.scenario.inputs, episode_id=job.episode_id,
                                    scenario_id=job.scenario.scenario_id, seed=job.seed, **extra)
                else:
                    self.app.invoke(job.scenario.inputs, episode_id=job.episode_id,
                                    scenario_id=job.scenario.scenario_id, seed=job.seed, **extra)
                self._resume(job, extra)
            except GraphRecursionError:  # the step cap ended it: a truncated episode, as traced so far
                self.truncated.append(job.episode_id)
            except Exception as exc:  # a failed episode is still traced (status error) and scored by the reward
                self.failures.append(EpisodeFailure.of(job, exc))
            if self.progress is not None:
                self.progress()

        with ThreadPoolExecutor(max_workers=max(1, self.concurrency)) as pool:
            list(pool.map(run, jobs))

    def without_paused(self, dataset: TrajectoryDataset, planned: int, what: str) -> TrajectoryDataset:
        """`dataset` less the episodes still paused at an interrupt (unfinished: nothing to score). Without a resume
        policy, or when more than half of the `planned` episodes stayed paused, a `RolloutError` says how to resume."""
        if not self.paused:
            return dataset
        policy = getattr(self.app, "resume", None)
        if policy is None or 2 * len(self.paused) > planned:
            how = ("no resume policy was given: set one (train.yaml online.resume / job.yaml resume: {value: ...} "
                   "or {call: module:function}; --resume-value / --resume-with on the commands; wrap(..., resume=))"
                   if policy is None else f"they were still paused after {policy.max_resumes} resumes")
            raise RolloutError(f"{what}: {len(self.paused)} of {planned} episodes stopped at an interrupt() and were "
                               f"never finished ({how}); first: {', '.join(self.paused[:3])}")
        logger.warning("%s: %d of %d episodes were still paused at an interrupt after %d resumes and are left out "
                       "(first: %s)", what, len(self.paused), planned, policy.max_resumes, ", ".join(self.paused[:3]))
        paused = set(self.paused)
        return dataset.select([e for e in dataset.episodes["episode_id"] if e not in paused])

    def _resume(self, job: EpisodeJob, extra: dict[str, Any]) -> None:
        """Answer the interrupts episode `job` stopped at with the app's resume policy, on its thread, until it ends;
        an episode left paused (no policy, or past its `max_resumes`) goes to `paused`."""
        interrupted = getattr(self.app, "interrupted", None)
        if interrupted is None:
            return
        policy, done = getattr(self.app, "resume", None), 0
        while (pending := interrupted(job.episode_id)) is not None:
            if policy is None or done >= policy.max_resumes:
                with self._lock:
                    self.paused.append(job.episode_id)
                return
            self.app.invoke(policy.command(pending), episode_id=job.episode_id, scenario_id=job.scenario.scenario_id,
                            seed=job.seed, **extra)
            done += 1
            with self._lock:
                self.resumes += 1
