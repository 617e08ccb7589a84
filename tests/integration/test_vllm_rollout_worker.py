"""A Ray rollout worker with `worker.engine: vllm` starts its own vLLM (CPU) server for the real 135M model, runs its
episodes through it with token ids and log-probs, and stops it when the pool closes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray is not installed"),
]

APPS = Path(__file__).resolve().parents[1] / "unit" / "distributed" / "ray_apps.py"


def test_a_rollout_worker_runs_its_episodes_on_its_own_vllm_server(embedded_model_dir):
    from marft_lg.distributed.config import RayConfig, WorkerResources
    from marft_lg.distributed.rollout import RayCollector
    from marft_lg.distributed.worker import WorkerSpec
    from marft_lg.trajectories.scenarios import Scenario

    cfg = RayConfig(address="local", rollout_workers=1, worker=WorkerResources(num_cpus=2, engine="vllm"))
    spec = WorkerSpec(app=f"{APPS}:two_agents", agents=["planner", "writer"], model=embedded_model_dir, max_tokens=6,
                      engine_options={"max_model_len": 1024})
    scenarios = [Scenario(f"s{i}", {"msgs": [f"Name a river ({i})."]}) for i in range(2)]
    with RayCollector(cfg, spec, run_id="vllm") as collector:
        assert collector.spec.serving == "vllm"
        dataset = collector.collect(scenarios, 1, 0, seed=0)
    assert sorted(dataset.episode_ids) == ["vllm-it0-s0-0", "vllm-it0-s1-0"]
    acts = dataset.actions
    assert len(acts) == 4 and set(acts["agent"]) == {"planner", "writer"}
    assert all(len(ids) > 0 and len(lp) == len(ids)
               for ids, lp in zip(acts["completion_token_ids"], acts["completion_logprobs"], strict=True))
    assert set(acts["adapter_version"]) == {"init"}
