"""A real SIGKILL of `marft-lg train` (a process, killed wherever it is once its first checkpoint exists), then
`--resume`: the published adapters are byte-identical to an uninterrupted run's (tiny model, offline phase)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

PARITY = '''
def parity(episode):
    """1 when the actor's first token has the parity of the reasoner's: a reward the team can move."""
    a, b = episode.actions[0]["completion_token_ids"], episode.actions[1]["completion_token_ids"]
    return float(len(a) > 0 and len(b) > 0 and a[0] % 2 == b[0] % 2)
'''


def _project(root: Path, model_dir: str, data: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "rewards.py").write_text(PARITY)
    config = root / "train.yaml"
    config.write_text(yaml.safe_dump({
        "model": model_dir, "agents": ["reasoner", "actor"], "registry": "registry", "versions": None,
        "reward": {"weights": {"rewards.py:parity": 1.0}}, "data": str(data), "phases": ["offline"],
        "marft": {"learning_rate": 1e-3, "critic_learning_rate": 1e-3, "kl_cut": None, "plots": False,
                  "offline_episodes_per_iteration": 2, "offline_passes": 4, "checkpoint_every": 1,
                  "entropy_surge": 1e9, "kl_blowup": 1e9, "seed": 0}}))
    return config


def _train(config: Path, *extra: str, wait: bool = True) -> subprocess.Popen:
    env = {**os.environ, "MARFT_LG_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "marft_lg.cli", "train", "--config", str(config), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    if wait:
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out
    return proc


def _candidate_bytes(root: Path) -> dict[str, bytes]:
    registry = root / "registry"
    aliases = json.loads((registry / "aliases.json").read_text())["aliases"]["candidate"]
    return {role: (registry / role / version / "adapter_model.safetensors").read_bytes()
            for role, version in aliases.items()}


def test_sigkill_during_train_then_resume_gives_the_same_adapters(chain_dataset, tiny_model_dir, tmp_path):
    dataset, _ = chain_dataset
    dataset.to_parquet(tmp_path / "data")
    straight = _project(tmp_path / "straight", tiny_model_dir, tmp_path / "data")
    _train(straight)

    killed = _project(tmp_path / "killed", tiny_model_dir, tmp_path / "data")
    proc = _train(killed, wait=False)
    checkpoints = tmp_path / "killed" / "runs" / "train" / "checkpoints"
    deadline = time.monotonic() + 300
    while not (checkpoints.exists() and any(checkpoints.glob("iter_*"))):  # the first checkpoint is on disk
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "no checkpoint within 300 s"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # wherever it is now: mid-iteration, mid-write, between iterations
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert not (tmp_path / "killed" / "registry" / "aliases.json").exists() or "candidate" not in (
        tmp_path / "killed" / "registry" / "aliases.json").read_text()
    _train(killed, "--resume")

    assert _candidate_bytes(tmp_path / "killed") == _candidate_bytes(tmp_path / "straight")
    rows = [json.loads(x) for x in (tmp_path / "killed" / "runs" / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(len(rows))) and len(rows) >= 2  # no row twice, none lost
