"""CLI commands for marft_lg.evaluation (registered in marft_lg/cli.py). Keep top-level imports light."""

from __future__ import annotations

import typer


def compare() -> None:
    """Not built yet."""
    raise typer.Exit("marft-lg compare: not implemented yet")


def promote() -> None:
    """Not built yet."""
    raise typer.Exit("marft-lg promote: not implemented yet")


def rollback() -> None:
    """Not built yet."""
    raise typer.Exit("marft-lg rollback: not implemented yet")

