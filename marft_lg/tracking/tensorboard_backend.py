"""TensorBoard: event files in ``<run_dir>/tensorboard`` (a stage's in its own run folder): scalars per step, the
config and reports as text, PNG plots as images, each adapter version's lineage as text."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from marft_lg.tracking.base import flat_params

_TEXT_SUFFIXES = (".md", ".json", ".txt", ".jsonl")
_MAX_TEXT = 200_000


class TensorBoardTracker:
    """One TensorBoard run (`Tracker`): a `SummaryWriter` on the run folder's ``tensorboard/``."""

    def __init__(self, writer: Any):
        self.writer = writer
        self.context: dict[str, Any] = {}
        self._step = 0

    @classmethod
    def start(cls, run_dir: Path, *, name: str, params: Mapping[str, Any], uri: str | None = None,
              experiment: str | None = None, tags: Mapping[str, str] | None = None) -> TensorBoardTracker:
        """A writer on ``<run_dir>/tensorboard`` (the same folder the trainer's `tensorboard: true` used)."""
        from torch.utils.tensorboard import SummaryWriter

        out = cls(SummaryWriter(str(Path(run_dir) / "tensorboard")))
        out.log_text(f"run {name}", "run")
        out.log_params(params)
        return out

    def log_params(self, params: Mapping[str, Any]) -> None:
        """The config as one Markdown table (text tab)."""
        flat = flat_params(params)
        if flat:
            rows = "\n".join(f"| {k} | {v.replace('|', '/')} |" for k, v in sorted(flat.items()))
            self.writer.add_text("params", "| param | value |\n|---|---|\n" + rows, 0)
            self.writer.flush()

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Scalars at `step`."""
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self._step = max(self._step, step)
        self.writer.flush()

    def log_file(self, path: Path, folder: str = "") -> None:
        """A PNG as an image, a Markdown / JSON file as text (other files are not TensorBoard's to show)."""
        tag = f"{folder}/{path.stem}" if folder else path.stem
        if path.suffix.lower() == ".png":
            import matplotlib.image as mpimg

            image = mpimg.imread(str(path))
            self.writer.add_image(tag, image[..., :3], self._step, dataformats="HWC")
        elif path.suffix.lower() in _TEXT_SUFFIXES:
            self.writer.add_text(tag, path.read_text(encoding="utf-8", errors="replace")[:_MAX_TEXT], self._step)
        self.writer.flush()

    def log_text(self, text: str, name: str) -> None:
        """Text under tag `name`."""
        self.writer.add_text(name, text[:_MAX_TEXT], self._step)
        self.writer.flush()

    def log_adapter(self, lineage: Mapping[str, Any], path: Path) -> None:
        """The lineage as JSON text under ``adapters/<role>``."""
        body = json.dumps(dict(lineage), indent=2, default=str)
        self.writer.add_text(f"adapters/{lineage['role']}", f"```\n{body}\n```", self._step)
        self.writer.flush()

    def child(self, name: str, run_dir: Path, params: Mapping[str, Any] | None = None) -> TensorBoardTracker:
        """The stage's own writer in its run folder."""
        return TensorBoardTracker.start(run_dir, name=name, params=params or {})

    def finish(self, status: str = "FINISHED") -> None:
        """Flush and close the event file."""
        self.writer.add_text("status", status, self._step)
        self.writer.close()
