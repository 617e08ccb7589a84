"""`marft-lg train` never reports success for training that did not happen, and a role no update reached keeps
its version instead of getting a new one."""

from __future__ import annotations

import yaml
from rich.console import Console
from typer.testing import CliRunner


def _train_yaml(tmp_path, model: str, reward: dict, **marft) -> None:
    (tmp_path / "train.yaml").write_text(yaml.safe_dump({
        "model": model, "agents": ["reasoner", "actor"], "registry": "registry", "versions": None,
        "run_dir": "run", "data": "data", "phases": ["offline"], "reward": reward,
        "marft": {"learning_rate": 1e-3, "kl_cut": None, "plots": False, **marft},
    }))


def test_training_on_episodes_the_reward_scored_none_of_exits_non_zero_naming_why(chain_dataset, tiny_model_dir,
                                                                                   tmp_path):
    from marft_lg.cli import app
    from marft_lg.serving.registry.store import AdapterRegistry

    ds, _ = chain_dataset
    ds.to_parquet(tmp_path / "data")
    (tmp_path / "never.py").write_text("def score(episode):\n    return float('nan')\n")
    _train_yaml(tmp_path, tiny_model_dir, {"weights": {"never": 1.0}, "components": {"never": {"type": "never.py:score"}}})
    result = CliRunner().invoke(app, ["train", "--config", str(tmp_path / "train.yaml")])
    assert result.exit_code == 1, result.output
    assert "nothing to train: no scored episode: the reward scored none of the" in result.output
    assert "trained" not in result.output.split("error:")[0]
    assert AdapterRegistry(tmp_path / "registry").alias("candidate") == {}


def test_a_role_without_an_optimizer_step_gets_no_new_version(chain_dataset, tiny_model_dir, tmp_path):
    """Sequential scheme, one iteration: only the first role (reasoner) is updated; actor keeps no version."""
    from types import SimpleNamespace

    from marft_lg.serving.team import Team
    from marft_lg.training.commands import _publish
    from marft_lg.training.config import MARFTConfig
    from marft_lg.training.trainer import MARFTTrainer

    ds, _ = chain_dataset
    team = Team(tiny_model_dir, ["reasoner", "actor"], registry=tmp_path / "registry", versions=None, seed=0)
    try:
        cfg = MARFTConfig(learning_rate=1e-3, kl_cut=None, plots=False, update_scheme="sequential")
        trainer = MARFTTrainer(team, lambda ep: float(len(ep.actions)), cfg, tmp_path / "run", progress=False)
        rows = trainer.fit_offline(ds, iterations=1)
        assert rows[0]["trained_agents"] == ["reasoner"] and rows[0]["updated_agents"] == ["reasoner"]
        spec = SimpleNamespace(agents=["reasoner", "actor"], registry=str(tmp_path / "registry"),
                               run_dir=str(tmp_path / "run"))
        _publish(spec, team, trainer, Console(record=True, width=400))
        assert team.registry.versions("actor") == []
        assert team.registry.versions("reasoner") == ["v1"]
        assert team.registry.alias("candidate") == {"reasoner": "v1"}
    finally:
        team.close()
