"""CLI commands for marft_lg.rewards (registered in marft_lg/cli.py). Keep top-level imports light."""

from __future__ import annotations

import typer


def score() -> None:
    """Not built yet."""
    raise typer.Exit("marft-lg score: not implemented yet")

