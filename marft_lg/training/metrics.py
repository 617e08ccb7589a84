"""Per-iteration training metrics: JSONL log (its numbers also to the run's trackers), PNG plots of the run."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from marft_lg._durable import append_line, write_atomic


class MetricsError(ValueError):
    """A metrics.jsonl that cannot be read: a damaged line that is not the last one (named by file:line)."""


class MetricsLog:
    """Appends one JSON object per iteration to `<run>/metrics.jsonl` (and its numbers to the run's trackers).

    Every line is fsynced as it is written, so a crash loses at most the line being written; `repair`
    (called on resume) drops such a half-written last line and says so.
    """

    def __init__(self, run_dir: str | Path, *, tracker: Any = None):
        """`tracker`: a `marft_lg.tracking.Tracker` that gets each row's numbers too (None: the file only)."""
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tracker = tracker

    def log(self, row: dict[str, Any]) -> None:
        append_line(self.path, json.dumps(_clean(row)))
        if self.tracker is not None:
            from marft_lg.tracking.base import flat_metrics

            self.tracker.log_metrics(flat_metrics(_clean(row)), int(row.get("iteration", 0)))

    def rows(self) -> list[dict[str, Any]]:
        return read_metrics(self.path)

    def repair(self) -> str | None:
        """Drop a half-written last line (a crash while it was written) and return what was done, or None.
        A damaged line before the last one raises `MetricsError` naming file:line."""
        rows, partial = _read(self.path)
        if partial is None:
            if self.path.exists() and self.path.stat().st_size and not self.path.read_bytes().endswith(b"\n"):
                _rewrite(self.path, rows)  # the last row is whole but its newline was not written
            return None
        _rewrite(self.path, rows)
        return (f"{self.path}:{partial}: dropped a half-written last line (the run stopped while writing it); "
                "that iteration is redone")

    def truncate_after(self, iteration: int) -> int:
        """Drop rows past `iteration` (a resumed run rewrites them); returns how many were dropped."""
        if not self.path.exists():
            return 0
        rows, partial = _read(self.path)
        keep = [r for r in rows if _iteration(r) <= iteration]
        if len(keep) != len(rows) or partial is not None:
            _rewrite(self.path, keep)
        return len(rows) - len(keep)


def _iteration(row: dict[str, Any]) -> int:
    try:
        return int(row.get("iteration", -1))
    except (TypeError, ValueError):
        return -1


def _rewrite(path: Path, rows: list[dict[str, Any]]) -> None:
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))


def _read(path: Path) -> tuple[list[dict[str, Any]], int | None]:
    """The rows, and the line number of a half-written last line (None when the file ends cleanly)."""
    if not path.exists():
        return [], None
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    rows: list[dict[str, Any]] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError(f"a JSON {type(row).__name__}, not an object")
        except (ValueError, UnicodeDecodeError) as exc:
            if i == last:
                return rows, i + 1
            raise MetricsError(f"{path}:{i + 1}: damaged metrics line ({exc}); only the last line may be "
                               "half-written after a crash. Fix or delete that line, or start the run again "
                               "with --overwrite") from None
        rows.append(row)
    return rows, None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl; a half-written last line is left out, a damaged earlier line raises
    `MetricsError` naming file:line."""
    return _read(Path(path))[0]


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write `reward.png` (team reward mean +- std) and `agents.png` (per-agent approx KL and entropy)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = Path(run_dir)
    rows = read_metrics(run / "metrics.jsonl")
    if not rows:
        return []
    out = []
    it = [r["iteration"] for r in rows if r.get("reward_mean") is not None]
    mean = [r["reward_mean"] for r in rows if r.get("reward_mean") is not None]
    std = [r.get("reward_std") or 0.0 for r in rows if r.get("reward_mean") is not None]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(it, mean, marker="o", label="team reward")
    ax.fill_between(it, [m - s for m, s in zip(mean, std, strict=True)], [m + s for m, s in zip(mean, std, strict=True)],
                    alpha=0.2)
    ax.set_xlabel("iteration")
    ax.set_ylabel("reward")
    ax.set_title("Team reward")
    ax.legend()
    fig.tight_layout()
    fig.savefig(run / "reward.png", dpi=100)
    plt.close(fig)
    out.append(run / "reward.png")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    agents = sorted({a for r in rows for a in (r.get("agents") or {})})
    for a in agents:
        pts = [(r["iteration"], r["agents"][a]) for r in rows if a in (r.get("agents") or {})]
        ax1.plot([p[0] for p in pts], [p[1]["approx_kl"] for p in pts], marker=".", label=a)
        ax2.plot([p[0] for p in pts], [p[1]["entropy"] for p in pts], marker=".", label=a)
    ax1.set_title("approx KL per agent")
    ax2.set_title("entropy per agent")
    for ax in (ax1, ax2):
        ax.set_xlabel("iteration")
        if agents:
            ax.legend()
    fig.tight_layout()
    fig.savefig(run / "agents.png", dpi=100)
    plt.close(fig)
    out.append(run / "agents.png")
    return out


def _clean(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item"):
        return _clean(value.item())
    return value
