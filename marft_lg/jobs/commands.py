"""CLI commands for marft_lg.jobs (registered in marft_lg/cli.py). Keep top-level imports light."""

from __future__ import annotations

import typer


def retrain() -> None:
    """Not built yet."""
    raise typer.Exit("marft-lg retrain: not implemented yet")


def schedule() -> None:
    """Not built yet."""
    raise typer.Exit("marft-lg schedule: not implemented yet")


jobs_app = typer.Typer(help="Inspect recorded retraining runs.", no_args_is_help=True)
