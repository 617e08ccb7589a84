"""The support_team example graph on its scripted model: answers, tool errors and the critic's revision cap."""

from __future__ import annotations

from examples.support_team.app import MAX_REVISIONS, SCENARIOS, build_graph, lookup, parse_topics
from examples.support_team.fake import FakeSupportModel
from marft_lg.trajectories.scenarios import ScenarioSet


def test_every_scenario_is_answered_with_its_reference():
    graph = build_graph(FakeSupportModel())
    scenarios = ScenarioSet.load(SCENARIOS)
    assert {s.split for s in scenarios} == {"train", "heldout"}
    for s in scenarios:
        out = graph.invoke(s.inputs, {"max_concurrency": 1})
        assert s.reference in out["answer"], s.scenario_id
        assert sorted(out["topics"]) == sorted(s.meta["topics"])
        assert out["revisions"] <= MAX_REVISIONS


def test_urgent_question_hits_the_revision_cap():
    out = build_graph(FakeSupportModel()).invoke({"question": "Urgent: is my refund on its way?"})
    assert out["revisions"] == MAX_REVISIONS and out["critique"].startswith("REVISE")


def test_lookup_tool_and_topic_parsing():
    assert "30 days" in lookup.invoke({"topic": "Refund Policy"})
    assert parse_topics("TOPICS: a, b, a, c, d.") == ["a", "b", "c"]


def test_command_line_fake_run_traces_and_mines(tmp_path, capsys):
    from examples.support_team.__main__ import main
    from marft_lg.trajectories.mining import mine

    assert main(["--fake", "--limit", "2", "--trace-dir", str(tmp_path)]) == 0
    dataset = mine(tmp_path)
    assert sorted(dataset.episode_ids) == ["st-support-express-shipping", "st-support-refund-window"]
    assert set(dataset.actions["agent"]) == {"planner", "researcher", "writer", "critic"}
    assert "2/2 answers contain the reference" in capsys.readouterr().out.replace("\n", " ")
