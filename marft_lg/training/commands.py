"""CLI commands for marft_lg.training (registered in marft_lg/cli.py). Keep top-level imports light."""

from __future__ import annotations

import typer


def train() -> None:
    """Not built yet."""
    raise typer.Exit("marft-lg train: not implemented yet")

