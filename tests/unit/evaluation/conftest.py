"""Lets the evaluation tests import their helpers (eval_factory) under any pytest import mode."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
