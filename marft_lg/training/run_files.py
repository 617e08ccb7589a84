"""The files a training run writes into its run directory, and the guards that keep two runs from mixing.

`train` refuses a run directory that already holds a run (`check_fresh_run_dir`) unless it resumes it,
or `--overwrite` deletes exactly the run's files (`clear_run_files`).
"""

from __future__ import annotations

from pathlib import Path

RUN_FILES = ("metrics.jsonl", "checkpoints", "tensorboard", "reward.png", "agents.png", "traces")
"""What a training run writes into its run directory (`--overwrite` deletes exactly these)."""


class RunDirError(ValueError):
    """A run directory that already holds another run (train without --resume or --overwrite)."""


def existing_run_files(run_dir: str | Path) -> list[str]:
    """The run files (`RUN_FILES`) present in `run_dir` (an empty metrics file or folder does not count)."""
    root = Path(run_dir)
    out = []
    for name in RUN_FILES:
        p = root / name
        if p.is_dir() and any(p.iterdir()) or p.is_file() and p.stat().st_size:
            out.append(name)
    return out


def check_fresh_run_dir(run_dir: str | Path) -> None:
    """Raise `RunDirError` when `run_dir` already holds a run's files (two runs must not mix)."""
    found = existing_run_files(run_dir)
    if not found:
        return
    detail = []
    if "metrics.jsonl" in found:
        n = sum(1 for line in (Path(run_dir) / "metrics.jsonl").read_bytes().splitlines() if line.strip())
        detail.append(f"metrics.jsonl with {n} row(s)")
    from marft_lg.training.checkpoint import list_checkpoints

    ckpts = list_checkpoints(run_dir)
    if ckpts:
        detail.append(f"{len(ckpts)} checkpoint(s), newest {ckpts[0].name}")
    rest = [f for f in found if f not in ("metrics.jsonl", "checkpoints")]
    detail += rest
    raise RunDirError(f"run directory {run_dir} already holds a run ({', '.join(detail) or ', '.join(found)}); "
                      "use --resume to continue it, --overwrite to delete its run files and start over, or "
                      "another run_dir")


def clear_run_files(run_dir: str | Path) -> list[str]:
    """Delete the run files (`RUN_FILES`) of `run_dir`; other files stay. Returns what was deleted."""
    import shutil

    from marft_lg._durable import fsync_dir

    root = Path(run_dir)
    removed = []
    for name in RUN_FILES:
        p = root / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
            removed.append(name)
        elif p.exists() or p.is_symlink():
            p.unlink()
            removed.append(name)
    if removed:
        fsync_dir(root)
    return removed
