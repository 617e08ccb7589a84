"""`marft-lg train --config` with a `ray:` section runs its online phase on two Ray rollout workers, each with its own
real SmolLM2-135M engine, on a private local cluster the command starts (127.0.0.1) and stops."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from marft_lg.examples.math_team.problems import make_problems

pytestmark = [pytest.mark.integration, pytest.mark.slow]
pytest.importorskip("ray")


def test_online_phase_on_two_rollout_workers_with_the_real_model(embedded_model_dir, tmp_path):
    make_problems(n_train=4, n_heldout=2, seed=0).save(tmp_path / "problems.jsonl")
    (tmp_path / "train.yaml").write_text(f"""
model: {embedded_model_dir}
agents: [reasoner, actor]
registry: registry
versions: null
run_dir: run
reward: {{weights: {{task_completion: 1.0}}, components: {{task_completion: {{match: contains}}}}}}
scenarios: problems.jsonl
phases: [online]
online: {{app: "marft_lg.examples.math_team.graph:build_graph", iterations: 2, max_tokens: 12, split: train}}
marft: {{group_size: 2, max_new_tokens: 12}}
ray: {{address: local, rollout_workers: 2, worker: {{num_cpus: 1, num_gpus: 0}}, async: false}}
""")
    marft = Path(sys.executable).with_name("marft-lg")
    done = subprocess.run([str(marft), "train", "--config", "train.yaml"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Ray rollout workers" in done.stdout
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    online = [r for r in rows if r.get("phase") == "online"]
    assert len(online) == 2
    for row in online:
        assert row["rollout_workers"] == 2
        assert sorted(row["episodes_per_worker"]) == ["0", "1"] and sum(row["episodes_per_worker"].values()) == 8
    assert (tmp_path / "registry" / "reasoner").is_dir()  # the learner published versions the workers then loaded
