"""`marft-lg attribute` end to end on the tiny model: an f(llm) app file, a reward file and scenarios in; every step
replayed from the reference, the table printed and the report files written; bad flags refused before any model
loads."""

from __future__ import annotations

import json

import yaml
from typer.testing import CliRunner

from marft_lg.cli import app as cli

APP = """
from typing import TypedDict
from langgraph.graph import END, START, StateGraph

class S(TypedDict, total=False):
    question: str
    plan: str
    answer: str

def build_graph(llm):
    def planner(state):
        return {"plan": str(llm.invoke("Plan: " + state["question"]).content)}

    def writer(state):
        return {"answer": str(llm.invoke("Answer: " + state["plan"]).content)}

    g = StateGraph(S)
    g.add_node("planner", planner)
    g.add_node("writer", writer)
    g.add_edge(START, "planner")
    g.add_edge("planner", "writer")
    g.add_edge("writer", END)
    return g.compile()
"""


def _project(tmp_path):
    (tmp_path / "app.py").write_text(APP)
    (tmp_path / "reward.yaml").write_text(yaml.safe_dump({"weights": {"step_count": -0.1}}))
    (tmp_path / "scenarios.jsonl").write_text("".join(
        json.dumps({"scenario_id": f"s{i}", "inputs": {"question": f"q{i}"}}) + "\n" for i in range(3)))
    return ["attribute", "--app", f"{tmp_path / 'app.py'}:build_graph", "--reward", str(tmp_path / "reward.yaml"),
            "--scenarios", str(tmp_path / "scenarios.jsonl"), "--agents", "planner,writer", "--max-tokens", "4",
            "--out", str(tmp_path / "out")]


def test_attribute_replays_every_step_and_writes_the_report(tmp_path, tiny_model_dir):
    args = [*_project(tmp_path), "--model", tiny_model_dir, "--replays", "2", "--reference", "base"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "attribution.json").read_text())
    assert report["reference"] == "base" and report["episodes"] == 3
    assert report["replays"] == report["used"] == 3 * 2 * 2  # every step of every episode, twice, all held
    assert [a["agent"] for a in report["agents"]] == ["planner", "writer"]
    assert all(a["actions"] == 3 for a in report["agents"])
    # the reward counts steps only: no replacement moves it, so nobody is blamed
    assert report["blamed"] is None and all(a["shift"]["mean"] == 0 for a in report["agents"])
    for name in ("attribution.md", "attribution.html", "attribution.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0
    assert "Which agent is to blame" in (tmp_path / "out" / "attribution.md").read_text()
    assert "most to blame: no agent" in result.output


def test_attribute_refuses_a_bad_tools_flag_before_loading_a_model(tmp_path):
    result = CliRunner().invoke(cli, [*_project(tmp_path), "--model", "/nonexistent", "--tools", "sometimes"])
    assert result.exit_code != 0 and "use refuse or rerun" in result.output


def test_compare_attribute_adds_the_blame_section_with_the_baseline_as_reference(tmp_path, tiny_model_dir):
    from marft_lg.serving.team import Team

    team = Team(tiny_model_dir, ["planner", "writer"], registry=tmp_path / "registry", versions=None, seed=0)
    v1 = {r: team.save_version(r) for r in ("planner", "writer")}
    v2 = team.save_version("writer")
    team.close()
    args = [*_project(tmp_path), "--model", tiny_model_dir]
    args[0] = "compare"
    args += ["--registry", str(tmp_path / "registry"), "--baseline", f"planner={v1['planner']},writer={v1['writer']}",
             "--candidate", f"writer={v2}", "--attribute", "1", "--no-drift"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "attribution" / "attribution.json").read_text())
    assert report["reference"] == {"writer": v1["writer"]}  # the changed role against its baseline version
    assert report["replays"] == report["used"] == 3 * 2  # both steps of the candidate's 3 episodes, once each
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Which agent is to blame" in md and f"writer: `{v1['writer']}`" in md


def _blame(agent, all_, failed, successful):
    from marft_lg.evaluation.attribution import AgentBlame
    from marft_lg.evaluation.stats import bootstrap_ci

    return AgentBlame(agent, len(all_), bootstrap_ci(all_), bootstrap_ci(failed), bootstrap_ci(successful))


def test_the_verdict_reads_all_episodes_not_the_failed_ones_alone():
    """An unbroken team: a failed episode's replay tends to do better whoever is replayed (a failure is partly bad
    luck), so both agents shift up on failed episodes and down on successful ones; over all episodes neither moves
    the return, and no blame is significant. A broken agent moves it on every episode."""
    from marft_lg.evaluation.attribution import Attribution, blame_markdown

    def result(agents):
        return Attribution(agents=agents, reference="base", episodes=12, failed_episodes=6, replays=24, used=24,
                           diverged=0, failed=0)

    luck = [1.0, 1.0, 0.0, 1.0, 0.0, 0.0] + [-1.0, 0.0, -1.0, 0.0, -1.0, -1.0]  # 6 failed, then 6 successful
    control = result([_blame(agent, luck, luck[:6], luck[6:]) for agent in ("messenger", "recorder")])
    assert all(a.shift_failed.low > 0 for a in control.agents)  # the failed column alone would blame both
    assert not control.significant and control.to_dict()["significant"] is False
    broken = [1.0] * 10 + [0.0, 1.0]
    sabotaged = result([_blame("messenger", broken, broken[:6], broken[6:]), _blame("recorder", luck, luck[:6],
                                                                                      luck[6:])])
    assert sabotaged.blamed == "messenger" and sabotaged.significant
    assert "**messenger** (its CI is above 0)" in blame_markdown(sabotaged)
