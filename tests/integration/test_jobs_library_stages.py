"""`run_once` with the real stages on real parts (tiny random Llama, Team + registry, wrap + OTLP traces,
mine, CompositeReward, MARFTTrainer, shadow_compare, PromotionGate, promote): a strict gate rejects and
leaves live alone, a lenient one promotes; only the new window is mined each time."""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "jobs"))

ROLES = ["planner", "writer"]
REWARD = {"weights": {"format_compliance": 1.0},
          "components": {"format_compliance": {"agents": {"writer": {"regex": r"ANSWER: \d+", "fullmatch": True}}}}}
TRAINER = {"offline_episodes_per_iteration": 8, "max_new_tokens": 8, "learning_rate": 1e-3, "plots": False,
           "use_critic": True, "update_scheme": "simultaneous"}
LENIENT = {"min_pairs": 1, "require_ci_lower_above_zero": False, "min_team_reward_gain": -10.0,
           "component_tolerance": {"*": 10.0}, "agent_tolerance": {}, "max_cost_ratio": None,
           "max_error_rate_increase": 1.0}
STRICT = {"min_pairs": 50}


@pytest.fixture(scope="module")
def world(tiny_model_dir, tmp_path_factory):
    import torch
    from jobs_app import build_graph

    from marft_lg.graph.chat_model import TeamChatModel
    from marft_lg.graph.wrap import wrap
    from marft_lg.serving.engine.models import model_fingerprint
    from marft_lg.serving.registry.lora import LoraSettings, write_fresh_adapter
    from marft_lg.serving.registry.store import AdapterRegistry
    from marft_lg.serving.team import Team
    from marft_lg.trajectories.scenarios import Scenario, ScenarioSet

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("jobs_library")
    reg = AdapterRegistry(root / "adapters")
    lora = LoraSettings(r=4, alpha=16, dropout=0.0, target_modules=["q_proj", "v_proj"])
    fresh = write_fresh_adapter(tiny_model_dir, lora, root / "fresh", seed=0)
    for role in ROLES:
        reg.save(role, fresh, base_fingerprint=model_fingerprint(tiny_model_dir))
    reg.promote({r: "v1" for r in ROLES}, reason="first deploy")
    scenarios = ScenarioSet([Scenario(f"s{i}", {"question": f"What is {i} plus {i}?"}, reference=str(2 * i),
                                      split="heldout" if i < 2 else "train") for i in range(6)])
    scenarios.save(root / "scenarios.jsonl")

    team = Team(tiny_model_dir, ROLES, registry=reg, lora=lora)
    app = wrap(build_graph(TeamChatModel(team=team, temperature=1.0, max_tokens=8)), team=team,
               trace_dir=root / "traces")
    for i, s in enumerate(scenarios):
        app.invoke(s.inputs, episode_id=f"prod-{i}", scenario_id=s.scenario_id, seed=i)
    app.flush()
    app.close()
    team.close()
    first_batch_done = datetime.now(UTC)
    return {"root": root, "reg": reg, "model": tiny_model_dir, "first_batch_done": first_batch_done}


def job_for(world, gate: dict, **extra):
    from marft_lg.jobs.config import RetrainJob

    root = world["root"]
    data = {"name": "nightly", "model": world["model"], "agents": ROLES, "traces": ["traces"], "registry": "adapters",
            "app": "jobs_app:build_graph", "chat_model": {"temperature": 0.0, "max_tokens": 8},
            "reward": REWARD, "trainer": TRAINER, "gate": gate, "scenarios": "scenarios.jsonl",
            "compare_split": "heldout", "min_new_episodes": 4, "settle_s": 0, "output_dir": "runs",
            "advance_on_reject": False, **extra}
    (root / "job.yaml").write_text(yaml.safe_dump(data))
    return RetrainJob.from_yaml(root / "job.yaml")


def test_strict_gate_rejects_then_lenient_gate_promotes_the_same_window(world):
    from marft_lg.jobs import store as st
    from marft_lg.jobs.pipeline import run_once
    from marft_lg.jobs.store import JobStore

    reg = world["reg"]
    now = world["first_batch_done"] + timedelta(seconds=1)

    rejected = run_once(job_for(world, STRICT), now=now, log=lambda m: None)
    assert rejected.status == st.REJECTED, rejected.message
    rec = rejected.record
    assert rec.n_episodes == 6 and rec.baseline == {r: "v1" for r in ROLES}
    assert rec.candidate != rec.baseline and "2 paired scenarios (need >= 50)" in rec.message
    assert reg.alias("live") == {r: "v1" for r in ROLES}
    for role, version in rec.candidate.items():
        if version != "v1":
            assert reg.manifest(role, version)["run_id"] == rec.run_id
    decision = json.loads(Path(rec.run_dir, "compare", "decision.json").read_text())
    assert decision["decision"] == "reject" and Path(rec.report_path).exists()
    assert rec.metrics["n_pairs"] == 2

    job = job_for(world, LENIENT)
    promoted = run_once(job, now=now, log=lambda m: None)
    assert promoted.status == st.PROMOTED, promoted.message
    assert promoted.record.n_episodes == 6  # the rejected window was kept (advance_on_reject: false)
    live = reg.alias("live")
    assert live == promoted.record.candidate and live != {r: "v1" for r in ROLES}
    assert JobStore(job.store_path).watermark("nightly") is not None

    again = run_once(job, now=now + timedelta(seconds=1), log=lambda m: None)
    assert again.status == st.SKIPPED and again.record.n_episodes == 0
    assert reg.alias("live") == live


def test_a_registry_with_nothing_promoted_starts_from_the_initial_adapters(world, tmp_path):
    """`retrain` copes without a live version as `compare` does: the roles start from their initial adapters,
    which are published beside the trained ones so the candidate can be compared and promoted; the log says so."""
    import shutil

    from marft_lg.jobs import store as st
    from marft_lg.jobs.pipeline import run_once

    root = world["root"]
    shutil.copytree(root / "adapters", root / "empty", ignore=shutil.ignore_patterns("aliases.json"))
    (root / "empty" / "aliases.json").unlink(missing_ok=True)
    from marft_lg.serving.registry.store import AdapterRegistry

    assert AdapterRegistry(root / "empty").alias("live") == {}
    logged: list[str] = []
    result = run_once(job_for(world, LENIENT, registry="empty", output_dir="runs-empty", name="first"),
                      now=world["first_batch_done"] + timedelta(seconds=1), log=logged.append)
    assert result.status == st.PROMOTED, result.message
    assert result.record.baseline == {r: "init" for r in ROLES}
    assert any("no live version for ['planner', 'writer'] (nothing promoted yet)" in line for line in logged)
    live = AdapterRegistry(root / "empty").alias("live")
    assert set(live) == set(ROLES) and all(v.startswith("v") for v in live.values())


def test_report_to_mlflow_logs_a_parent_run_with_train_and_compare_children(world):
    """A job with `report_to: [mlflow]`: one parent run per retraining run in `<output_dir>/mlflow.db`, the train
    and compare stages as its children (metrics, the report, the decision), and the promoted adapters registered
    with MLflow's `live` alias on the registry's live versions."""
    import shutil

    import mlflow

    from marft_lg.jobs import store as st
    from marft_lg.jobs.pipeline import run_once
    from marft_lg.serving.registry.store import AdapterRegistry

    root = world["root"]
    shutil.copytree(root / "adapters", root / "tracked", ignore=shutil.ignore_patterns("*.jsonl", "tracking.json"))
    result = run_once(job_for(world, LENIENT, registry="tracked", output_dir="runs-tracked", name="tracked",
                              report_to=["mlflow"]), now=world["first_batch_done"] + timedelta(seconds=1),
                      log=lambda m: None)
    assert result.status == st.PROMOTED, result.message
    uri = f"sqlite:///{root / 'runs-tracked' / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=["marft-lg"])
    parent = runs[runs["tags.mlflow.runName"] == result.record.run_id].iloc[0]
    children = runs[runs["tags.mlflow.parentRunId"] == parent["run_id"]]
    assert sorted(children["tags.mlflow.runName"]) == ["compare", "train"]
    assert parent["status"] == "FINISHED" and parent["metrics.n_episodes"] == 6
    train = children[children["tags.mlflow.runName"] == "train"].iloc[0]
    compare = children[children["tags.mlflow.runName"] == "compare"].iloc[0]
    assert "metrics.reward_mean" in runs.columns and train["params.learning_rate"] == "0.001"
    assert compare["metrics.gate/passed"] == 1.0 and compare["metrics.n_pairs"] == 2
    client = mlflow.MlflowClient(uri, registry_uri=uri)
    names = {f.path for f in client.list_artifacts(compare["run_id"], "comparison")}
    assert {"comparison/report.md", "comparison/report.html", "comparison/decision.json"} <= names
    live = AdapterRegistry(root / "tracked").alias("live")
    for role, version in live.items():
        mv = client.get_model_version_by_alias(f"marft-{role}", "live")
        assert mv.tags["registry_version"] == version and mv.tags["gate_decision"] == "promote"


def test_counterfactual_credit_replays_the_mined_window_through_the_jobs_app(world):
    """`trainer: {credit: counterfactual}` in job.yaml: the train stage replays every mined episode's steps through the
    job's app from the scenarios' inputs (`replay_traces/` in the run folder, never mined as data)."""
    from marft_lg.jobs import store as st
    from marft_lg.jobs.pipeline import run_once
    from marft_lg.trajectories.mining import mine

    trainer = {**TRAINER, "use_critic": False, "credit": "counterfactual", "replays_per_action": 1}
    result = run_once(job_for(world, LENIENT, trainer=trainer, output_dir="runs-credit", name="credit"),
                      now=world["first_batch_done"] + timedelta(seconds=1), log=lambda m: None)
    assert result.status == st.PROMOTED, result.message
    run_dir = Path(result.record.run_dir)
    rows = [json.loads(line) for line in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["replays"] for r in rows) == 6 * 2  # 6 mined episodes x (planner, writer) x 1 replay
    assert sum(r["replays_used"] for r in rows) == 12 and sum(r["fallback_actions"] for r in rows) == 0
    assert len(mine(run_dir / "replay_traces")) == 0


def test_a_role_no_update_reached_keeps_its_live_version_in_the_candidate(world):
    """The sequential scheme's first iteration updates one role: only that role gets a new version (the stage
    publishes the trainer's `updated_agents`, roles whose adapter took a step)."""
    from marft_lg.jobs.pipeline import run_once

    trainer = {**TRAINER, "update_scheme": "sequential", "offline_passes": 1}
    result = run_once(job_for(world, STRICT, trainer=trainer, name="one-role", output_dir="runs-one-role"),
                      now=world["first_batch_done"] + timedelta(seconds=1), log=lambda m: None)
    cand, base = result.record.candidate, result.record.baseline
    updated = [r for r, v in cand.items() if v != base[r]]
    assert len(updated) == 1, (base, cand)
    assert world["reg"].manifest(updated[0], cand[updated[0]])["run_id"] == result.record.run_id


def test_a_job_with_no_reference_anywhere_trains_and_compares_on_the_users_inputs(world):
    """`scenarios: {from_traces: ...}`: the mined production inputs (no reference) are the online phase's `train`
    split and the comparison's `heldout` split, split by a hash of the input."""
    import shutil

    from marft_lg.jobs import store as st
    from marft_lg.jobs.pipeline import run_once
    from marft_lg.trajectories.scenario_sets import load_scenarios

    root = world["root"]
    shutil.copytree(root / "adapters", root / "adapters-noref")
    source = {"from_traces": "traces", "input_keys": ["question"], "heldout": 0.5}
    users = load_scenarios(source, base_dir=root)
    assert all(s.reference is None for s in users) and len(users) == 6
    heldout = len(users.split("heldout"))
    assert 0 < heldout < 6
    judged = {"weights": {"group_judge": 1.0, "format_compliance": 0.5},  # the served base model judges
              "components": {"group_judge": {"max_chars": 80, "max_tokens": 200, "retries": 0},
                             "format_compliance": REWARD["components"]["format_compliance"]}}
    result = run_once(job_for(world, LENIENT, registry="adapters-noref", output_dir="runs-noref", name="noref",
                              scenarios=source, online_iterations=1, reward=judged),
                      now=world["first_batch_done"] + timedelta(seconds=1), log=lambda m: None)
    assert result.status == st.PROMOTED, result.message
    assert result.record.metrics["n_pairs"] == heldout
    signals = result.record.metrics["signals"]
    assert signals["format_compliance"] == {"scored": 6, "episodes": 6} and signals["group_judge"]["episodes"] == 6
    assert signals["group_judge"]["scored"] == 6  # the grammar makes even the tiny model's verdict parse
    rows = [json.loads(x) for x in Path(result.record.run_dir, "train", "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["phase"] == "online" and rows[-1]["episodes"] > 0
