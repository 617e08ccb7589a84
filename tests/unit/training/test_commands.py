import json
import re

import pytest
import yaml
from typer.testing import CliRunner

from marft_lg._config import ConfigError
from marft_lg.training.commands import TrainFile


def test_train_yaml_unknown_key_and_missing_reward(tmp_path):
    p = tmp_path / "train.yaml"
    p.write_text("agents: [a]\nreward: r.yaml\nphase: [offline]\n")
    with pytest.raises(ConfigError, match=r"train.yaml:3: phase: unknown train.yaml key; did you mean 'phases'"):
        TrainFile.load(p)
    p.write_text("agents: [a]\n")
    with pytest.raises(ConfigError, match="reward is missing"):
        TrainFile.load(p)


def test_cli_offline_training_publishes_candidate(chain_dataset, tiny_model_dir, tmp_path):
    from marft_lg.cli import app
    from marft_lg.serving.registry.store import AdapterRegistry

    ds, scenarios = chain_dataset
    ds.to_parquet(tmp_path / "data")
    (tmp_path / "train.yaml").write_text(yaml.safe_dump({
        "model": tiny_model_dir, "agents": ["reasoner", "actor"], "registry": "registry", "versions": None,
        "run_dir": "run", "data": "data", "phases": ["offline"],
        "reward": {"weights": {"format_compliance": 1.0},
                   "components": {"format_compliance": {"agents": {"actor": "^[A-Za-z]"}}}},
        "marft": {"learning_rate": 1e-3, "kl_cut": None, "plots": False, "offline_episodes_per_iteration": 4},
    }))
    result = CliRunner().invoke(app, ["train", "--config", str(tmp_path / "train.yaml")])
    assert result.exit_code == 0, result.output
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # 3 scenarios x 2 episodes, a scenario's episodes in one chunk: chunks of 4 and 2 episodes
    assert len(rows) == 2 and rows[0]["phase"] == "offline" and [r["episodes"] for r in rows] == [4, 2]
    reg = AdapterRegistry(tmp_path / "registry")
    assert set(reg.alias("candidate")) == {"reasoner", "actor"}
    assert (tmp_path / "run" / "checkpoints" / "latest").exists()


# --- online.app loading and node_roles ---------------------------------------------------------------

def _app_next_to(folder, name: str) -> None:
    """`<name>.py` with `build(llm)` that imports a sibling module, written next to train.yaml."""
    (folder / f"{name}_helper.py").write_text("SUFFIX = 'ok'\n")
    (folder / f"{name}.py").write_text(
        f"import {name}_helper\n\n"
        "class Graph:  # a stand-in compiled graph: it has invoke, and equals the tag it was built with\n"
        "    def __init__(self, tag):\n        self.tag = tag\n\n"
        "    def invoke(self, *a, **k):\n        return None\n\n"
        "    def __eq__(self, other):\n        return getattr(other, 'tag', other) == self.tag\n\n"
        f"def build(llm):\n    return Graph(('graph', {name}_helper.SUFFIX))\n")


def test_online_app_next_to_train_yaml_loads_without_pythonpath(tmp_path):
    import uuid

    name = f"trainapp_{uuid.uuid4().hex[:8]}"
    _app_next_to(tmp_path, name)
    p = tmp_path / "train.yaml"
    for spec in (f"{name}:build", f"{name}.py:build"):
        p.write_text(yaml.safe_dump({"agents": ["a"], "reward": "r.yaml", "phases": ["online"], "online": {"app": spec}}))
        assert TrainFile.load(p).app_factory()(None) == ("graph", "ok")


def test_bad_online_app_fails_first_naming_the_file_and_what_is_missing(tmp_path):
    from marft_lg.cli import app

    p = tmp_path / "train.yaml"
    # the model does not exist either: the app is checked before anything is loaded
    p.write_text(yaml.safe_dump({"model": str(tmp_path / "no-model"), "agents": ["a"], "phases": ["online"],
                                 "scenarios": "s.jsonl", "reward": {"weights": {"step_count": -0.1}},
                                 "online": {"app": "no_such_app_mod_xyz:build"}}))
    result = CliRunner().invoke(app, ["train", "--config", str(p)])
    assert result.exit_code == 2, result.output
    text = " ".join(re.sub("[│╭╮╰╯─]", " ", result.output).split())  # rich's error box, unwrapped
    assert "cannot load online.app 'no_such_app_mod_xyz:build': no module named 'no_such_app_mod_xyz'" in text
    assert "Traceback" not in text


@pytest.mark.parametrize(("node_roles", "message"), [
    (["reasoner"], "online.node_roles must map node names to agent roles"),
    ({"think": "critic"}, "online.node_roles: node 'think' maps to role 'critic', which is not one of the agents"),
])
def test_online_node_roles_are_checked_with_the_file_and_key_named(tmp_path, node_roles, message):
    p = tmp_path / "train.yaml"
    p.write_text(yaml.safe_dump({"agents": ["reasoner", "actor"], "reward": "r.yaml",
                                 "online": {"node_roles": node_roles}}))
    with pytest.raises(ConfigError, match=rf"train.yaml:\d+: {message}"):
        TrainFile.load(p)


def test_online_node_roles_reach_wrap(tmp_path, monkeypatch):
    """The online phase wraps the app with train.yaml's online.node_roles (model and trainer faked)."""
    import importlib
    import types
    import uuid

    from marft_lg.cli import app

    seen = {}

    class FakeTeam:
        def __init__(self, model, agents, **kw):
            self.agents, self.registry = agents, types.SimpleNamespace(set_alias=lambda *a, **k: None)

        def save_version(self, role, **kw):
            return "v1"

        def versions(self):
            return {}

        def close(self):
            pass

    class FakeTrainer:
        run_id, iteration, unpublished, frozen_roles = "run", 1, set(), []
        roles, update_steps = ["reasoner", "actor"], {"reasoner": 1, "actor": 1}
        cfg = types.SimpleNamespace(checkpoint_every=1, update_scheme="parallel")
        tracker = types.SimpleNamespace(context={})

        def __init__(self, *a, **kw):
            pass

        def fit_online(self, wrapped, scenarios, iterations):
            seen["app"], seen["scenarios"] = wrapped, scenarios

        def close(self, status):
            seen["status"] = status

    wrapped = types.SimpleNamespace(close=lambda: seen.setdefault("closed", True))

    def fake_wrap(graph, **kw):
        seen["graph"], seen["wrap"] = graph, kw
        return wrapped

    monkeypatch.setattr("marft_lg.serving.team_factory.team", FakeTeam)
    monkeypatch.setattr("marft_lg.training.trainer.MARFTTrainer", FakeTrainer)
    monkeypatch.setattr(importlib.import_module("marft_lg.graph.wrap"), "wrap", fake_wrap)
    name = f"trainapp_{uuid.uuid4().hex[:8]}"
    _app_next_to(tmp_path, name)
    (tmp_path / "s.jsonl").write_text('{"scenario_id": "s1", "inputs": {"q": "1+1"}}\n')
    p = tmp_path / "train.yaml"
    p.write_text(yaml.safe_dump({"agents": ["reasoner", "actor"], "phases": ["online"], "scenarios": "s.jsonl",
                                 "reward": {"weights": {"step_count": -0.1}},
                                 "online": {"app": f"{name}:build", "iterations": 1,
                                            "node_roles": {"think": "reasoner", "answer": "actor"}}}))
    result = CliRunner().invoke(app, ["train", "--config", str(p)])
    assert result.exit_code == 0, result.output
    assert seen["graph"] == ("graph", "ok") and seen["app"] is wrapped and seen["closed"]
    assert seen["status"] == "FINISHED"
    assert seen["wrap"]["node_roles"] == {"think": "reasoner", "answer": "actor"}
    assert seen["wrap"]["serve_http"] is True  # an app's own ChatOpenAI calls for a role reach the trained team


# --- model: {role: model spec} (a team of several base models) ----------------------------------------

def test_train_yaml_model_mapping_gives_the_agents(tmp_path):
    p = tmp_path / "train.yaml"
    p.write_text("model:\n  planner: embedded:smollm2-135m-instruct\n  writer: /models/w\nreward: r.yaml\n")
    spec = TrainFile.load(p)
    assert spec.model == {"planner": "embedded:smollm2-135m-instruct", "writer": "/models/w"}
    assert spec.agents == ["planner", "writer"]
    p.write_text("model: {planner: a, writer: b}\nagents: [writer, planner]\nreward: r.yaml\n")
    assert TrainFile.load(p).agents == ["writer", "planner"]
    p.write_text("model: m\nagents: [a]\nreward: r.yaml\n")  # a plain string as before
    assert TrainFile.load(p).model == "m"


@pytest.mark.parametrize("text, message", [
    ("model:\n  planner: a\n  writer: b\nagents: [planner, critic]\n",
     r"train.yaml:4: agents: agents \['planner', 'critic'\] do not match the roles of the model mapping"),
    ("model:\n  planner: a\n  writer: ''\n", r"train.yaml:3: model.writer: the model of role 'writer' is empty"),
    ("model:\n  planner: a\n  w.x: b\n", r"train.yaml:3: model.w.x: invalid agent role 'w.x'"),
    ("model: {}\nagents: [a]\n", r"train.yaml:1: model: model is an empty mapping"),
    ("model:\n  planner: [a]\n", r"train.yaml:2: model.planner: expected text"),
])
def test_train_yaml_bad_model_mapping_names_file_and_line(tmp_path, text, message):
    p = tmp_path / "train.yaml"
    p.write_text(text + "reward: r.yaml\n")
    with pytest.raises(ConfigError, match=message):
        TrainFile.load(p)


def test_ray_worker_spec_gets_the_model_mapping(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import marft_lg.distributed.rollout as rollout
    from marft_lg.training import commands

    p = tmp_path / "train.yaml"
    p.write_text("model: {planner: a, writer: b}\nreward: r.yaml\n")
    spec = TrainFile.load(p)
    seen = {}
    monkeypatch.setattr(rollout, "RayCollector", lambda cfg, worker, **kw: seen.setdefault("worker", worker))
    cfg = SimpleNamespace(seed=0, max_new_tokens=8, temperature=1.0, rollout_concurrency=2)
    commands._ray_collector(spec, spec.app_spec(cfg), cfg, SimpleNamespace(versions=dict), "run")
    assert seen["worker"].model == {"planner": "a", "writer": "b"} and seen["worker"].agents == ["planner", "writer"]


def test_train_agents_are_checked_against_the_agents_with_file_and_line(tmp_path):
    p = tmp_path / "train.yaml"
    p.write_text("agents: [solver, checker]\nreward: r.yaml\nmarft:\n  train_agents: [checker]\n")
    assert TrainFile.load(p).config().train_agents == ["checker"]
    p.write_text("agents: [solver, checker]\nreward: r.yaml\nmarft:\n  train_agents: [planner]\n")
    with pytest.raises(ConfigError, match=r"train.yaml:4: marft.train_agents: train_agents names \['planner'\]"):
        TrainFile.load(p)
    p.write_text("agents: [solver]\nreward: r.yaml\nmarft:\n  train_agents: []\n")
    with pytest.raises(ConfigError, match=r"train.yaml:4: .*train_agents.*is empty"):
        TrainFile.load(p)
