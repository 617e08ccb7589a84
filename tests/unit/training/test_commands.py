import json

import pytest
import typer
import yaml
from typer.testing import CliRunner

from marft_lg.training.commands import TrainFile


def test_train_yaml_unknown_key_and_missing_reward(tmp_path):
    p = tmp_path / "train.yaml"
    p.write_text("agents: [a]\nreward: r.yaml\nphase: [offline]\n")
    with pytest.raises(typer.BadParameter, match=r"train.yaml: unknown key 'phase'; did you mean 'phases'"):
        TrainFile.load(p)
    p.write_text("agents: [a]\n")
    with pytest.raises(typer.BadParameter, match="reward is missing"):
        TrainFile.load(p)


def test_cli_offline_training_publishes_candidate(chain_dataset, tiny_model_dir, tmp_path):
    from marft_lg.cli import app
    from marft_lg.serving.registry import AdapterRegistry

    ds, scenarios = chain_dataset
    ds.to_parquet(tmp_path / "data")
    (tmp_path / "train.yaml").write_text(yaml.safe_dump({
        "model": tiny_model_dir, "agents": ["reasoner", "actor"], "registry": "registry", "versions": None,
        "run_dir": "run", "data": "data", "phases": ["offline"],
        "reward": {"weights": {"format_compliance": 1.0},
                   "components": {"format_compliance": {"agents": {"actor": "^[A-Za-z]"}}}},
        "marft": {"learning_rate": 1e-3, "kl_cut": None, "plots": False, "offline_episodes_per_iteration": 3},
    }))
    result = CliRunner().invoke(app, ["train", "--config", str(tmp_path / "train.yaml")])
    assert result.exit_code == 0, result.output
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and rows[0]["phase"] == "offline"
    reg = AdapterRegistry(tmp_path / "registry")
    assert set(reg.alias("candidate")) == {"reasoner", "actor"}
    assert (tmp_path / "run" / "checkpoints" / "latest").exists()
