"""Per-iteration training metrics: JSONL log, optional TensorBoard, PNG plots of the run."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


class MetricsLog:
    """Appends one JSON object per iteration to `<run>/metrics.jsonl` (and TensorBoard when asked)."""

    def __init__(self, run_dir: str | Path, *, tensorboard: bool = False):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:  # tensorboard is optional
                raise RuntimeError("tensorboard: true needs the `tensorboard` package (pip install tensorboard)") from exc
            self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def log(self, row: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(_clean(row)) + "\n")
        if self._tb is not None:
            step = int(row.get("iteration", 0))
            for key, value in _flatten(row).items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()

    def rows(self) -> list[dict[str, Any]]:
        return read_metrics(self.path)

    def truncate_after(self, iteration: int) -> None:
        """Drop rows past `iteration` (a resumed run rewrites them)."""
        if self.path.exists():
            keep = [r for r in self.rows() if int(r.get("iteration", -1)) <= iteration]
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
            tmp.replace(self.path)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


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


def _flatten(row: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in row.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "/"))
        else:
            out[key] = v
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
