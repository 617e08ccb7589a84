"""Pipeline stages for tests: real AdapterRegistry and real files, fake mining/training/evaluation.

Behaviour is read from `<job dir>/control.json` on every call, so a test (or a `marft-lg retrain`
child process) can make training slow, make the gate reject, or make a stage raise.
Episodes come from `traces/*.jsonl` lines `{"episode_id": ..., "end_time": ISO}`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from safetensors.numpy import load_file, save_file

from marft_lg.jobs.pipeline import Comparison
from marft_lg.serving.registry.store import AdapterRegistry
from marft_lg.tracing.files import trace_files
from marft_lg.trajectories.dataset import ACTION_COLUMNS, EPISODE_COLUMNS, TrajectoryDataset

ROLES = ("planner", "solver")


def write_adapter(out: Path, value: float) -> Path:
    """A PEFT-shaped directory whose single weight holds `value` (its 'training generation')."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 1}))
    save_file({"w": np.array([value], dtype=np.float32)}, str(out / "adapter_model.safetensors"))
    return out


def adapter_value(registry: AdapterRegistry, role: str, ref: str) -> float:
    return float(load_file(str(registry.path(role, ref) / "adapter_model.safetensors"))["w"][0])


def make_registry(root: Path) -> AdapterRegistry:
    """Registry with v1 of every role promoted to live."""
    reg = AdapterRegistry(root)
    for role in ROLES:
        v = reg.save(role, write_adapter(root.parent / "seed" / role, 1.0), base_fingerprint="fake")
        reg.promote({role: v}, reason="initial")
    return reg


def append_episodes(path: Path, end_times: list[str], prefix: str) -> list[str]:
    ids = [f"{prefix}-{i}" for i in range(len(end_times))]
    with path.open("a") as f:
        for eid, end in zip(ids, end_times, strict=True):
            f.write(json.dumps({"episode_id": eid, "end_time": end}) + "\n")
    return ids


def dataset_from(rows: list[dict[str, Any]]) -> TrajectoryDataset:
    eps = pd.DataFrame([{c: None for c in EPISODE_COLUMNS} | {
        "episode_id": r["episode_id"], "start_time": pd.Timestamp(r["end_time"]) - pd.Timedelta(seconds=5),
        "end_time": pd.Timestamp(r["end_time"]), "n_actions": 1, "agents": list(ROLES), "status": "ok",
    } for r in rows], columns=list(EPISODE_COLUMNS))
    acts = pd.DataFrame([{c: None for c in ACTION_COLUMNS} | {"episode_id": r["episode_id"], "order": 0,
                                                             "agent": ROLES[0], "completion": "x"} for r in rows],
                        columns=list(ACTION_COLUMNS))
    return TrajectoryDataset(episodes=eps, actions=acts)


class FakeStages:
    def __init__(self, job):
        self.job = job
        self.dir = Path(job.output_dir).parent
        self.registry = AdapterRegistry(job.registry)
        self.calls: list[str] = []

    def control(self) -> dict[str, Any]:
        p = self.dir / "control.json"
        return json.loads(p.read_text()) if p.exists() else {}

    def _maybe_fail(self, stage: str) -> None:
        if self.control().get("fail_in") == stage:
            raise RuntimeError(f"injected failure in {stage}")

    def live_versions(self, ctx):
        return {r: self.registry.alias("live")[r] for r in ROLES}

    def mine(self, ctx, since):
        self.calls.append("mine")
        self._maybe_fail("mine")
        # every episode, whatever `since` is: the pipeline must not rely on the miner's filtering
        rows = [json.loads(line) for f in trace_files(self.job.traces) for line in f.read_text().splitlines() if line]
        (ctx.run_dir / "mined_since.txt").write_text(str(since))
        return dataset_from(rows)

    def train(self, ctx, dataset, baseline):
        self.calls.append("train")
        (ctx.run_dir / "training_started").write_text(json.dumps(sorted(dataset.episode_ids)))
        candidate = {}
        for i, role in enumerate(ROLES):
            if i == 1:  # one candidate version already exists while training is still going
                time.sleep(float(self.control().get("train_sleep", 0)))
                self._maybe_fail("train")
            value = adapter_value(self.registry, role, baseline[role]) + 1.0
            src = write_adapter(ctx.run_dir / "adapters" / role, value)
            candidate[role] = self.registry.save(role, src, base_fingerprint="fake", parent=baseline[role],
                                                 run_id=ctx.run_id)
        return candidate

    def compare(self, ctx, baseline, candidate):
        self.calls.append("compare")
        self._maybe_fail("compare")
        passed = bool(self.control().get("gate_pass", True))
        report = ctx.run_dir / "report.md"
        report.write_text(f"# shadow compare\n{baseline} -> {candidate}\n")
        return Comparison(passed=passed, reasons=[] if passed else ["reward delta CI includes 0"],
                          metrics={"reward_delta": 0.1 if passed else -0.05}, report_path=str(report))

    def promote(self, ctx, candidate, reason):
        self.calls.append("promote")
        self._maybe_fail("promote")
        live = self.registry.promote(candidate, reason=reason)
        if self.control().get("kill_after_promote"):
            import os
            import signal

            os.kill(os.getpid(), signal.SIGKILL)
        return live


def make_job(root: Path, **settings: Any) -> Path:
    """A job folder with a live registry, an empty trace file and `job.yaml` using `FakeStages`."""
    import yaml

    root.mkdir(parents=True, exist_ok=True)
    make_registry(root / "adapters")
    (root / "traces").mkdir(exist_ok=True)
    (root / "traces" / "spans.jsonl").touch()
    job = {"name": "nightly", "traces": ["traces"], "registry": "adapters", "output_dir": "runs",
           "min_new_episodes": 3, "settle_s": 60, "stages": "jobs_fakes:FakeStages",
           "schedule": "0 2 * * *", **settings}
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def set_control(root: Path, **values: Any) -> None:
    (root / "control.json").write_text(json.dumps(values))


def child_env() -> dict[str, str]:
    """Environment for a `marft-lg` child process that can import this module."""
    import os

    here = str(Path(__file__).resolve().parent)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)}
