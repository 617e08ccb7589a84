import json

import pytest
from eval_factory import FormatAndAnswerReward, team_run

from marft_lg.evaluation.comparison import compare_datasets
from marft_lg.evaluation.gate import GateDecision, PromotionGate

SIDS = [f"s{i}" for i in range(10)]
SCEN = {s: {"scenario_id": s, "reference": str(i), "expected_tools": ["search"]} for i, s in enumerate(SIDS)}
RIGHT = {s: f"ANSWER: {SCEN[s]['reference']}" for s in SIDS}
WRONG_FORMAT = {s: "the answer is probably something" for s in SIDS}
FORMAT_ONLY = {s: "ANSWER: ?" for s in SIDS}


def _compare(base_answers, cand_answers, base_kw=None, **kw):
    base = team_run("b", SIDS, base_answers, **(base_kw or {}))
    cand = team_run("c", SIDS, cand_answers, **kw)
    return compare_datasets(base, cand, FormatAndAnswerReward(), scenarios=SCEN, formats={"writer": r"^ANSWER: \S+$"})


def test_better_candidate_is_promoted():
    decision = PromotionGate().evaluate(_compare(FORMAT_ONLY, RIGHT))
    assert decision.promote, decision.reasons
    assert decision.reasons == []
    assert {c.name for c in decision.checks} >= {"team_reward_gain", "team_reward_ci_lower_above_zero",
                                                 "component:format", "agent:writer:reward", "cost_ratio"}


def test_worse_candidate_is_rejected_with_the_right_reasons():
    decision = PromotionGate().evaluate(_compare(RIGHT, WRONG_FORMAT))
    assert not decision.promote
    failed = {c.name for c in decision.checks if not c.passed}
    assert failed == {"team_reward_gain", "team_reward_ci_lower_above_zero", "component:format", "component:correct",
                      "agent:writer:reward", "agent:writer:format_compliance"}
    assert any("component 'format' delta -1" in r for r in decision.reasons)


def test_team_gain_hiding_an_agent_regression_is_rejected():
    # planner now calls a wrong tool every time; the team reward still improves
    res = _compare(FORMAT_ONLY, RIGHT, base_kw={"tool": {"name": "search"}}, tool={"name": "delete_db"})
    decision = PromotionGate().evaluate(res)
    assert res.team.low > 0
    assert not decision.promote
    assert [c.name for c in decision.checks if not c.passed] == ["agent:planner:tool_accuracy"]
    loose = PromotionGate(agent_overrides={"planner": {"tool_accuracy": 1.0}}).evaluate(res)
    assert loose.promote


def test_cost_ceiling_safety_and_min_pairs():
    res = _compare(FORMAT_ONLY, RIGHT, loops=3)
    decision = PromotionGate(max_cost_ratio=1.2, agent_tolerance={}).evaluate(res)
    assert [c.name for c in decision.checks if not c.passed] == ["cost_ratio"]
    gate = PromotionGate(safety=[{"name": "loops", "component": "handoff_loops", "max": 0},
                                 {"name": "fmt", "component": "format", "min": 1.0, "no_regression": True},
                                 {"name": "ghost", "component": "toxicity", "min": 1.0}],
                         max_cost_ratio=None, min_pairs=50, agent_tolerance={})
    failed = {c.name: c.detail for c in gate.evaluate(res).checks if not c.passed}
    assert set(failed) == {"safety:loops", "safety:ghost", "enough_pairs"}
    assert "was not measured" in failed["safety:ghost"]


def test_gate_yaml_roundtrip_and_errors(tmp_path):
    p = tmp_path / "gate.yaml"
    p.write_text("min_team_reward_gain: 0.1\ncomponent_tolerance: {'*': 0.0, format: 0.2}\n"
                 "safety:\n  - {name: fmt, component: format, min: 0.9}\n")
    gate = PromotionGate.from_yaml(p)
    assert gate.min_team_reward_gain == 0.1 and gate.safety[0].component == "format"
    assert gate.component_tolerance["format"] == 0.2
    (tmp_path / "bad.yaml").write_text("min_gain: 1\n")
    with pytest.raises(ValueError, match=r"bad.yaml: unknown gate keys \['min_gain'\]"):
        PromotionGate.from_yaml(tmp_path / "bad.yaml")
    with pytest.raises(ValueError, match="per-agent metrics"):
        PromotionGate(agent_tolerance={"vibes": 0.1})


def test_decision_is_written_with_reasons(tmp_path):
    decision = PromotionGate().evaluate(_compare(RIGHT, WRONG_FORMAT), context={"candidate": {"writer": "v2"}})
    path = decision.write(tmp_path)
    data = json.loads(path.read_text())
    assert data["decision"] == "reject" and data["reasons"] == decision.reasons
    assert data["context"]["candidate"] == {"writer": "v2"}
    again = GateDecision.read(tmp_path)
    assert again.promote is False and again.reasons == decision.reasons


class _WithStepCost(FormatAndAnswerReward):
    """Adds a cost component (negative weight): more agent steps = more cost."""

    def score(self, dataset, scenarios=None):
        res = super().score(dataset, scenarios)
        steps = dataset.episodes.set_index("episode_id")["n_actions"]
        res.episodes["steps_cost"] = [float(steps[e]) for e in res.episodes["episode_id"]]
        res.weights = {"format": 0.5, "correct": 0.5, "steps_cost": -0.1}
        return res


def test_cost_components_regress_when_they_rise():
    def run(base_loops, cand_loops):
        base = team_run("b", SIDS, RIGHT, loops=base_loops)
        cand = team_run("c", SIDS, RIGHT, loops=cand_loops)
        res = compare_datasets(base, cand, _WithStepCost(), scenarios=SCEN)
        gate = PromotionGate(require_ci_lower_above_zero=False, agent_tolerance={}, max_cost_ratio=None)
        return res, {c.name: c for c in gate.evaluate(res).checks}

    res, checks = run(0, 2)
    assert res.component_signs == {"format": 1, "correct": 1, "steps_cost": -1}
    assert not checks["component:steps_cost"].passed and "tolerated rise" in checks["component:steps_cost"].detail
    _, checks = run(2, 0)  # fewer steps: the cost fell, which is no regression
    assert checks["component:steps_cost"].passed


def test_too_few_pairs_says_which_episodes_the_reward_could_not_score():
    from marft_lg.rewards.composite import CompositeReward

    reward = CompositeReward.from_yaml({"weights": {"task_completion": 1.0}})  # needs a reference: none here
    base, cand = team_run("b", SIDS, RIGHT), team_run("c", SIDS, RIGHT)
    decision = PromotionGate().evaluate(compare_datasets(base, cand, reward, scenarios={s: {} for s in SIDS}))
    assert not decision.promote
    [why] = [r for r in decision.reasons if "paired scenarios" in r]
    assert "unscored episodes: baseline 10 of 10, candidate 10 of 10 (first: b-s0:" in why
    assert "reference" in why
