"""One retraining run: lock -> mine since the watermark -> train -> shadow compare -> promote or reject
-> record -> advance the watermark.

The work itself is done by a `RetrainStages` object (the real one calls mining, the MARFT trainer,
shadow compare and the adapter registry; tests inject crashing or slow ones). Crash safety comes
from the order of effects, not from cleanup code:
- candidates are written as new registry versions; what serves changes only through the
  registry's atomic `live` alias flip in `promote`, the last stage;
- the watermark moves in the same SQLite transaction that records the run's success;
- a run killed at any point leaves its `running` record and its lock file; the next run finds the
  lock stale, marks that record `crashed` and redoes the same window.
"""

from __future__ import annotations

import os
import signal
import socket
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from marft_lg._durable import write_atomic
from marft_lg.jobs import store as st
from marft_lg.jobs.config import RetrainJob
from marft_lg.jobs.lock import LockHeld, RunLock
from marft_lg.jobs.store import JobStore, RunRecord
from marft_lg.jobs.watermark import Window, format_time, hold_unsettled, parse_time, select_window, window_for
from marft_lg.tracking.base import NullTracker, Tracker, flat_metrics, open_tracker
from marft_lg.trajectories.dataset import TrajectoryDataset


@dataclass
class RunContext:
    """What every stage gets: the job, this run's id and private folder, its window, a logger."""

    job: RetrainJob
    run_id: str
    run_dir: Path
    window: Window
    log: Callable[[str], None] = print
    tracker: Tracker = field(default_factory=NullTracker)
    """The run's parent run in the job's trackers (`report_to`); stages log into children of it."""


@dataclass
class Comparison:
    """Outcome of the shadow comparison plus the gate's decision."""

    passed: bool
    reasons: list[str] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    report_path: str | None = None


@runtime_checkable
class RetrainStages(Protocol):
    """The swappable work of a run. Only `promote` may change what serves."""

    def live_versions(self, ctx: RunContext) -> dict[str, str]:
        """The `{role: version}` serving now: the baseline and the starting point of training."""

    def mine(self, ctx: RunContext, since: datetime | None) -> TrajectoryDataset:
        """Episodes from the job's trace sources that ended after `since` (None = all); a superset is fine."""

    def train(self, ctx: RunContext, dataset: TrajectoryDataset, baseline: dict[str, str]) -> dict[str, str]:
        """Train from `baseline` on `dataset`; save candidates as NEW registry versions; return them."""

    def compare(self, ctx: RunContext, baseline: dict[str, str], candidate: dict[str, str]) -> Comparison:
        """Shadow-compare candidate vs baseline and apply the promotion gate."""

    def promote(self, ctx: RunContext, candidate: dict[str, str], reason: str) -> dict[str, str]:
        """Atomically point `live` at the candidate; return the new live map."""


class Interrupted(BaseException):
    """SIGTERM arrived during a run (the run is recorded `interrupted`, its lock released)."""


@dataclass
class RunResult:
    """What `run_once` did, for the CLI and the scheduler."""

    status: str
    message: str
    record: RunRecord | None = None
    crashed: list[RunRecord] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status in (st.PROMOTED, st.REJECTED, st.SKIPPED)


STAGE_METHODS = ("live_versions", "mine", "train", "compare", "promote")


def load_stages(job: RetrainJob) -> RetrainStages:
    """Instantiate `job.stages` (`module:Class` or `file.py:Class`, relative to job.yaml, constructed with the
    job) and check that the object has the `RetrainStages` methods. Anything wrong raises `LoadError` (a
    ConfigError, so a ValueError) naming job.yaml's `stages` line."""
    from marft_lg._config import ConfigError
    from marft_lg.loading import LoadError, load_object

    source = job.where("stages")
    where = f"{source}: " if source else ""
    factory = load_object(job.stages, base_dir=job.base_dir, what="stages", source=source)
    if not callable(factory):
        raise LoadError(f"{where}stages {job.stages!r} is a {type(factory).__name__}, not a class (or function) "
                        "that takes the job and returns the stages", spec=job.stages, source=source,
                        missing="attribute")
    try:
        stages = factory(job)
    except ConfigError:
        raise
    except Exception as exc:
        raise LoadError(f"{where}cannot build stages {job.stages!r}: calling it with the job raised "
                        f"{type(exc).__name__}: {exc}", spec=job.stages, source=source, missing="import") from exc
    missing = [m for m in STAGE_METHODS if not callable(getattr(stages, m, None))]
    if missing:
        raise LoadError(f"{where}stages {job.stages!r} gave a {type(stages).__name__} without the RetrainStages "
                        f"method(s) {missing}; a stages class needs {list(STAGE_METHODS)} (see docs/jobs.md)",
                        spec=job.stages, source=source, missing="attribute")
    return stages


class RecoveryPending(RuntimeError):
    """A dead run's record cannot be settled now (the live versions cannot be read); it stays `running`, and
    this run does not start, so that run's window is neither lost nor trained twice."""


def new_run_id(job: RetrainJob, now: datetime) -> str:
    return f"{job.name}-{now.astimezone(UTC).strftime('%Y%m%dT%H%M%SZ')}-{uuid.uuid4().hex[:6]}"


def run_once(job: RetrainJob, *, stages: RetrainStages | None = None, now: datetime | None = None,
             log: Callable[[str], None] = print, handle_sigterm: bool = False) -> RunResult:
    """Run the job once. Raises `LockHeld` when another live run holds the job's lock.

    `now` fixes the run's clock (the window end is `now - settle_s`); `handle_sigterm` turns
    SIGTERM into a recorded `interrupted` run (use it in a process that owns its signals).
    """
    now = now or datetime.now(UTC)
    store = JobStore(job.store_path)
    run_id = new_run_id(job, now)
    lock = RunLock(job.lock_path, stale_after_s=job.lock_stale_after_s, run_id=run_id)
    lock.acquire()
    try:
        if lock.broken is not None:
            log(f"found a stale lock from {lock.broken.describe()}: that run did not finish")
        # Runs left `running` are dead (we hold the lock). One that never recorded a candidate is settled as
        # `crashed` at once; one that did may have promoted it, which only the stages can tell (what `live`
        # serves): it is settled after they load, and if loading them (or reading live) fails it stays `running`
        # for the next run, so "promoted, then died before recording it" is never turned into a plain crash.
        dead = store.running_runs(job.name)
        settled = {r.run_id: _recover(r, job, store, None, log) for r in dead if not _may_have_promoted(r)}
        owned = stages is None
        stages = stages or load_stages(job)
        try:
            for r in dead:
                if r.run_id not in settled:
                    settled[r.run_id] = _recover(r, job, store, stages, log)
            crashed = [settled[r.run_id] for r in dead]
            result = _run_locked(job, store, stages, run_id, now, log, handle_sigterm)
        finally:
            close = getattr(stages, "close", None)
            if owned and callable(close):
                close()
        result.crashed = crashed
        return result
    finally:
        lock.release()


def _may_have_promoted(record: RunRecord) -> bool:
    """A dead run that recorded a new candidate and its window: it may have flipped `live` before dying."""
    return bool(record.candidate) and record.candidate != record.baseline and bool(record.window_end)


def _recover(record: RunRecord, job: RetrainJob, store: JobStore, stages: RetrainStages | None,
             log: Callable[[str], None]) -> RunRecord:
    """Settle a dead run's record. A run whose recorded candidate is what `live` serves had promoted before it
    died: its record is completed as `promoted` and the watermark advanced (one transaction), so its window is
    not trained twice. Any other dead run is recorded `crashed` and its window redone. When `live` cannot be
    read, `RecoveryPending` is raised and the record stays `running`."""
    promoted = _may_have_promoted(record)
    live: dict[str, str] = {}
    if promoted:
        assert stages is not None, "a run that may have promoted is settled with the stages"
        ctx = RunContext(job=job, run_id=record.run_id, run_dir=Path(record.run_dir or job.output_dir),
                         window=Window(parse_time(record.window_start), parse_time(record.window_end)), log=log)
        try:
            live = stages.live_versions(ctx)
        except Exception as exc:
            raise RecoveryPending(
                f"run {record.run_id} stopped without finishing and had a candidate {record.candidate}; whether it "
                f"was promoted cannot be checked, since reading the live versions failed ({type(exc).__name__}: "
                f"{exc}). Its record stays 'running' and the next run checks again; this run did not start"
            ) from exc
        promoted = all(live.get(role) == version for role, version in record.candidate.items())
    if not promoted:
        log(f"run {record.run_id} was left 'running' and is now marked 'crashed'; its window will be redone")
        return store.close_crashed(record.run_id, "run stopped without finishing; detected by the next run")
    message = f"promoted {record.candidate}, then stopped before recording it; completed by the next run"
    log(f"run {record.run_id} {message}")
    return store.finish_run(record.run_id, st.PROMOTED, advance_watermark_to=record.window_end, message=message,
                            live_after=live)


def _run_locked(job: RetrainJob, store: JobStore, stages: RetrainStages, run_id: str, now: datetime,
                log: Callable[[str], None], handle_sigterm: bool) -> RunResult:
    run_dir = Path(job.output_dir) / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    store.start_run(run_id, job.name, pid=os.getpid(), hostname=socket.gethostname(), run_dir=str(run_dir))
    window = window_for(store.watermark(job.name), now, settle_s=job.settle_s, initial=job.initial_watermark)
    store.update_run(run_id, window_start=format_time(window.start) if window.start else None,
                     window_end=format_time(window.end))
    ctx = RunContext(job=job, run_id=run_id, run_dir=run_dir, window=window, log=log,
                     tracker=_job_tracker(job, run_id, run_dir, window))
    guard = _SigtermGuard()
    previous = signal.signal(signal.SIGTERM, guard.on_term) if handle_sigterm else None
    try:
        result = _stages(ctx, store, stages, guard)
    except Interrupted:
        message = "interrupted by SIGTERM; live adapters and watermark unchanged"
        result = RunResult(st.INTERRUPTED, message, store.finish_run(run_id, st.INTERRUPTED, message=message))
    except Exception as exc:
        write_atomic(run_dir / "error.txt", traceback.format_exc())
        message = f"{type(exc).__name__}: {exc} (traceback in {run_dir / 'error.txt'}); live adapters and watermark unchanged"
        result = RunResult(st.FAILED, message, store.finish_run(run_id, st.FAILED, message=message))
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    record = result.record
    if record is not None:
        ctx.tracker.log_metrics(flat_metrics({"n_episodes": record.n_episodes, **(record.metrics or {})}), 0)
    ctx.tracker.log_text(f"{result.status}: {result.message}", "outcome.txt")
    ctx.tracker.finish("KILLED" if result.status == st.INTERRUPTED else "FINISHED" if result.ok else "FAILED")
    return result


def _job_tracker(job: RetrainJob, run_id: str, run_dir: Path, window: Window) -> Tracker:
    """The run's parent run in the job's trackers: the job's settings as params, its window as the data window of
    every adapter it publishes; MLflow's store is shared by the job's runs (`tracking_uri`, else
    ``MLFLOW_TRACKING_URI``, else `<output_dir>/mlflow.db`)."""
    if not job.report_to:
        return NullTracker()
    from marft_lg.tracking.mlflow_backend import tracking_uri

    uri = tracking_uri(job.tracking_uri, Path(job.output_dir)) if "mlflow" in job.report_to else None
    params = {k: v for k, v in job.to_dict().items() if k not in ("ray",)}
    window_dict = {"start": format_time(window.start) if window.start else None, "end": format_time(window.end),
                   "watermark": format_time(window.start) if window.start else None}
    return open_tracker(job.report_to, run_dir, name=run_id, params=params, uri=uri, experiment=job.experiment,
                        tags={"marft.job": job.name}, context={"data_window": window_dict})


def _stages(ctx: RunContext, store: JobStore, stages: RetrainStages, guard: _SigtermGuard) -> RunResult:
    job, run_id, window = ctx.job, ctx.run_id, ctx.window
    if window.empty:
        message = f"nothing to do: the window {window.describe()} is empty (watermark is ahead of now - settle_s)"
        return RunResult(st.SKIPPED, message, store.finish_run(run_id, st.SKIPPED, message=message, n_episodes=0))

    ctx.log(f"[{run_id}] mining {window.describe()}")
    mined = stages.mine(ctx, window.start)
    settled = hold_unsettled(mined, window, wait_s=job.unsettled_wait_s)
    if settled != window:  # the record too, so that a crashed run's recovery advances no further
        window = settled
        store.update_run(run_id, window_end=format_time(window.end))
        ctx.log(f"[{run_id}] an episode still waits for a server record of one of its calls: this run's window ends "
                f"at {format_time(window.end)}, before it; the next run mines it")
    dataset = select_window(mined, window)
    n = len(dataset)
    store.update_run(run_id, n_episodes=n)
    if n < job.min_new_episodes:
        message = (f"{n} new episode(s) in the window, fewer than min_new_episodes={job.min_new_episodes}; "
                   "watermark unchanged, they count toward the next run")
        return RunResult(st.SKIPPED, message, store.finish_run(run_id, st.SKIPPED, message=message))
    dataset.to_parquet(ctx.run_dir / "dataset")

    baseline = stages.live_versions(ctx)
    store.update_run(run_id, baseline=baseline)
    ctx.log(f"[{run_id}] training on {n} episode(s) from live {baseline}")
    candidate = stages.train(ctx, dataset, baseline)
    store.update_run(run_id, candidate=candidate)

    ctx.log(f"[{run_id}] shadow compare {baseline} -> {candidate}")
    comparison = stages.compare(ctx, baseline, candidate)
    metrics = {**comparison.metrics, "gate_passed": comparison.passed, "gate_reasons": comparison.reasons}
    store.update_run(run_id, metrics=metrics, report_path=comparison.report_path)

    watermark = format_time(window.end)
    guard.finishing()  # from here on the run completes: a SIGTERM cannot split promotion from its record
    live_now = stages.live_versions(ctx) if comparison.passed else baseline
    if comparison.passed and live_now != baseline:
        comparison.passed = False
        comparison.reasons.append(f"live changed during the run ({baseline} -> {live_now}); not promoting over it")
    if comparison.passed:
        from marft_lg.evaluation.promotion import ServerNotConfirmed

        try:
            live_after = stages.promote(ctx, candidate, reason=f"retrain run {run_id}: gate passed")
            message = f"promoted {candidate} (was {baseline})"
        except ServerNotConfirmed as exc:  # the alias moved and was recorded: the run promoted, the server is unknown
            live_after = {r: v for r, v in exc.record.after.items() if r in candidate}
            message = f"promoted {candidate} (was {baseline}); the server did not confirm the swap: {exc}"
        record = store.finish_run(run_id, st.PROMOTED, advance_watermark_to=watermark, message=message,
                                  live_after=live_after)
        return RunResult(st.PROMOTED, message, record)
    why = "; ".join(comparison.reasons) or "gate failed"
    message = f"{why}; live stays {live_now}"
    metrics = {**metrics, "gate_passed": False, "gate_reasons": comparison.reasons}
    record = store.finish_run(run_id, st.REJECTED, message=message, live_after=live_now, metrics=metrics,
                              advance_watermark_to=watermark if job.advance_on_reject else None)
    return RunResult(st.REJECTED, message, record)


class _SigtermGuard:
    """SIGTERM raises `Interrupted` until the run starts finishing (promote + record); after that it is
    ignored, since finishing takes seconds and stopping halfway would leave live and record out of step."""

    def __init__(self) -> None:
        self._finishing = False

    def finishing(self) -> None:
        self._finishing = True

    def on_term(self, signum, frame) -> None:
        if not self._finishing:
            raise Interrupted()


__all__ = [
    "Comparison",
    "Interrupted",
    "LockHeld",
    "RecoveryPending",
    "RetrainStages",
    "RunContext",
    "RunResult",
    "load_stages",
    "run_once",
]
