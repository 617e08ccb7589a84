"""Live shadow mirroring: run a sample of live inputs again on a candidate, in the background.

The live caller only pays for a random draw and a non-blocking queue put. Jobs run on daemon
worker threads; a job that raises is counted as failed, one that outlives `timeout_s` is counted as
timed out and abandoned (its thread cannot be killed, so at most `max_abandoned` hung jobs are
tolerated before further mirrors are dropped), and a full queue drops the mirror, never the request.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger("marft_lg.shadow")


@dataclass
class ShadowJob:
    """One mirrored run: `run()` executes it; `on_timeout()` closes its trace when it hangs."""

    pair_id: str
    run: Callable[[], object]
    on_timeout: Callable[[], None] = lambda: None


class ShadowMirror:
    """Bounded background queue + workers that run `ShadowJob`s with isolation and a time limit."""

    def __init__(self, sample_rate: float, *, queue_size: int = 16, timeout_s: float = 120.0, workers: int = 1,
                 max_abandoned: int = 4, seed: int | None = None):
        if not 0.0 <= sample_rate <= 1.0:
            raise ValueError(f"sample_rate must be within [0, 1], got {sample_rate}")
        self.sample_rate = sample_rate
        self.timeout_s = timeout_s
        self.max_abandoned = max_abandoned
        self._rng = random.Random(seed)
        self._rng_lock = threading.Lock()
        self._queue: queue.Queue[ShadowJob | None] = queue.Queue(maxsize=queue_size)
        self._cond = threading.Condition()
        self._pending = 0
        self.stats = {"sampled": 0, "submitted": 0, "completed": 0, "failed": 0, "timed_out": 0, "dropped": 0}
        self.last_error: str | None = None
        self._abandoned = 0
        self._workers = [threading.Thread(target=self._loop, name=f"marft-shadow-{i}", daemon=True) for i in range(workers)]
        for w in self._workers:
            w.start()

    def sample(self) -> bool:
        """Draw whether this request is mirrored."""
        if self.sample_rate <= 0.0:
            return False
        with self._rng_lock:
            hit = self.sample_rate >= 1.0 or self._rng.random() < self.sample_rate
        if hit:
            self._count("sampled")
        return hit

    def submit(self, job: ShadowJob) -> bool:
        """Queue a job without blocking; False (and counted as dropped) when the queue is full."""
        if self._abandoned >= self.max_abandoned:
            self._count("dropped")
            return False
        with self._cond:
            self._pending += 1
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            self._done()
            self._count("dropped")
            return False
        self._count("submitted")
        return True

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every submitted job finished or timed out (tests, shutdown); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending == 0, timeout=timeout)

    def close(self) -> None:
        for _ in self._workers:
            try:
                self._queue.put_nowait(None)
            except queue.Full:
                break

    def _count(self, key: str) -> None:
        with self._cond:
            self.stats[key] += 1

    def _done(self) -> None:
        with self._cond:
            self._pending -= 1
            self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            outcome: dict[str, BaseException] = {}

            def target(job: ShadowJob = job, outcome: dict = outcome) -> None:
                try:
                    job.run()
                except BaseException as err:  # noqa: BLE001 - the shadow's failures stay in the shadow
                    outcome["error"] = err  # noqa: B023 - bound through the default argument

            runner = threading.Thread(target=target, name=f"marft-shadow-job-{job.pair_id[:8]}", daemon=True)
            runner.start()
            runner.join(self.timeout_s)
            if runner.is_alive():
                self._abandoned += 1
                self._count("timed_out")
                self.last_error = f"pair {job.pair_id}: timed out after {self.timeout_s}s"
                try:
                    job.on_timeout()
                except Exception:  # noqa: BLE001
                    logger.exception("marft_lg: closing the trace of a timed-out shadow run failed")
            elif "error" in outcome:
                exc = outcome["error"]
                self._count("failed")
                self.last_error = f"pair {job.pair_id}: {type(exc).__name__}: {exc}"
                if self.stats["failed"] == 1:
                    logger.warning("marft_lg: a shadow (mirrored) run failed: %s; the live answer is unaffected, "
                                   "further failures are only counted (WrappedGraph.shadow_stats)", self.last_error)
            else:
                self._count("completed")
            self._done()
