"""Where a measurement came from: the git commit of the code and the machine it ran on.

Every results file (benchmarks, the demo, the learning run) records this at its top level, so a
figure can be checked against the code it measured.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

_PACKAGE = Path(__file__).resolve().parent


def code_state(path: str | Path = _PACKAGE) -> dict[str, Any]:
    """``{"commit": sha or None, "dirty": uncommitted changes under marft_lg/}`` of the checkout holding `path`.

    None (and dirty None) where the code is not a git checkout, e.g. an installed wheel.
    """
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                              cwd=Path(path) if Path(path).is_dir() else Path(path).parent, timeout=30).stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        top = Path(git("rev-parse", "--show-toplevel").strip())
        dirty = bool(git("status", "--porcelain", str(top / "marft_lg")).strip())
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": dirty}


def machine() -> dict[str, Any]:
    """CPU count, Python, platform and the 1-minute load average when the measurement started."""
    try:
        load = round(os.getloadavg()[0], 2)
    except OSError:  # pragma: no cover - no load average on this OS
        load = None
    return {"cpus": os.cpu_count(), "cpu": _cpu_model(), "python": platform.python_version(),
            "platform": platform.platform(), "load_avg_1m_at_start": load}


def _cpu_model() -> str | None:
    """The CPU's model name and whether it has AVX-512: hosts of the same core count differ ~1.7x in speed, and a
    time-budgeted run (the demo) trains for fewer iterations on the slower one."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or None
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), None)
    flags = next((line for line in info.splitlines() if line.startswith("flags")), "")
    return f"{name or 'unknown'} ({'AVX-512' if 'avx512f' in flags.split() else 'no AVX-512'})"
