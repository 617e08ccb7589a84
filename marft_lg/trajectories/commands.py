"""CLI commands for marft_lg.trajectories (registered in marft_lg/cli.py). Keep top-level imports light."""

from __future__ import annotations

import typer


def mine() -> None:
    """Not built yet."""
    raise typer.Exit("marft-lg mine: not implemented yet")

