"""`marft-lg compare` without a model: the app loading, --node-roles, and the first-project baseline.

The Team and `shadow_compare` are replaced by fakes; what is checked is what the command hands them.
"""

from __future__ import annotations

import types
import uuid

import pytest
import yaml
from typer.testing import CliRunner

from marft_lg.cli import app as cli
from tests.cli_text import flat


class FakeTeam:
    last: FakeTeam | None = None

    def __init__(self, model, roles, registry=None, **kw):
        self.model, self.roles, self.registry = model, roles, registry
        FakeTeam.last = self

    def agents(self):
        return list(self.roles)

    def close(self):
        pass


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A first project: an app file that imports a sibling module, a reward, scenarios, an empty registry."""
    seen: dict = {}

    def fake_shadow_compare(wrapped, baseline, candidate, scenarios, reward, **kw):
        seen.update(app=wrapped, baseline=baseline, candidate=candidate)
        return types.SimpleNamespace(meta={"candidate": candidate})

    monkeypatch.setattr("marft_lg.serving.team_factory.team", FakeTeam)
    monkeypatch.setattr("marft_lg.evaluation.shadow.shadow_compare", fake_shadow_compare)
    monkeypatch.setattr("marft_lg.evaluation.commands._finish",
                        lambda result, gate, out, console, sections=None: types.SimpleNamespace(promote=False))
    helper = f"nodes_{uuid.uuid4().hex[:8]}"
    appdir = tmp_path / "myapp"
    appdir.mkdir()
    (appdir / f"{helper}.py").write_text(
        "def planner(state):\n    return {'plan': 'p'}\n\ndef writer(state):\n    return {'answer': 'a'}\n")
    (appdir / "app.py").write_text(
        f"from typing import TypedDict\nfrom langgraph.graph import END, START, StateGraph\nimport {helper}\n\n"
        "class S(TypedDict, total=False):\n    question: str\n    plan: str\n    answer: str\n\n"
        "def build_graph(llm):\n"
        "    g = StateGraph(S)\n"
        f"    g.add_node('plan_step', {helper}.planner)\n    g.add_node('draft', {helper}.writer)\n"
        "    g.add_edge(START, 'plan_step')\n    g.add_edge('plan_step', 'draft')\n    g.add_edge('draft', END)\n"
        "    return g.compile()\n")
    (tmp_path / "reward.yaml").write_text(yaml.safe_dump({"weights": {"step_count": -0.1}}))
    (tmp_path / "scenarios.jsonl").write_text('{"scenario_id": "s1", "inputs": {"question": "q"}}\n')
    base = ["compare", "--app", str(appdir / "app.py") + ":build_graph", "--reward", str(tmp_path / "reward.yaml"),
            "--scenarios", str(tmp_path / "scenarios.jsonl"), "--registry", str(tmp_path / "registry"), "--create-registry",
            "--agents", "planner,writer", "--out", str(tmp_path / "out")]
    return types.SimpleNamespace(seen=seen, args=base, root=tmp_path)


def test_first_project_compares_live_against_the_initial_adapters_and_says_so(project):
    result = CliRunner().invoke(cli, [*project.args, "--candidate", "writer=init"])
    assert result.exit_code == 0, result.output
    assert project.seen["baseline"] == {"planner": "init", "writer": "init"}
    text = flat(result.output)
    assert "has no live version for ['planner', 'writer']" in text
    assert "comparing against their initial adapters, i.e. --baseline planner=init,writer=init" in text


def test_app_file_imports_its_siblings_and_node_roles_reach_the_wrapped_app(project):
    result = CliRunner().invoke(cli, [*project.args, "--candidate", "writer=init",
                                      "--node-roles", "plan_step=planner,draft=writer"])
    assert result.exit_code == 0, result.output
    assert project.seen["app"].node_roles == {"plan_step": "planner", "draft": "writer"}


def test_agents_with_models_build_a_team_of_several_bases(project):
    args = list(project.args)
    args[args.index("--agents") + 1] = "planner=/models/a,writer"
    result = CliRunner().invoke(cli, [*args, "--model", "/models/b", "--candidate", "writer=init"])
    assert result.exit_code == 0, result.output
    assert FakeTeam.last.model == {"planner": "/models/a", "writer": "/models/b"}
    assert FakeTeam.last.roles == ["planner", "writer"]
    assert project.seen["baseline"] == {"planner": "init", "writer": "init"}
    args[args.index("--agents") + 1] = "planner=,writer"
    result = CliRunner().invoke(cli, [*args, "--candidate", "writer=init"])
    assert result.exit_code == 2 and "is not ROLE or ROLE=MODEL" in flat(result.output)


@pytest.mark.parametrize(("extra", "message"), [
    (["--node-roles", "plan_step=critic"], "node 'plan_step' maps to role 'critic', which is not one of the agents"),
    (["--node-roles", "plan_step"], "'plan_step' is not node=role"),
    (["--baseline", "prod"], "alias 'prod' has no version for ['planner', 'writer'] in registry"),
    ([], "alias 'candidate' is not set in registry"),
])
def test_bad_versions_and_node_roles_are_usage_errors_saying_what_to_pass(project, extra, message):
    result = CliRunner().invoke(cli, [*project.args, *extra])
    assert result.exit_code == 2, result.output
    assert message in flat(result.output)
    assert "Traceback" not in result.output


def test_a_bad_app_spec_is_a_usage_error_naming_what_is_missing(project):
    args = list(project.args)
    args[args.index("--app") + 1] = str(project.root / "myapp" / "app.py") + ":build_grph"
    result = CliRunner().invoke(cli, [*args, "--candidate", "writer=init"])
    assert result.exit_code == 2, result.output
    text = flat(result.output)
    assert "has no attribute 'build_grph'; did you mean 'build_graph'?" in text
    args[args.index("--app") + 1] = "missing_dir/app.py:build_graph"
    result = CliRunner().invoke(cli, [*args, "--candidate", "writer=init"])
    assert result.exit_code == 2 and "does not exist" in flat(result.output)


def test_a_bad_gate_file_is_a_usage_error_before_any_work(project):
    gate = project.root / "gate.yaml"
    gate.write_text("min_pairs: [1,\n")
    result = CliRunner().invoke(cli, [*project.args, "--candidate", "writer=init", "--gate", str(gate)])
    assert result.exit_code == 2, result.output
    assert "gate.yaml" in flat(result.output) and "Traceback" not in result.output
    assert "app" not in project.seen  # failed before the replay
