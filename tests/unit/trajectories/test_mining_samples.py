"""Mining the committed sample traces (recorded by real instrumentors) reproduces what the recording run knew."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from marft_lg.trajectories.mining import mine_with_report

SAMPLES = Path(__file__).resolve().parents[3] / "traces" / "samples"
FORMATS = sorted(p.name.removesuffix(".truth.json") for p in SAMPLES.glob("*.truth.json"))


def test_samples_exist_for_third_party_formats():
    assert {"openinference", "openllmetry"} <= set(FORMATS)


@pytest.mark.parametrize("fmt", FORMATS)
def test_sample_matches_truth(fmt):
    truth = json.loads((SAMPLES / f"{fmt}.truth.json").read_text())
    dataset, report = mine_with_report(SAMPLES / f"{fmt}.jsonl")
    assert report.quarantined == {}
    assert sorted(dataset.episode_ids) == sorted(truth["episodes"])
    for episode_id, want in truth["episodes"].items():
        episode = dataset.episodes.set_index("episode_id").loc[episode_id]
        actions = dataset.actions[dataset.actions["episode_id"] == episode_id]
        assert episode["scenario_id"] == want["scenario_id"]
        assert episode["n_actions"] == want["n_actions"]
        assert actions["order"].tolist() == list(range(want["n_actions"]))
        assert actions["agent"].tolist() == want["agents"]
        assert actions["completion"].tolist() == want["completions"]
        assert actions["tool_errors"].tolist() == want["tool_errors"]
        assert [list(d) for d in actions["depends_on"]] == want["depends_on"]
        assert episode["agents"] == list(dict.fromkeys(want["agents"]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_sample_tool_calls_attached_to_issuing_researcher(fmt):
    dataset = mine_with_report(SAMPLES / f"{fmt}.jsonl")[0]
    with_tools = dataset.actions[dataset.actions["tool_calls"].map(len) > 0]
    assert set(with_tools["agent"]) == {"researcher"}
    for calls in with_tools["tool_calls"]:
        assert [c["name"] for c in calls] == ["lookup"]
        call = calls[0]
        assert (call["result"] is None) == (call["error"] is not None)
    errors = [c for calls in with_tools["tool_calls"] for c in calls if c["error"]]
    assert len(errors) == 1 and "gift_cards" in errors[0]["error"]


def test_samples_are_small():
    assert sum(p.stat().st_size for p in SAMPLES.glob("*.jsonl")) < 1_000_000


def test_feedback_recorded_later_is_joined_to_the_own_sample(tmp_path):
    from marft_lg.tracing.feedback import record_feedback

    record_feedback("own-support-gift-card", "resolved", False, trace_dir=tmp_path)
    record_feedback("own-support-gift-card", "csat", 2, trace_dir=tmp_path)
    record_feedback("own-support-gift-card", "csat", 4, trace_dir=tmp_path)
    dataset, report = mine_with_report([SAMPLES / "own.jsonl", tmp_path])
    feedback = dataset.episodes.set_index("episode_id")["feedback"]
    assert feedback["own-support-gift-card"] == {"resolved": False, "csat": 4}
    assert feedback["own-support-urgent-password"] == {}
    assert report.quarantined == {}
