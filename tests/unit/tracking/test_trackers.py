"""Each tracker on its real package, read back: an MLflow SQLite store (`mlflow.search_runs`), TensorBoard event
files (`EventAccumulator`), W&B offline run files; `report_to` checking; a failing tracker never stops a run."""

from __future__ import annotations

import importlib.util
import logging
import time

import pytest

from marft_lg._config import ConfigError
from marft_lg.tracking.base import Guarded, flat_metrics, open_tracker
from marft_lg.tracking.settings import TrackingUnavailable, check_report_to, require

ROW = {"iteration": 0, "reward_mean": 0.5, "components": {"outcome": 1.0}, "phase": "offline", "tokens_per_s": 12.0,
       "agents": {"actor": {"approx_kl": 0.01, "clip_fraction": 0.1, "entropy": 2.0}}, "value_loss": 0.3,
       "restored": [], "rollout_s": 1.5, "staleness_mean": 1.0, "ok": True, "nan": float("nan")}


def _plot(path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2, 2))
    ax.plot([0, 1], [0, 1])
    fig.savefig(path, dpi=40)
    plt.close(fig)
    return path


def test_report_to_values_and_errors():
    assert check_report_to("mlflow") == ["mlflow"]
    assert check_report_to(["MLflow", "tensorboard", "mlflow"]) == ["mlflow", "tensorboard"]
    assert check_report_to("none") == [] and check_report_to(None) == [] and check_report_to([]) == []
    with pytest.raises(ConfigError, match=r"report_to: unknown tracker 'comet'; choose from tensorboard, mlflow"):
        check_report_to(["comet"])
    with pytest.raises(ConfigError, match="'none' cannot be combined"):
        check_report_to(["none", "wandb"])


def test_marft_config_report_to_names_the_yaml_line(tmp_path):
    from marft_lg.training.config import MARFTConfig

    assert MARFTConfig(report_to="wandb", tensorboard=True).trackers() == ["wandb", "tensorboard"]
    p = tmp_path / "t.yaml"
    p.write_text("learning_rate: 1.0e-4\nreport_to: [mlflow, neptune]\n")
    with pytest.raises(ConfigError, match=r"t.yaml:2: report_to: unknown tracker 'neptune'"):
        MARFTConfig.from_yaml(p)


def test_a_missing_package_is_one_line_naming_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(TrackingUnavailable) as err:
        require("mlflow")
    assert str(err.value) == "report_to: mlflow needs the mlflow package: pip install 'marft_lg[mlflow]'"


def test_a_failing_tracker_warns_once_and_the_run_goes_on(caplog, tmp_path):
    class Broken:
        context: dict = {}

        def log_metrics(self, metrics, step):
            raise ConnectionError("store unreachable")

        def child(self, name, run_dir, params=None):
            raise ConnectionError("store unreachable")

    guarded = Guarded(Broken(), "mlflow")
    with caplog.at_level(logging.WARNING, logger="marft_lg.tracking"):
        for step in range(3):
            guarded.log_metrics({"x": 1.0}, step)
        guarded.child("train", tmp_path).log_metrics({"x": 1.0}, 0)  # a child that cannot start does nothing
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "store unreachable" in warnings[0].getMessage()


def test_flat_metrics_keeps_the_finite_numbers():
    flat = flat_metrics(ROW)
    assert flat["agents/actor/clip_fraction"] == 0.1 and flat["components/outcome"] == 1.0
    assert flat["staleness_mean"] == 1.0 and "phase" not in flat and "ok" not in flat and "nan" not in flat


def test_mlflow_local_store_runs_metrics_artifacts_and_children(tmp_path):
    import mlflow

    tracker = open_tracker(["mlflow"], tmp_path, name="job run", params={"lr": 0.1, "lora": {"r": 8}})
    tracker.log_metrics(flat_metrics(ROW), 0)
    tracker.log_metrics({"reward_mean": 0.75}, 1)
    tracker.log_file(_plot(tmp_path / "agents.png"), "plots")
    child = tracker.child("train", tmp_path / "train", {"stage": "train"})
    child.log_metrics({"value_loss": 0.2}, 0)
    child.finish()
    tracker.finish()
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=["marft-lg"])
    parent = runs[runs["tags.mlflow.runName"] == "job run"].iloc[0]
    kid = runs[runs["tags.mlflow.runName"] == "train"].iloc[0]
    assert parent["metrics.reward_mean"] == 0.75 and parent["metrics.agents/actor/approx_kl"] == 0.01
    assert parent["params.lora.r"] == "8" and parent["status"] == "FINISHED"
    assert kid["tags.mlflow.parentRunId"] == parent["run_id"] and kid["metrics.value_loss"] == 0.2
    client = mlflow.MlflowClient(uri)
    assert [f.path for f in client.list_artifacts(parent["run_id"], "plots")] == ["plots/agents.png"]
    history = client.get_metric_history(parent["run_id"], "reward_mean")
    assert [(m.step, m.value) for m in history] == [(0, 0.5), (1, 0.75)]


def test_tensorboard_event_files_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = open_tracker(["tensorboard"], tmp_path, name="run", params={"lr": 0.1})
    tracker.log_metrics(flat_metrics(ROW), 0)
    tracker.log_metrics({"reward_mean": 0.75}, 1)
    tracker.log_file(_plot(tmp_path / "reward.png"), "plots")
    tracker.log_text("decision: promote", "gate_decision")
    tracker.finish()
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"images": 0, "tensors": 0}).Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward_mean")] == [(0, 0.5), (1, 0.75)]
    assert "agents/actor/clip_fraction" in acc.Tags()["scalars"]
    assert "plots/reward" in acc.Tags()["images"]
    assert {"params", "gate_decision"} <= {t.split("/")[0] for t in acc.Tags()["tensors"]}


def test_wandb_offline_writes_the_run_and_sends_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # would fail loudly if anything were sent
    tracker = open_tracker(["wandb"], tmp_path, name="run", params={"lr": 0.1})
    tracker.log_metrics(flat_metrics(ROW), 0)
    tracker.log_file(_plot(tmp_path / "agents.png"), "plots")
    tracker.finish()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((tmp_path / "wandb").iterdir())
    deadline = time.monotonic() + 30  # wandb's service process writes the file after finish() returns
    while b"reward_mean" not in (data := next(runs[0].glob("run-*.wandb")).read_bytes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert b"agents/actor/clip_fraction" in data and b"reward_mean" in data
    assert (runs[0] / "files" / "agents.png").is_file()


def test_mlflow_honours_its_environment_variables_and_an_explicit_setting_wins(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    server = tmp_path / "team-server"
    server.mkdir()
    shared = f"sqlite:///{server / 'store.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", shared)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "support-bot")
    tracker = open_tracker(["mlflow"], tmp_path / "run", name="nightly")
    tracker.log_metrics({"reward": 0.5}, step=1)
    tracker.finish()
    assert not (tmp_path / "run" / "mlflow.db").exists()  # the team's store, not a private one
    found = MlflowClient(shared).get_experiment_by_name("support-bot")
    [run] = MlflowClient(shared).search_runs([found.experiment_id])
    assert run.info.run_name == "nightly" and run.data.metrics["reward"] == 0.5

    own = f"sqlite:///{tmp_path / 'own.db'}"
    tracker = open_tracker(["mlflow"], tmp_path / "run2", name="pinned", uri=own, experiment="mine")
    tracker.finish()
    assert MlflowClient(own).get_experiment_by_name("mine") is not None
    assert MlflowClient(shared).get_experiment_by_name("mine") is None
