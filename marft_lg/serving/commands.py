"""CLI commands for marft_lg.serving (registered in marft_lg/cli.py). Keep top-level imports light."""

from __future__ import annotations

import typer


def serve() -> None:
    """Not built yet."""
    raise typer.Exit("marft-lg serve: not implemented yet")


def adapters() -> None:
    """Not built yet."""
    raise typer.Exit("marft-lg adapters: not implemented yet")

