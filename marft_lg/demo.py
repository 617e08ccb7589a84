"""`marft-lg demo`: the end-to-end main job on the embedded model."""

from __future__ import annotations

import typer


def demo() -> None:
    """Not built yet."""
    raise typer.Exit("marft-lg demo: not implemented yet")
