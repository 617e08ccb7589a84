"""Weights & Biases, offline by default: the run is written under ``<run_dir>/wandb`` and nothing is sent
(``wandb sync`` uploads it later); only ``WANDB_MODE=online`` in the environment sends it as it runs. A job's
stages are runs of one W&B group."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

DEFAULT_PROJECT = "marft-lg"


class WandbTracker:
    """One W&B run (`Tracker`)."""

    def __init__(self, run: Any, project: str, group: str):
        self.run, self.project, self.group = run, project, group
        self.context: dict[str, Any] = {}

    @classmethod
    def start(cls, run_dir: Path, *, name: str, params: Mapping[str, Any], uri: str | None = None,
              experiment: str | None = None, tags: Mapping[str, str] | None = None,
              group: str | None = None, job_type: str = "train") -> WandbTracker:
        """`wandb.init` in offline mode (unless WANDB_MODE says otherwise), files in `run_dir`."""
        import wandb

        mode = "online" if os.environ.get("WANDB_MODE", "offline") == "online" else "offline"
        project = experiment or os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT
        run = wandb.init(mode=mode, dir=str(Path(run_dir).resolve()), project=project, name=name,
                         group=group or name, job_type=job_type, config=dict(params), reinit="create_new",
                         settings=wandb.Settings(silent=True, console="off"))
        return cls(run, project, group or name)

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Config values into the run's config."""
        self.run.config.update(dict(params), allow_val_change=True)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """One step's metrics."""
        self.run.log(dict(metrics), step=step)

    def log_file(self, path: Path, folder: str = "") -> None:
        """A PNG as an image; any file saved into the run's files."""
        import wandb

        if path.suffix.lower() == ".png":
            self.run.log({f"{folder}/{path.stem}" if folder else path.stem: wandb.Image(str(path))})
        self.run.save(str(path), base_path=str(path.parent), policy="now")

    def log_text(self, text: str, name: str) -> None:
        """Short text into the summary; the whole text as a file of the run."""
        self.run.summary[name] = text[:2000]
        out = Path(self.run.dir) / name
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text, encoding="utf-8")

    def log_adapter(self, lineage: Mapping[str, Any], path: Path) -> None:
        """The version as a ``lora-adapter`` artifact with its lineage as metadata (aliased by its version)."""
        import wandb

        art = wandb.Artifact(f"adapter-{lineage['role']}", type="lora-adapter",
                             metadata=json.loads(json.dumps(dict(lineage), default=str)))
        art.add_dir(str(path))
        self.run.log_artifact(art, aliases=[str(lineage["version"])])

    def child(self, name: str, run_dir: Path, params: Mapping[str, Any] | None = None) -> WandbTracker:
        """A run of this run's group, with the stage as its job type."""
        return WandbTracker.start(run_dir, name=f"{self.run.name}-{name}", params=params or {},
                                  experiment=self.project, group=self.group, job_type=name)

    def finish(self, status: str = "FINISHED") -> None:
        """Finish the run (exit code 1 unless FINISHED)."""
        self.run.summary["status"] = status
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)
