"""`marft-lg train --resume` of a run that had already finished publishes nothing new: no version saved, the
aliases untouched, one line saying so, exit 0 (tiny model, offline phase, in process)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from typer.testing import CliRunner

from marft_lg.cli import app


def _config(root: Path, model_dir: str, data: Path, *, checkpoint_every: int) -> Path:
    config = root / "train.yaml"
    config.write_text(yaml.safe_dump({
        "model": model_dir, "agents": ["reasoner", "actor"], "registry": "registry", "versions": None,
        "reward": {"weights": {"step_count": -0.1}}, "data": str(data), "phases": ["offline"],
        "marft": {"offline_episodes_per_iteration": 2, "offline_passes": 1, "checkpoint_every": checkpoint_every,
                  "plots": False, "seed": 0}}))
    return config


def _registry_state(registry: Path) -> tuple[list[str], str]:
    return sorted(str(p.relative_to(registry)) for p in registry.glob("*/v*")), (registry / "aliases.json").read_text()


def test_resume_of_a_finished_run_publishes_nothing_new(chain_dataset, tiny_model_dir, tmp_path):
    dataset, _ = chain_dataset
    dataset.to_parquet(tmp_path / "data")
    # 3 iterations (6 episodes, 2 per iteration) and a checkpoint every 2: the run's end is not on a checkpoint
    config = _config(tmp_path, tiny_model_dir, tmp_path / "data", checkpoint_every=2)
    runner = CliRunner()
    first = runner.invoke(app, ["train", "--config", str(config)], env={"COLUMNS": "300"})
    assert first.exit_code == 0, first.output
    before = _registry_state(tmp_path / "registry")
    assert before[0] == ["actor/v1", "reasoner/v1"]
    again = runner.invoke(app, ["train", "--config", str(config), "--resume"], env={"COLUMNS": "300"})
    assert again.exit_code == 0, again.output
    assert _registry_state(tmp_path / "registry") == before  # no new version, aliases untouched
    said = [line for line in again.output.splitlines() if "nothing new to publish" in line]
    assert len(said) == 1 and "had finished (iteration 3)" in said[0], again.output
    rows = [json.loads(x) for x in (tmp_path / "runs" / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2]  # nothing re-run
