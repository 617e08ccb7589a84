"""`--resume` after damage: half-written metrics lines, truncated or missing checkpoints, a `latest` pointing
nowhere, old pickle checkpoints (never unpickled), and fsync of everything a run writes."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from marft_lg.training.checkpoint import CheckpointError, read_checkpoint
from marft_lg.training.config import MARFTConfig
from marft_lg.training.metrics import MetricsError, MetricsLog, read_metrics
from marft_lg.training.policy import LocalPolicy, adapter_parameters
from marft_lg.training.trainer import MARFTTrainer


def actor_reward(ep):
    a, b = ep.actions[0]["completion_token_ids"], ep.actions[1]["completion_token_ids"]
    return float(bool(a) and bool(b) and a[0] % 2 == b[0] % 2)


def _cfg():
    return MARFTConfig(learning_rate=1e-3, critic_learning_rate=1e-3, kl_cut=None, plots=False,
                       offline_episodes_per_iteration=2, offline_passes=2, entropy_surge=1e9, kl_blowup=1e9)


def _train(model_dir, run_dir, iterations, ds, scenarios, *, resume=False):
    policy = LocalPolicy(model_dir, ["reasoner", "actor"], seed=0)  # a fresh process would start here
    trainer = MARFTTrainer(policy, actor_reward, _cfg(), run_dir, progress=False)
    report = trainer.resume() if resume else None
    trainer.fit_offline(ds, scenarios, iterations=iterations)
    return trainer, report


def _weights(trainer):
    return {r: [p.detach().clone() for p in adapter_parameters(trainer.model, trainer.adapter_names[r])]
            for r in trainer.roles}


def _iterations(run_dir: Path) -> list[int]:
    return [r["iteration"] for r in read_metrics(run_dir / "metrics.jsonl")]


@pytest.fixture(scope="module")
def straight(tiny_model_dir, tmp_path_factory, chain_dataset):
    """An uninterrupted 3-iteration run (the reference for every resumed one)."""
    ds, scenarios = chain_dataset
    run = tmp_path_factory.mktemp("straight")
    trainer, _ = _train(tiny_model_dir, run, 3, ds, scenarios)
    return _weights(trainer), read_metrics(run / "metrics.jsonl")


def _prompt(role, scenario, previous):
    msgs = [{"role": "system", "content": f"You are the {role}."}, {"role": "user", "content": scenario.inputs["q"]}]
    if previous:
        msgs.append({"role": "user", "content": "Reasoner: " + previous[0]["completion"]})
    return msgs


@pytest.fixture(scope="module")
def chain_dataset(tiny_model_dir):
    """The conftest's 2-agent dataset, built once for this module."""
    from marft_lg.training.rollout import ChainCollector
    from marft_lg.trajectories.scenarios import Scenario

    policy = LocalPolicy(tiny_model_dir, ["reasoner", "actor"], seed=0)
    scenarios = [Scenario(f"s{i}", {"q": f"question {i}"}) for i in range(3)]
    collector = ChainCollector(policy, ["reasoner", "actor"], _prompt, max_new_tokens=4)
    return collector.collect(scenarios, 2, 0, 0), scenarios


def _assert_same_weights(a, b):
    for role in a:
        for x, y in zip(a[role], b[role], strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_half_written_last_metrics_line_is_dropped_and_said(tiny_model_dir, tmp_path, chain_dataset, straight):
    ds, scenarios = chain_dataset
    _train(tiny_model_dir, tmp_path, 2, ds, scenarios)
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"iteration": 2, "phase": "offl')  # the process died while writing iteration 2's row
    trainer, report = _train(tiny_model_dir, tmp_path, 3, ds, scenarios, resume=True)
    assert report and report.iteration == 2
    assert any("metrics.jsonl:3: dropped a half-written last line" in line for line in report.lines())
    assert _iterations(tmp_path) == [0, 1, 2]
    _assert_same_weights(straight[0], _weights(trainer))


def test_damaged_metrics_line_in_the_middle_is_an_error_naming_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"iteration": 0}\n{"iteration": 1, "x": nope}\n{"iteration": 2}\n')
    with pytest.raises(MetricsError, match=r"metrics.jsonl:2: damaged metrics line"):
        MetricsLog(tmp_path).repair()
    with pytest.raises(MetricsError, match=r"metrics.jsonl:2:"):
        read_metrics(path)


def test_truncated_newest_checkpoint_is_skipped_and_later_rows_dropped(tiny_model_dir, tmp_path, chain_dataset,
                                                                        straight):
    ds, scenarios = chain_dataset
    _train(tiny_model_dir, tmp_path, 3, ds, scenarios)
    newest = tmp_path / "checkpoints" / "iter_000003" / "tensors.safetensors"
    newest.write_bytes(newest.read_bytes()[:100])  # a torn write
    trainer, report = _train(tiny_model_dir, tmp_path, 3, ds, scenarios, resume=True)
    assert report.path.name == "iter_000002" and report.iteration == 2
    assert [(p.name, "truncated" in why) for p, why in report.skipped] == [("iter_000003", True)]
    assert any("dropped 1 metrics row(s) written after iter_000002" in line for line in report.lines())
    assert _iterations(tmp_path) == [0, 1, 2]  # iteration 2 redone once, no duplicate row
    _assert_same_weights(straight[0], _weights(trainer))
    assert [r["reward_mean"] for r in read_metrics(tmp_path / "metrics.jsonl")] == \
           [r["reward_mean"] for r in straight[1]]


def test_latest_pointing_at_a_missing_checkpoint_resumes_from_the_newest_good_one(tiny_model_dir, tmp_path,
                                                                                  chain_dataset):
    ds, scenarios = chain_dataset
    _train(tiny_model_dir, tmp_path, 2, ds, scenarios)
    (tmp_path / "checkpoints" / "latest").write_text("iter_000014")
    trainer, report = _train(tiny_model_dir, tmp_path, 3, ds, scenarios, resume=True)
    assert report.path.name == "iter_000002"
    assert any("names iter_000014, which does not exist" in line for line in report.lines())
    assert _iterations(tmp_path) == [0, 1, 2] and trainer.iteration == 3


class _Planted:
    """Unpickling this creates a marker file: what an attacker with write access to a run dir would plant."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_an_old_pickle_checkpoint_is_refused_and_never_unpickled(tiny_model_dir, tmp_path):
    marker = tmp_path / "code-ran"
    old = tmp_path / "run" / "checkpoints" / "iter_000001"
    old.mkdir(parents=True)
    (old / "state.pt").write_bytes(pickle.dumps({"payload": _Planted(marker)}))
    (old.parent / "latest").write_text("iter_000001")
    policy = LocalPolicy(tiny_model_dir, ["reasoner", "actor"], seed=0)
    trainer = MARFTTrainer(policy, actor_reward, _cfg(), tmp_path / "run", progress=False)
    with pytest.raises(CheckpointError, match="written by an older version of marft_lg"):
        trainer.resume()
    assert not marker.exists()


def test_checkpoints_hold_no_pickle_and_load_without_it(tiny_model_dir, tmp_path, chain_dataset, monkeypatch):
    ds, scenarios = chain_dataset
    _train(tiny_model_dir, tmp_path, 1, ds, scenarios)
    folder = tmp_path / "checkpoints" / "iter_000001"
    assert sorted(p.name for p in folder.iterdir()) == ["manifest.json", "state.json", "tensors.safetensors"]

    def refuse(*a, **k):
        raise AssertionError("a checkpoint must load without pickle")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    ckpt = read_checkpoint(folder)
    assert ckpt.iteration == 1 and set(ckpt.adapters) == {"reasoner", "actor"}
    assert isinstance(ckpt.state["rng"]["numpy"], tuple) and ckpt.state["optimizers"]["reasoner"]["state"]


def test_a_flipped_byte_is_caught_by_the_checksum(tiny_model_dir, tmp_path, chain_dataset):
    ds, scenarios = chain_dataset
    _train(tiny_model_dir, tmp_path, 1, ds, scenarios)
    f = tmp_path / "checkpoints" / "iter_000001" / "tensors.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="SHA-256 differs"):
        read_checkpoint(f.parent)
    policy = LocalPolicy(tiny_model_dir, ["reasoner", "actor"], seed=0)
    trainer = MARFTTrainer(policy, actor_reward, _cfg(), tmp_path, progress=False)
    with pytest.raises(CheckpointError, match=r"(?s)cannot resume .*no checkpoint can be used.*iter_000001"):
        trainer.resume()


def test_resume_without_checkpoint_drops_the_unfinished_rows(tiny_model_dir, tmp_path, chain_dataset):
    ds, scenarios = chain_dataset
    (tmp_path / "metrics.jsonl").write_text('{"iteration": 0}\n')
    trainer, report = _train(tiny_model_dir, tmp_path, 1, ds, scenarios, resume=True)
    assert not report and any("dropped 1 metrics row(s)" in line for line in report.lines())
    assert _iterations(tmp_path) == [0]


def test_checkpoint_latest_and_metrics_are_fsynced(tiny_model_dir, tmp_path, chain_dataset, monkeypatch):
    ds, scenarios = chain_dataset
    synced: list[str] = []
    real = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    _train(tiny_model_dir, tmp_path, 1, ds, scenarios)
    ckpts = tmp_path / "checkpoints"
    for name in ("tensors.safetensors", "state.json", "manifest.json"):
        assert any(s.endswith(f"/.tmp-iter_000001/{name}") for s in synced), name
    assert str(ckpts) in synced and str(tmp_path / "metrics.jsonl") in synced
    assert any(Path(s).parent == ckpts and ".latest." in Path(s).name for s in synced)  # the pointer's temp file
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["iteration"] == 0
