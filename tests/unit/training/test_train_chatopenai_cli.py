"""`marft-lg train` on an app written on plain ChatOpenAI, named as a compiled graph in train.yaml (tiny model): the
online phase runs the app as it is on the adapters being trained; an app whose every rollout fails stops it with
exit 1 and the first errors, publishing no candidate; a role no update reached is named, not reported trained."""

from __future__ import annotations

import json
import types

import yaml
from typer.testing import CliRunner

from marft_lg.cli import app as cli
from tests.cli_text import flat

APP = '''
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from typing import TypedDict


class State(TypedDict, total=False):
    question: str
    notes: str
    answer: str


def llm(model, **kw):  # the URL the app was written for: nothing listens there during training
    return ChatOpenAI(model=model, base_url="http://127.0.0.1:9/v1", api_key="x", max_retries=0, **kw)


planner_llm, writer_llm = llm("planner", max_tokens=6, temperature=1.0), llm("writer", max_tokens=4)


def plan(state):
    return {"notes": planner_llm.invoke(state["question"]).content}


def write(state):
    if state["question"].startswith("boom"):
        raise RuntimeError("the writer's tool is down")
    return {"answer": writer_llm.invoke(state["question"] + state["notes"]).content}


g = StateGraph(State)
g.add_node("plan", plan)
g.add_node("write", write)
g.add_edge(START, "plan")
g.add_edge("plan", "write")
g.add_edge("write", END)
graph = g.compile()
'''


def _project(tmp_path, model_dir, questions, **marft):
    (tmp_path / "desk.py").write_text(APP)
    (tmp_path / "scenarios.jsonl").write_text("".join(
        json.dumps({"scenario_id": f"s{i}", "inputs": {"question": q}, "split": "train"}) + "\n"
        for i, q in enumerate(questions)))
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump({
        "model": model_dir, "agents": ["planner", "writer"], "registry": "registry", "versions": None,
        "reward": {"weights": {"step_count": -0.1}}, "scenarios": "scenarios.jsonl", "phases": ["online"],
        "online": {"app": "desk:graph", "iterations": 1, "node_roles": {"plan": "planner", "write": "writer"}},
        "marft": {"group_size": 2, "plots": False, "rollout_concurrency": 4, **marft}}))
    return config


def test_a_compiled_graph_on_chatopenai_trains_on_policy(tmp_path, tiny_model_dir):
    config = _project(tmp_path, tiny_model_dir, ["What is 2+2?", "Name a color."], update_scheme="sequential")
    result = CliRunner().invoke(cli, ["train", "--config", str(config)])
    text = flat(result.output)
    assert result.exit_code == 0, result.output
    assert "updated planner" in text and "warning: never updated: writer" in text  # one turn of the scheme
    row = json.loads((tmp_path / "runs" / "train" / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["episodes"] == 4 and row["retokenised"] == {} and row["actions"] == 8
    aliases = json.loads((tmp_path / "registry" / "aliases.json").read_text())["aliases"]
    assert set(aliases["candidate"]) == {"planner"}  # writer took no step: no new version, nothing to compare
    assert not (tmp_path / "registry" / "writer").exists() or not list((tmp_path / "registry" / "writer").glob("v*"))


def test_an_app_whose_every_rollout_fails_stops_with_the_errors(tmp_path, tiny_model_dir):
    config = _project(tmp_path, tiny_model_dir, ["boom one", "boom two"])
    result = CliRunner().invoke(cli, ["train", "--config", str(config)])
    text = flat(result.output)
    assert result.exit_code == 1, result.output
    assert "the online phase stopped; alias 'candidate' not set: on-policy iteration 0: 4 of 4 episodes failed" in text
    assert "RuntimeError: the writer's tool is down" in text and "Traceback" not in result.output
    registry = tmp_path / "registry" / "aliases.json"
    assert not registry.exists() or "candidate" not in json.loads(registry.read_text())["aliases"]


def test_a_typo_in_node_roles_fails_before_any_work(tmp_path, tiny_model_dir, monkeypatch):
    config = _project(tmp_path, tiny_model_dir, ["hi"])
    spec = yaml.safe_load(config.read_text())
    spec["online"]["node_roles"] = {"plan": "planner", "wirte": "writer"}
    config.write_text(yaml.safe_dump(spec))
    monkeypatch.setattr("marft_lg.training.trainer.MARFTTrainer",
                        lambda *a, **k: types.SimpleNamespace(frozen_roles=[]))  # never reached
    result = CliRunner().invoke(cli, ["train", "--config", str(config)])
    text = flat(result.output)
    assert result.exit_code == 2, result.output
    assert "online.app 'desk:graph': node_roles names 'wirte', which is not a node of the app" in text


def test_the_offline_phase_replays_the_recorded_episodes_under_counterfactual_credit(tmp_path, tiny_model_dir):
    """`credit: counterfactual` in an offline run: the mined episodes' steps are replayed through `online.app` (plain
    ChatOpenAI, through the loopback server) from their scenarios' inputs, and each offline row says what they cost;
    the replays are traced but never mined as data."""
    config = _project(tmp_path, tiny_model_dir, ["What is 2+2?", "Name a color."])
    assert CliRunner().invoke(cli, ["train", "--config", str(config)]).exit_code == 0  # records 4 episodes
    spec = yaml.safe_load(config.read_text())
    spec.update(phases=["offline"], data="runs/train/traces", run_dir="runs/offline")
    spec["marft"].update(credit="counterfactual", replays_per_action=1, offline_passes=1)
    config.write_text(yaml.safe_dump(spec))
    result = CliRunner().invoke(cli, ["train", "--config", str(config)])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (tmp_path / "runs" / "offline" / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(r["phase"] == "offline" for r in rows)
    assert sum(r["replays"] for r in rows) == 4 * 2  # 4 episodes x (planner, writer) x 1 replay
    assert sum(r["replays_used"] for r in rows) == 8 and sum(r["fallback_actions"] for r in rows) == 0
    from marft_lg import mine

    assert len(mine(tmp_path / "runs" / "offline" / "traces")) == 0  # traced, never mined as production data


def test_scenarios_from_traces_train_on_the_users_inputs_with_no_reference(tmp_path, tiny_model_dir):
    """`scenarios: {from_traces: ...}`: the mined episodes' inputs, deduplicated and split by hash, are what the
    online phase runs; a bad source is named with its train.yaml line before any work."""
    from typing import TypedDict

    from langgraph.graph import END, START, StateGraph

    from marft_lg import TeamChatModel, wrap
    from tests.unit.graph.graph_fakes import FakeEngine

    class S(TypedDict, total=False):
        question: str
        answer: str

    engine = FakeEngine(agents=("planner", "writer"))
    llm = TeamChatModel(team=engine)
    g = StateGraph(S)
    g.add_node("write", lambda s: {"answer": llm.invoke(s["question"]).content})
    g.add_edge(START, "write")
    g.add_edge("write", END)
    prod = wrap(g.compile(), team=engine, trace_dir=tmp_path / "prod", node_roles={"write": "writer"})
    questions = [f"Question {i}?" for i in range(12)]
    for q in [*questions, *questions[:4]]:  # users ask some things twice
        prod.invoke({"question": q})
    prod.close()

    config = _project(tmp_path, tiny_model_dir, ["unused"])
    spec = yaml.safe_load(config.read_text())
    spec["scenarios"] = {"from_traces": "prod", "input_keys": ["question"], "heldout": 0.25}
    config.write_text(yaml.safe_dump(spec))
    result = CliRunner().invoke(cli, ["train", "--config", str(config)])
    text = flat(result.output)
    assert result.exit_code == 0, result.output
    saved = [ln for ln in text.splitlines() if "users' inputs from" in ln]
    assert saved and "12 users' inputs" in saved[0] and "no references" in saved[0]
    n_train = int(saved[0].split("(")[1].split(" train")[0])
    assert 0 < n_train < 12
    row = json.loads((tmp_path / "runs" / "train" / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["episodes"] == 2 * n_train  # the train split only, group_size 2

    spec["scenarios"] = {"from_traces": "prod", "input_keys": "question"}
    config.write_text(yaml.safe_dump(spec))
    result = CliRunner().invoke(cli, ["train", "--config", str(config), "--overwrite"])
    assert result.exit_code == 2 and "input_keys" in flat(result.output) and "train.yaml:" in flat(result.output)


def test_a_warm_start_phase_teaches_from_fresh_rollouts_before_on_policy_training(tmp_path, tiny_model_dir):
    config = _project(tmp_path, tiny_model_dir, ["What is 2+2?", "Name a color."], update_scheme="simultaneous")
    spec = yaml.safe_load(config.read_text())
    spec["phases"] = ["online", "warm_start"]  # run in their order whatever the list's
    spec["warm_start"] = {"keep": "threshold", "threshold": -100.0, "epochs": 1}
    config.write_text(yaml.safe_dump(spec))
    result = CliRunner().invoke(cli, ["train", "--config", str(config)])
    text = flat(result.output)
    assert result.exit_code == 0, result.output
    assert "warm start: kept 4 of 4 episodes from 2 fresh rollouts of each of 2 scenarios" in text
    rows = [json.loads(x) for x in (tmp_path / "runs" / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in rows] == ["warm_start", "online"]
    assert set(rows[0]["updated_agents"]) == {"planner", "writer"}

    spec["warm_start"] = {"keep": "threshold", "epochs": 1}
    config.write_text(yaml.safe_dump(spec))
    result = CliRunner().invoke(cli, ["train", "--config", str(config), "--overwrite"])
    assert result.exit_code == 2 and "needs warm_start.threshold" in flat(result.output)
    assert "train.yaml:" in flat(result.output)


def test_a_reward_the_online_phase_can_never_compute_is_refused_before_any_work(tmp_path, tiny_model_dir):
    config = _project(tmp_path, tiny_model_dir, ["What is 2+2?"])
    spec = yaml.safe_load(config.read_text())
    spec["reward"] = {"weights": {"task_completion": 1.0}}  # the scenarios carry no reference
    config.write_text(yaml.safe_dump(spec))
    result = CliRunner().invoke(cli, ["train", "--config", str(config)])
    text = flat(result.output)
    assert result.exit_code == 2, result.output
    assert "can never be computed on the online phase's new episodes: task_completion needs a reference" in text
    assert not (tmp_path / "runs" / "train" / "metrics.jsonl").exists()
