"""CLI commands for marft_lg.jobs (registered in marft_lg/cli.py). Keep top-level imports light."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import typer

EXIT_FAILED = 1
EXIT_BAD_JOB = 2
EXIT_LOCKED = 3

JobOption = typer.Option(..., "--job", "-j", help="Path to job.yaml.", exists=True, dir_okay=False)


def _load_job(path: Path):
    """job.yaml loaded and checked; any problem is printed (file:line: key: problem) and exits 2."""
    from marft_lg.jobs.config import RetrainJob

    try:
        return RetrainJob.from_yaml(path)
    except (ValueError, OSError) as exc:  # ConfigError / ConfigNotFound, and anything unreadable
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_BAD_JOB) from None


def retrain(job: Path = JobOption) -> None:
    """Run the job once: mine since the watermark, train from live, shadow-compare, promote or reject, record.

    Exit codes: 0 promoted / rejected / skipped; 1 the run failed or was interrupted (recorded, nothing
    changed); 2 bad job file; 3 another run holds the lock.
    """
    from rich.console import Console

    from marft_lg.jobs.lock import LockHeld
    from marft_lg.jobs.pipeline import RecoveryPending, run_once

    console = Console(stderr=True)
    spec = _load_job(job)
    try:
        result = run_once(spec, log=lambda m: console.print(m, markup=False, highlight=False), handle_sigterm=True)
    except LockHeld as exc:
        typer.echo(f"not started: {exc}", err=True)
        raise typer.Exit(EXIT_LOCKED) from None
    except RecoveryPending as exc:
        typer.echo(f"not started: {exc}", err=True)
        raise typer.Exit(EXIT_FAILED) from None
    except (ValueError, FileNotFoundError) as exc:  # the stages, the app or a file the job names
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_BAD_JOB) from None
    run = result.record.run_id if result.record else "-"
    typer.echo(f"{result.status}: {result.message} (run {run})")
    if not result.ok:
        raise typer.Exit(EXIT_FAILED)


def schedule(job: Path = JobOption) -> None:
    """Run the job on its cron `schedule` until SIGTERM/SIGINT (a running retrain is stopped gracefully)."""
    from marft_lg.jobs.scheduler import RetrainScheduler

    spec = _load_job(job)
    try:
        sched = RetrainScheduler(spec, job_path=job.resolve(), log=lambda m: typer.echo(m, err=True))
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_BAD_JOB) from None
    sched.serve_forever()


jobs_app = typer.Typer(help="Inspect recorded retraining runs.", no_args_is_help=True)

StoreOption = typer.Option(None, "--job", "-j", help="job.yaml whose run store to read.", dir_okay=False)
DbOption = typer.Option(None, "--store", help="The SQLite job store itself (instead of --job).", dir_okay=False)


def _open_store(job: Path | None, store: Path | None):
    from marft_lg.jobs.store import JobStore, NotAJobStore

    if store is None and job is None:
        typer.echo("error: give --job job.yaml or --store jobs.sqlite", err=True)
        raise typer.Exit(EXIT_BAD_JOB)
    if store is None:
        spec = _load_job(job)
        store, name = spec.store_path, spec.name
    else:
        name = None
    if not Path(store).exists():
        typer.echo(f"error: no job store at {store} (no run recorded yet?)", err=True)
        raise typer.Exit(EXIT_BAD_JOB)
    try:
        return JobStore(store, foreign_ok=False), name
    except NotAJobStore as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_BAD_JOB) from None
    except sqlite3.DatabaseError as exc:  # a file that is not SQLite, or a damaged one
        typer.echo(f"error: {store} is not a job store (SQLite database): {exc}", err=True)
        raise typer.Exit(EXIT_BAD_JOB) from None


@jobs_app.command("list")
def jobs_list(job: Path | None = StoreOption, store: Path | None = DbOption,
              limit: int = typer.Option(20, help="Show at most this many runs, newest first."),
              as_json: bool = typer.Option(False, "--json", help="Print JSON lines instead of a table.")) -> None:
    """List recorded runs, newest first."""
    from dataclasses import asdict

    from rich.console import Console
    from rich.table import Table

    db, name = _open_store(job, store)
    runs = db.runs(job=name, limit=limit)
    if as_json:
        for r in runs:
            typer.echo(json.dumps(asdict(r)))
        return
    table = Table("run id", "status", "started", "ended", "episodes", "candidate", "message")
    for r in runs:
        table.add_row(r.run_id, r.status, r.started_at, r.ended_at or "", str(r.n_episodes if r.n_episodes is not None else ""),
                      json.dumps(r.candidate) if r.candidate else "", (r.message or "")[:80])
    Console().print(table)
    if name is not None:
        typer.echo(f"watermark: {db.watermark(name) or '(none: the next run mines from the beginning)'}")


@jobs_app.command("show")
def jobs_show(run_id: str, job: Path | None = StoreOption, store: Path | None = DbOption) -> None:
    """Show one run: status, window, adapter versions, metrics, report path (as JSON)."""
    from dataclasses import asdict

    db, _ = _open_store(job, store)
    try:
        record = db.get(run_id)
    except KeyError as exc:
        typer.echo(f"error: {exc.args[0]}", err=True)
        raise typer.Exit(EXIT_BAD_JOB) from None
    typer.echo(json.dumps(asdict(record), indent=2))
