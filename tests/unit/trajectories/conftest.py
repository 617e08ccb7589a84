"""Make the repository root importable so tests can import `examples.*` (until pytest's `pythonpath` says so)."""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[3])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
