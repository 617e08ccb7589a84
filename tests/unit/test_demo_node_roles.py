"""`marft-lg demo --node-roles`: checked before any work, and passed to both wrapped math-team apps."""

from __future__ import annotations

import importlib
import re
import types

import pytest
from typer.testing import CliRunner

from marft_lg.cli import app as cli
from marft_lg.demo import BUDGETS, run_demo


class _Stop(Exception):
    pass


class FakeTeam:
    def __init__(self, model, roles, **kw):
        self.registry = types.SimpleNamespace(promote=lambda *a, **k: None)

    def save_version(self, role, **kw):
        return "v1"

    def load_version(self, role, version):
        pass

    def close(self):
        pass


@pytest.mark.parametrize(("given", "expected"), [
    (None, {"reasoner": "reasoner", "actor": "actor"}),
    ("reasoner=actor,actor=reasoner", {"reasoner": "actor", "actor": "reasoner"}),
])
def test_run_demo_wraps_the_app_with_node_roles(tmp_path, monkeypatch, given, expected):
    seen = {}

    def fake_wrap(graph, **kw):
        seen.update(kw)
        raise _Stop

    monkeypatch.setattr("marft_lg.serving.team_factory.team", FakeTeam)
    monkeypatch.setattr(importlib.import_module("marft_lg.graph.wrap"), "wrap", fake_wrap)
    with pytest.raises(_Stop):
        run_demo(BUDGETS["smoke"], tmp_path / "run", model="unused", trace_root=tmp_path / "traces", node_roles=given)
    assert seen["node_roles"] == expected


def test_demo_rejects_bad_node_roles_before_any_work(tmp_path):
    run_dir = tmp_path / "run"
    out = CliRunner().invoke(cli, ["demo", "--budget", "smoke", "--run-dir", str(run_dir),
                                   "--node-roles", "reasoner=critic"])
    assert out.exit_code == 2, out.output
    text = " ".join(re.sub("[│╭╮╰╯─]", " ", out.output).split())
    assert "node 'reasoner' maps to role 'critic', which is not one of the agents ['reasoner', 'actor']" in text
    assert not run_dir.exists()


def test_demo_refuses_a_trace_folder_an_earlier_run_of_the_same_name_left(tmp_path):
    """A run directory removed by hand leaves its traces behind; a new run of that name would mine them too."""
    run_dir, traces = tmp_path / "run", tmp_path / "traces"
    (traces / "demo-run").mkdir(parents=True)
    (traces / "demo-run" / "spans-old.jsonl").write_text("{}\n")
    out = CliRunner().invoke(cli, ["demo", "--budget", "smoke", "--run-dir", str(run_dir), "--trace-root", str(traces)])
    assert out.exit_code == 2, out.output
    text = " ".join(re.sub("[│╭╮╰╯─]", " ", out.output).split())
    assert "already holds the traces of an earlier run named 'run'" in text
    assert not run_dir.exists()


def test_the_warm_start_and_dynamic_sampling_flags_reach_the_run(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr("marft_lg.demo.run_demo", lambda *a, **kw: seen.update(kw))
    out = CliRunner().invoke(cli, ["demo", "--budget", "smoke", "--run-dir", str(tmp_path / "r"), "--warm-start",
                                   "--dynamic-sampling"])
    assert out.exit_code == 0, out.output
    assert seen["warm_start"] == {} and seen["credit"] is None  # dynamic sampling is the demo's default
    CliRunner().invoke(cli, ["demo", "--budget", "smoke", "--run-dir", str(tmp_path / "r2")])
    assert seen["warm_start"] is None and seen["credit"] is None
    out = CliRunner().invoke(cli, ["demo", "--budget", "smoke", "--run-dir", str(tmp_path / "r3"),
                                   "--no-dynamic-sampling"])
    assert out.exit_code == 0, out.output
    assert seen["credit"] == {"dynamic_sampling": False}


def test_the_demo_trains_with_its_settings_unless_told_otherwise(tmp_path, monkeypatch):
    """The trainer's config is the math team's settings, the demo's and the caller's, in that order."""
    from marft_lg.demo import DemoRun

    configs = []

    class Stop(Exception):
        pass

    def fake_trainer(team, reward, cfg, *a, **kw):
        configs.append(cfg)
        raise Stop

    monkeypatch.setattr("marft_lg.training.trainer.MARFTTrainer", fake_trainer)
    for credit in (None, {"dynamic_sampling": False}, {"credit": "group"}):
        run = DemoRun(BUDGETS["smoke"], tmp_path / f"run{len(configs)}", model="unused", seed=0,
                      trace_root=tmp_path / "traces", console=None, node_roles=None, credit=credit)
        run.dataset, run.n_traced = [], 2
        with pytest.raises(Stop):
            run.train_offline()
    assert [c.dynamic_sampling for c in configs] == [True, False, True]
    # reward-to-go credit is the demo's too (the math team places its reward on the actions that earned it); a
    # caller's `credit` replaces it
    assert [c.credit for c in configs] == ["reward_to_go", "reward_to_go", "group"]
