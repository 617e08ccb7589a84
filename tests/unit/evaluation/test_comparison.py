import json
import math

import pytest
from eval_factory import FormatAndAnswerReward, make_dataset, team_run

from marft_lg.evaluation.agent_metrics import agent_metrics, episode_metrics
from marft_lg.evaluation.comparison import compare_datasets

SIDS = [f"s{i}" for i in range(12)]
SCEN = {s: {"scenario_id": s, "reference": str(i), "expected_tools": ["search"]} for i, s in enumerate(SIDS)}


def test_agent_metrics_count_steps_tokens_loops_tools_and_format():
    ds = make_dataset([{
        "episode_id": "e1", "scenario_id": "s0",
        "actions": [
            {"agent": "planner", "completion": "go", "input_tokens": 7, "output_tokens": 3,
             "tool_calls": [{"name": "search"}, {"name": "calc"}, {"name": "search", "error": "timeout"}]},
            {"agent": "writer", "completion": "ANSWER: 0"},
            {"agent": "planner", "completion": "again"},
            {"agent": "writer", "completion": "bad"},
        ],
    }])
    m = agent_metrics(ds, scenarios=SCEN, formats={"writer": r"^ANSWER: \S+$"}, agents=["critic"]).set_index("agent")
    assert m.loc["planner", "steps"] == 2 and m.loc["writer", "steps"] == 2
    assert m.loc["planner", "input_tokens"] == 7 + 10
    # search ok, calc not expected, search errored -> 1 of 3 correct
    assert m.loc["planner", "tool_accuracy"] == pytest.approx(1 / 3)
    assert math.isnan(m.loc["writer", "tool_accuracy"])
    # planner->writer->planner->writer with a new completion each turn is ordinary work, not a handoff loop
    assert m.loc["planner", "handoff_loops"] == 0 and m.loc["writer", "handoff_loops"] == 0
    assert m.loc["writer", "format_compliance"] == 0.5
    assert m.loc["planner", "format_compliance"] == 1.0  # default: non-empty
    assert m.loc["critic", "steps"] == 0 and math.isnan(m.loc["critic", "format_compliance"])
    e = episode_metrics(ds).iloc[0]
    assert e["steps"] == 4 and e["handoff_loops"] == 0 and e["tool_errors"] == 1


def _episode(eid: str, agents: str, texts: list[str]) -> dict:
    return {"episode_id": eid, "scenario_id": "s0",
            "actions": [{"agent": {"S": "supervisor", "A": "a", "B": "b", "C": "c"}[x], "completion": t}
                        for x, t in zip(agents, texts, strict=True)]}


def test_handoff_loops_metric_counts_only_bouncing_without_progress():
    # a supervisor fanning out over 3 workers twice (the second round repeats the first's replies)
    fan = ["go", "a done", "next", "b done", "next", "c done"] * 2 + ["final"]
    # a and b bouncing 4 times with no progress (repeated text), and the same bouncing with new text each turn
    stuck = ["please clarify", "what do you need?", "please clarify", "what do you need?", "please clarify"]
    moving = ["draft 1", "revise", "draft 2", "revise more", "draft 3"]
    ds = make_dataset([_episode("fan", "SASBSC" * 2 + "S", fan), _episode("stuck", "ABABA", stuck),
                       _episode("moving", "ABABA", moving)])
    e = episode_metrics(ds).set_index("episode_id")["handoff_loops"]
    assert e.to_dict() == {"fan": 0, "stuck": 1, "moving": 0}
    m = agent_metrics(ds).set_index(["episode_id", "agent"])["handoff_loops"]
    assert m[("fan", "supervisor")] == 0 and m[("fan", "a")] == 0
    # the excess hand-off (the 4th) went to agent a
    assert m[("stuck", "a")] == 1 and m[("stuck", "b")] == 0
    assert m[("moving", "a")] == 0 and m[("moving", "b")] == 0


def test_bad_format_regex_is_reported_with_agent():
    ds = team_run("b", ["s0"], {"s0": "x"})
    with pytest.raises(ValueError, match="writer"):
        agent_metrics(ds, formats={"writer": "("})


def test_better_candidate_has_positive_team_and_component_deltas(tmp_path):
    base = team_run("b", SIDS, {s: "I think it is 3" for s in SIDS})
    cand = team_run("c", SIDS, {s: f"ANSWER: {SCEN[s]['reference']}" for s in SIDS})
    res = compare_datasets(base, cand, FormatAndAnswerReward(), scenarios=SCEN, seed=1)
    assert res.n_pairs == 12
    assert res.team.mean == pytest.approx(1.0) and res.team.low == pytest.approx(1.0)
    assert set(res.components) == {"format", "correct"}
    assert res.components["format"].mean == 1.0
    assert res.agents["writer"]["reward"].mean == pytest.approx(1.0)
    assert res.agents["planner"]["reward"].mean == 0.0
    path = res.save(tmp_path)
    data = json.loads(path.read_text())
    assert data["team_reward"]["mean"] == pytest.approx(1.0) and data["n_pairs"] == 12
    assert (tmp_path / "units.csv").exists()


def test_mixed_candidate_ci_straddles_and_costs_are_compared():
    base = team_run("b", SIDS, {s: f"ANSWER: {SCEN[s]['reference']}" for s in SIDS})
    # candidate right on half the scenarios, wrong format on the other half, and a handoff loop: planner and
    # writer bounce "again" / "?" back and forth (the repeats make no progress; the 3rd pass onward is excess)
    answers = {s: (f"ANSWER: {SCEN[s]['reference']}" if i % 2 else "nope") for i, s in enumerate(SIDS)}
    cand = team_run("c", SIDS, answers, loops=2, writer_tokens=20)
    res = compare_datasets(base, cand, FormatAndAnswerReward(), scenarios=SCEN, formats={"writer": r"^ANSWER: \S+$"})
    assert res.team.mean == pytest.approx(-0.5)
    assert res.team.low < res.team.mean < res.team.high <= 0.0
    assert res.episode_metrics["handoff_loops"].mean == 1.0
    assert res.episode_metrics["steps"].mean == 4.0
    assert res.cost_ratio() > 1.5
    assert res.agents["writer"]["format_compliance"].mean == pytest.approx(-5 / 6)


def test_unscored_episodes_and_unmatched_units_are_left_out_and_counted():
    base = team_run("b", SIDS, {s: "ANSWER: 0" for s in SIDS})
    cand = team_run("c", SIDS[:-2], {s: "ANSWER: 0" for s in SIDS[:-2]})
    res = compare_datasets(base, cand, FormatAndAnswerReward(fail_on={"c-s0"}), scenarios=SCEN)
    assert res.unmatched == {"baseline": ["s10", "s11"], "candidate": []}
    assert res.team.n == 9 and res.team.dropped == 1
    assert res.candidate.reward_errors == 1


def test_samples_per_scenario_are_averaged_before_pairing():
    eps = []
    for s in SIDS[:3]:
        for j, ans in enumerate(["ANSWER: x", "nope"]):
            eps.append({"episode_id": f"c-{s}-{j}", "scenario_id": s, "actions": [{"agent": "writer", "completion": ans}]})
    cand = make_dataset(eps)
    base = team_run("b", SIDS[:3], {s: "nope" for s in SIDS[:3]})
    res = compare_datasets(base, cand, FormatAndAnswerReward(), scenarios=SCEN)
    assert res.n_pairs == 3
    assert res.components["format"].mean == pytest.approx(0.5)


def test_reward_with_wrong_shape_is_rejected():
    class Bad:
        def score(self, dataset, scenarios=None):
            return {"nope": 1}

    ds = team_run("b", ["s0"], {"s0": "x"})
    with pytest.raises(TypeError, match="RewardResult"):
        compare_datasets(ds, ds, Bad())
