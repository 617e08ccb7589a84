"""`marft-lg train` with `report_to: [mlflow]` on the tiny model: the run folder's MLflow store holds the run, its
config as params, per-iteration metrics, the plots and the published adapters with their lineage."""

from __future__ import annotations

import json

import yaml
from typer.testing import CliRunner


def test_cli_train_report_to_mlflow_leaves_a_local_store(chain_dataset, tiny_model_dir, tmp_path):
    import mlflow

    from marft_lg.cli import app

    ds, _ = chain_dataset
    ds.to_parquet(tmp_path / "data")
    (tmp_path / "train.yaml").write_text(yaml.safe_dump({
        "model": tiny_model_dir, "agents": ["reasoner", "actor"], "registry": "registry", "versions": None,
        "run_dir": "run", "data": "data", "phases": ["offline"], "report_to": ["mlflow"],
        "reward": {"weights": {"format_compliance": 1.0},
                   "components": {"format_compliance": {"agents": {"actor": "^[A-Za-z]"}}}},
        "marft": {"learning_rate": 1e-3, "kl_cut": None, "offline_episodes_per_iteration": 4},
    }))
    result = CliRunner().invoke(app, ["train", "--config", str(tmp_path / "train.yaml")])
    assert result.exit_code == 0, result.output
    uri = f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=["marft-lg"])
    assert len(runs) == 1
    run = runs.iloc[0]
    assert run["status"] == "FINISHED" and run["params.learning_rate"] == "0.001"
    assert run["params.report_to"] == '["mlflow"]'
    for key in ("reward_mean", "agents/reasoner/approx_kl", "agents/reasoner/clip_fraction", "tokens_per_s",
                "value_loss", "components/format_compliance", "time_s"):
        assert f"metrics.{key}" in runs.columns, key
    client = mlflow.MlflowClient(uri)
    steps = [m.step for m in client.get_metric_history(run["run_id"], "reward_mean")]
    assert steps == [0, 1]
    artifacts = {f.path for f in client.list_artifacts(run["run_id"], "plots")}
    assert artifacts == {"plots/reward.png", "plots/agents.png"}
    adapters = {f.path for f in client.list_artifacts(run["run_id"], "adapters/actor/v1")}
    assert "adapters/actor/v1/adapter_model.safetensors" in adapters
    path = client.download_artifacts(run["run_id"], "lineage/actor-v1.json", str(tmp_path))
    with open(path, encoding="utf-8") as f:
        lineage = json.load(f)
    assert lineage["run_id"] == run["tags.marft.run_id"] and lineage["data_window"]["episodes"] == 6
    assert lineage["data_window"]["source"].endswith("data") and lineage["base_hash"]


def test_cli_report_to_override_and_bad_value(tmp_path):
    from marft_lg.cli import app

    (tmp_path / "r.yaml").write_text("weights: {format_compliance: 1.0}\n")
    (tmp_path / "train.yaml").write_text("agents: [a]\nreward: r.yaml\ndata: d\nreport_to: comet\n")
    result = CliRunner().invoke(app, ["train", "--config", str(tmp_path / "train.yaml")])
    assert result.exit_code == 2 and "train.yaml:4: report_to: unknown tracker 'comet'" in result.output
    (tmp_path / "train.yaml").write_text("agents: [a]\nreward: r.yaml\ndata: d\n")
    result = CliRunner().invoke(app, ["train", "--config", str(tmp_path / "train.yaml"), "--report-to", "x"])
    assert result.exit_code == 2 and "--report-to: unknown tracker 'x'" in result.output
