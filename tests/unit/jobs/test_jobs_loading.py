"""job.yaml's `app`, `stages` and `node_roles`: loaded relative to the job file, checked with the file named."""

from __future__ import annotations

import types
import uuid

import pytest
import yaml
from jobs_fakes import make_job
from typer.testing import CliRunner

from marft_lg.cli import app as cli
from marft_lg.jobs.config import RetrainJob
from marft_lg.jobs.pipeline import load_stages
from marft_lg.jobs.stages import LibraryStages
from marft_lg.loading import LoadError


def _job(tmp_path, **settings) -> RetrainJob:
    p = tmp_path / "job.yaml"
    p.write_text(yaml.safe_dump({"name": "n", "registry": "adapters", **settings}))
    return RetrainJob.from_yaml(p)


def _write_app(folder, name: str) -> None:
    """`<name>.py` (next to job.yaml) importing a sibling module; build_graph returns a tiny LangGraph app."""
    (folder / f"{name}_nodes.py").write_text("def step(state):\n    return {'answer': 'a'}\n")
    (folder / f"{name}.py").write_text(
        f"from typing import TypedDict\nfrom langgraph.graph import END, START, StateGraph\nimport {name}_nodes\n\n"
        "class S(TypedDict, total=False):\n    answer: str\n\n"
        "def build_graph(llm):\n    g = StateGraph(S)\n"
        f"    g.add_node('draft', {name}_nodes.step)\n    g.add_edge(START, 'draft')\n    g.add_edge('draft', END)\n"
        "    return g.compile()\n")


@pytest.mark.parametrize("form", ["module", "file"])
def test_app_next_to_job_yaml_loads_and_is_wrapped_with_node_roles(tmp_path, form):
    name = f"jobapp_{uuid.uuid4().hex[:8]}"
    _write_app(tmp_path, name)
    spec = f"{name}:build_graph" if form == "module" else f"{name}.py:build_graph"
    job = _job(tmp_path, app=spec, agents=["writer"], node_roles={"draft": "writer"})
    assert job.node_roles == {"draft": "writer"} and job.base_dir == tmp_path.resolve()
    stages = LibraryStages(job)
    wrapped = stages.app(types.SimpleNamespace(run_dir=tmp_path / "run"), team=None, name="shadow")
    try:
        assert wrapped.node_roles == {"draft": "writer"}
    finally:
        wrapped.close()


def test_a_bad_app_fails_when_the_stages_are_built_naming_the_job_file(tmp_path):
    job = _job(tmp_path, app="no_such_jobapp_xyz:build_graph")
    with pytest.raises(LoadError, match=r"job.yaml: cannot load app 'no_such_jobapp_xyz:build_graph': no module named"):
        LibraryStages(job)


def test_retrain_with_a_bad_app_exits_2_before_any_work(tmp_path):
    path = make_job(tmp_path / "job", stages="marft_lg.jobs.stages:LibraryStages", app="no_such_jobapp_xyz:build")
    out = CliRunner().invoke(cli, ["retrain", "--job", str(path)])
    assert out.exit_code == 2, out.output
    assert "job.yaml: cannot load app 'no_such_jobapp_xyz:build': no module named 'no_such_jobapp_xyz'" in out.output
    assert "Traceback" not in out.output


def test_stages_file_relative_to_job_yaml(tmp_path):
    (tmp_path / "my_stages.py").write_text(
        "class Stages:\n    def __init__(self, job):\n        self.job = job\n"
        + "".join(f"\n    def {m}(self, *a):\n        pass\n" for m in ("live_versions", "mine", "train", "compare", "promote")))
    job = _job(tmp_path, stages="my_stages.py:Stages")
    assert load_stages(job).job is job
    bad = _job(tmp_path, stages="my_stages.py:Stagez")
    with pytest.raises(LoadError, match=r"job.yaml:\d+: cannot load stages 'my_stages.py:Stagez': .* no attribute 'Stagez'"):
        load_stages(bad)


@pytest.mark.parametrize(("node_roles", "message"), [
    (["draft"], "node_roles: expected a mapping of text to text or null, got list"),
    ({"draft": 1}, "node_roles.draft: expected text, got int 1"),
    ({"draft": "critic"}, "node_roles: node 'draft' maps to role 'critic', which is not one of the agents"),
])
def test_node_roles_are_checked_with_the_file_and_key_named(tmp_path, node_roles, message):
    with pytest.raises(ValueError, match=rf"job.yaml:\d+: {message}"):
        _job(tmp_path, agents=["writer"], node_roles=node_roles)


def test_config_path_is_not_a_setting(tmp_path):
    with pytest.raises(ValueError, match=r"job.yaml:\d+: config_path: unknown job key"):
        _job(tmp_path, config_path="x")
    assert "config_path" not in _job(tmp_path).to_dict()
