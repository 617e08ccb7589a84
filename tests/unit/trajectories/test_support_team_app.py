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
