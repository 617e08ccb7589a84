"""`RayCollector`: the trainer's collector when the episodes run on Ray rollout workers.

Each iteration: the workers load the versions the learner serves now (by name from a shared registry, or as the
versions' files through the object store), the planned episodes (`plan_episodes`: the same ids and seeds as in one
process) are dealt out round-robin, and each worker returns its share's trajectories through the object store. A
worker that dies mid-iteration is replaced, the spans its unfinished share left in its trace folder are dropped, and
the share re-runs on the live workers, so the iteration (and the trace folder) holds every planned episode exactly
once. With `async: true` the trainer `prefetch`es iteration k+1's episodes on
the versions it serves before it updates on iteration k's (one step off-policy; PPO ratios stay against the
behaviour log-probs the workers recorded), and each record carries its staleness.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from marft_lg.distributed.config import RayConfig, connect
from marft_lg.distributed.worker import RolloutWorker, WorkerSpec, version_files, worker_trace_dir
from marft_lg.graph.collect import EpisodeFailure, EpisodeJob, check_failures, check_served, plan_episodes
from marft_lg.tracing.reader import drop_episodes
from marft_lg.trajectories.dataset import TrajectoryDataset
from marft_lg.trajectories.scenarios import Scenario

log = logging.getLogger("marft_lg.distributed")
WORKER_KEY = "marft.worker"  # episodes.metadata key: the rollout worker that ran the episode
STALENESS_KEY = "marft.staleness"  # episodes.metadata key: learner updates between its versions and its use


class RayCollector:
    """Runs on-policy episodes on `cfg.rollout_workers` Ray actors (see the module docstring).

    `versions()` returns the {role: version} the learner serves now (the trainer's `Team.versions`); the workers
    load it before each iteration. `progress(text)`, when set, receives "episodes done per worker" as they finish.
    """

    def __init__(self, cfg: RayConfig, spec: WorkerSpec, *, versions: Callable[[], dict[str, str]] | None = None,
                 run_id: str = "ray"):
        if spec.engine is None and cfg.worker.engine != spec.serving:  # the ray: section names the workers' engine
            spec = dataclasses.replace(spec, serving=cfg.worker.engine)
        if not cfg.shared_registry:  # and how versions reach them
            spec = dataclasses.replace(spec, shared_registry=False)
        self.cfg, self.spec, self.run_id = cfg, spec, run_id
        self.versions = versions
        self.progress: Callable[[str], None] | None = None
        self.failures: list[EpisodeFailure] = []
        self.replaced = 0
        self.last_stats: dict[str, Any] = {}
        self._ray: Any = None
        self._actor_cls: Any = None
        self._workers: dict[int, Any] = {}
        self._next_index = 0
        self._loaded: dict[str, str] = {}
        self._served: dict[str, str] = {}  # {role: version} the workers serve now (what their episodes must show)
        self._owns_cluster = False
        self._prefetched: tuple[tuple, _Batch] | None = None

    # -- the pool -----------------------------------------------------------------------------------------------
    def start(self) -> RayCollector:
        """Connect (a `local` address starts a private cluster) and start the workers; returns self."""
        if self._ray is not None:
            return self
        import ray

        self._owns_cluster = self.cfg.address == "local" and not ray.is_initialized()
        self._ray = connect(self.cfg)
        self._actor_cls = ray.remote(RolloutWorker).options(num_cpus=self.cfg.worker.num_cpus,
                                                            num_gpus=self.cfg.worker.num_gpus, max_restarts=0)
        for _ in range(self.cfg.rollout_workers):
            self._spawn()
        self._ray.get([w.ready.remote() for w in self._workers.values()])
        return self

    def _spawn(self) -> int:
        index = self._next_index
        self._next_index += 1
        self._workers[index] = self._actor_cls.remote(self.spec, index)
        return index

    @property
    def workers(self) -> dict[int, Any]:
        """The live worker actors by index (a replaced worker gets a new index)."""
        return dict(self._workers)

    def close(self) -> None:
        """Stop the workers (and the private cluster a `local` address started)."""
        if self._ray is None:
            return
        for w in self._workers.values():
            with contextlib.suppress(Exception):  # a dead worker has nothing left to close
                self._ray.get(w.close.remote(), timeout=30)
            self._ray.kill(w)
        self._workers.clear()
        if self._owns_cluster:
            self._ray.shutdown()
        self._ray = None

    def __enter__(self) -> RayCollector:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- versions -----------------------------------------------------------------------------------------------
    def _sync(self, workers: list[int], *, force: bool = False) -> None:
        """Make `workers` serve the learner's current versions (all of them when the versions changed)."""
        if self.versions is None:
            return
        served = dict(self.versions())
        self._served = served
        current = {r: v for r, v in served.items() if v != "init"}
        if current == self._loaded and not force:
            return
        files = None
        if not self.spec.shared_registry and self.spec.registry is not None:
            files = {}
            for role, version in current.items():
                files.setdefault(role, {})[version] = version_files(self.spec.registry, role, version)
        self._ray.get([self._workers[i].load.remote(current, files) for i in workers])
        self._loaded = current

    # -- one iteration ------------------------------------------------------------------------------------------
    @property
    def async_(self) -> bool:
        """Whether the trainer should `prefetch` the next iteration's episodes before it updates (`async: true`)."""
        return self.cfg.async_

    def collect(self, scenarios: list[Scenario], k: int, iteration: int, seed: int) -> TrajectoryDataset:
        """This iteration's episodes: the ones `prefetch` started during the previous update (one step
        off-policy: staleness 1), else run now (staleness 0)."""
        key = _key(scenarios, k, iteration, seed)
        dataset = None
        if self._prefetched is not None:
            prefetched_key, batch = self._prefetched
            self._prefetched = None
            if prefetched_key == key:
                dataset, jobs = self._gather(batch, staleness=1), batch.jobs
            else:
                log.warning("prefetched episodes were for another iteration; running this one now")
        if dataset is None:
            jobs = plan_episodes(self.run_id, scenarios, k, iteration, seed)
            dataset = self.run(jobs)
        what = f"on-policy iteration {iteration} (Ray rollout workers)"
        check_failures(len(jobs), self.failures, what)
        served = dict(self._served)  # what the workers served while these episodes ran
        check_served(dataset, {j.episode_id: served for j in jobs}, served, what)
        return dataset

    def prefetch(self, scenarios: list[Scenario], k: int, iteration: int, seed: int) -> None:
        """Start iteration `iteration`'s episodes now, on the versions served now; `collect` picks them up."""
        self.start()
        self._sync(list(self._workers))
        self._prefetched = (_key(scenarios, k, iteration, seed),
                            self._submit(plan_episodes(self.run_id, scenarios, k, iteration, seed)))

    def run(self, jobs: list[EpisodeJob]) -> TrajectoryDataset:
        """The jobs' trajectories, each episode run once on some worker (`episodes.metadata` says which)."""
        self.start()
        self._sync(list(self._workers))
        return self._gather(self._submit(jobs), staleness=0)

    def _submit(self, jobs: list[EpisodeJob]) -> _Batch:
        batch = _Batch(jobs, time.perf_counter())
        indices = list(self._workers)
        for n, index in enumerate(indices):
            batch.submit(self._workers, jobs[n::len(indices)], index)
        return batch

    def _gather(self, batch: _Batch, *, staleness: int) -> TrajectoryDataset:
        from ray.exceptions import RayActorError

        done: dict[int, TrajectoryDataset] = {}
        per_worker: dict[int, int] = {}
        failures: list[EpisodeFailure] = []
        while batch.pending:
            ready, _ = self._ray.wait(list(batch.pending), num_returns=1)
            index, share = batch.pending.pop(ready[0])
            try:
                worker, dataset, failed = self._ray.get(ready[0])
            except RayActorError as exc:
                live = self._replace(index, exc, share)
                for n, i in enumerate(live):  # the dead worker's share, dealt out again
                    batch.submit(self._workers, share[n::len(live)], i)
                continue
            done[worker] = _concat([done[worker], dataset]) if worker in done else dataset
            per_worker[worker] = per_worker.get(worker, 0) + len(share)
            failures += failed
            if self.progress is not None:
                self.progress("episodes per worker " + " ".join(f"w{i}:{n}" for i, n in sorted(per_worker.items())))
        self.failures = failures
        dataset = _ordered(done, [j.episode_id for j in batch.jobs], staleness)
        self.last_stats = {"rollout_workers": len(self._workers), "workers_replaced": self.replaced,
                           "episodes_per_worker": {str(i): n for i, n in sorted(per_worker.items())},
                           "staleness_mean": float(staleness), "ray_rollout_s": round(time.perf_counter() - batch.t0, 3)}
        return dataset

    def _replace(self, index: int, exc: BaseException, share: list[EpisodeJob]) -> list[int]:
        """Start a worker in place of the dead one, after dropping the spans its unfinished `share` left in its
        trace folder (their re-runs write whole episodes elsewhere: mining must not join the two); returns the
        live workers' indices."""
        log.warning("rollout worker %d died (%s); starting a replacement and re-running its episodes", index,
                    type(exc).__name__)
        with contextlib.suppress(Exception):  # already dead: make sure it writes nothing more
            self._ray.kill(self._workers[index])
        folder = worker_trace_dir(self.spec, index)
        if folder is not None:
            dropped = drop_episodes(folder, [j.episode_id for j in share])
            log.warning("dropped %d spans of its unfinished episodes from %s", dropped, folder)
        self._workers.pop(index, None)
        self.replaced += 1
        new = self._spawn()
        self._ray.get(self._workers[new].ready.remote())
        if self._loaded:
            self._sync([new], force=True)
        return list(self._workers)


class _Batch:
    """An iteration's episodes in flight: object ref -> (worker index, its share of the jobs)."""

    def __init__(self, jobs: list[EpisodeJob], t0: float):
        self.jobs, self.t0 = jobs, t0
        self.pending: dict[Any, tuple[int, list[EpisodeJob]]] = {}

    def submit(self, workers: dict[int, Any], share: list[EpisodeJob], index: int) -> None:
        if share:
            self.pending[workers[index].run.remote(share)] = (index, share)


def _key(scenarios: list[Scenario], k: int, iteration: int, seed: int) -> tuple:
    return tuple(s.scenario_id for s in scenarios), k, iteration, seed


def _concat(parts: list[TrajectoryDataset]) -> TrajectoryDataset:
    return TrajectoryDataset.concat([p for p in parts if len(p.episodes)])


def _ordered(by_worker: dict[int, TrajectoryDataset], ids: list[str], staleness: int) -> TrajectoryDataset:
    """One dataset of the planned episodes, each tagged with the worker that ran it and its staleness (learner
    updates between the versions that produced it and the update it feeds), in the order one process mines them."""
    tagged = []
    for index, ds in by_worker.items():
        if not len(ds.episodes):
            continue
        episodes = ds.episodes.copy()
        episodes["metadata"] = [{**(m if isinstance(m, dict) else {}), WORKER_KEY: index, STALENESS_KEY: staleness}
                                for m in episodes["metadata"]]
        tagged.append(TrajectoryDataset(episodes=episodes, actions=ds.actions))
    merged = _concat(tagged)
    if not len(merged.episodes):
        return merged
    merged = merged.select(ids)
    return TrajectoryDataset(
        episodes=merged.episodes.sort_values("episode_id", kind="stable").reset_index(drop=True),
        actions=merged.actions.sort_values("episode_id", kind="stable").reset_index(drop=True))
