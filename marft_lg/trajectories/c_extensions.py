"""The optional C fast paths of mining (`_otlp_c`, `_columns_c`), built by setup.py when a C
compiler is there. Each has a pure-Python twin that gives the same results; ``MARFT_MINING_C_READER=0`` switches
all of them off."""

from __future__ import annotations

import importlib
import os
from types import ModuleType


def c_module(name: str) -> ModuleType | None:
    """`marft_lg.trajectories.<name>` when it was built and C is not switched off, else None."""
    if os.environ.get("MARFT_MINING_C_READER", "1") == "0":
        return None
    try:
        return importlib.import_module(f"marft_lg.trajectories.{name}")
    except ImportError:
        return None
