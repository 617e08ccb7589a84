"""The environment of a subprocess that runs as on a bare CUDA PyTorch image (see sitecustomize.py here)."""

from __future__ import annotations

import os
from pathlib import Path

BARE = Path(__file__).resolve().parent
ROOT = BARE.parents[1]


def bare_env(tmp_path: Path) -> dict[str, str]:
    """This environment with `BARE` first on PYTHONPATH (then the checkout), an empty model cache under `tmp_path`,
    and no MARFT_TEST_* / MARFT_HIDE_* settings of the calling test run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MARFT_TEST_", "MARFT_HIDE_"))}
    env.update(PYTHONPATH=os.pathsep.join([str(BARE), str(ROOT)]), MARFT_LG_CACHE=str(tmp_path / "empty-cache"),
               PYTHONDONTWRITEBYTECODE="1")
    return env
