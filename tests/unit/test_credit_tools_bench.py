"""benchmarks/credit_tools.py: where a tool-using team's gain came from (per checkpoint, per component, per agent)
and its table, on hand-made episodes; the script's model runs are the benchmark itself."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from marft_lg.evaluation.comparison import compare_datasets
from marft_lg.rewards import CompositeReward
from marft_lg.trajectories.scenarios import Scenario

_ROOT = Path(__file__).resolve().parents[2]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


ct = _load("credit_tools_bench", _ROOT / "benchmarks" / "credit_tools.py")
factory = _load("credit_tools_rewards_factory", _ROOT / "tests" / "unit" / "rewards" / "rewards_factory.py")
SCENARIOS = [Scenario(f"q{i}", {"messages": []}, reference="7", checkpoints=["agent:researcher", "tool:lookup"])
             for i in range(6)]


def _side(tag: str, handoff: list[bool], tool: list[bool], answer: list[bool]) -> object:
    episodes = []
    for i, (h, t, a) in enumerate(zip(handoff, tool, answer, strict=True)):
        actions = [{"agent": "supervisor", "completion": "routing"}]
        if h:
            actions.append({"agent": "researcher", "completion": "7" if a else "no idea",
                            "tool_calls": [factory.tool("lookup" if t else "search")]})
        else:
            actions.append({"agent": "mathematician", "completion": "7" if a else "no idea"})
        episodes.append({"episode_id": f"{tag}-{i}", "scenario_id": f"q{i}", "actions": actions,
                         "outcome": "7" if a else "no idea"})
    return factory.make_dataset(episodes)


def test_checkpoint_gains_score_each_checkpoint_alone():
    # the candidate hands off right on every question (baseline: 2 of 6) but picks the right tool no more often
    base = _side("b", [True, True, False, False, False, False], [True, False, False, False, False, False], [False] * 6)
    cand = _side("c", [True] * 6, [True, False, False, False, False, False], [False] * 6)
    gains = ct.checkpoint_gains(base, cand, SCENARIOS, seed=0)
    assert set(gains) == set(ct.CHECKPOINTS)
    assert gains["handoff"]["mean"] == pytest.approx(4 / 6)
    assert gains["handoff"]["low"] > 0
    assert gains["tool"]["mean"] == pytest.approx(0.0)
    assert (gains["handoff"]["baseline"], gains["handoff"]["candidate"]) == pytest.approx((2 / 6, 1.0))
    assert gains["tool"]["baseline"] == gains["tool"]["candidate"] == pytest.approx(1 / 6)
    # summed, as the reward's goal_progress sees them, the two would be one number: half of the hand-off's gain
    both = compare_datasets(base, cand, CompositeReward.from_yaml({"weights": {"goal_progress": 1.0}}),
                            scenarios={s.scenario_id: s.to_dict() for s in SCENARIOS}, seed=0)
    assert both.team.mean == pytest.approx(gains["handoff"]["mean"] / 2 + gains["tool"]["mean"] / 2)


def test_where_from_and_the_table_name_components_checkpoints_and_agents():
    base = _side("b", [False] * 6, [False] * 6, [False] * 6)
    cand = _side("c", [True] * 6, [True] * 6, [True, True, True, False, False, False])
    reward = CompositeReward.from_yaml({**ct.REWARD, "components": {"task_completion": {"match": "contains"}}})
    result = compare_datasets(base, cand, reward, scenarios={s.scenario_id: s.to_dict() for s in SCENARIOS}, seed=0)
    result.datasets = {"baseline": base, "candidate": cand}
    where = ct.where_from(result, SCENARIOS, seed=0)
    assert where["components"]["task_completion"]["mean"] == pytest.approx(0.5)
    assert where["checkpoints"]["tool"]["mean"] == pytest.approx(1.0)
    assert {"supervisor", "researcher", "mathematician"} <= set(where["agents"])
    assert where["agents"]["researcher"]["reward"]["mean"] > 0
    run = {"estimator": "group", "warm_start": 8, "overrides": {"advantage_std_floor": 0.1}, "seed": 2, "minutes": 11.5, "iterations": 4, "gain": 0.25,
           "ci_low": 0.1, "ci_high": 0.4, **where}
    lines = ct.table({"runs": [run]}).splitlines()
    assert len(lines) == 3 and "researcher reward" in lines[0]
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[:5] == ["group", "8, advantage_std_floor=0.1", "2", "11.5 (4)", "+0.250 [+0.100, +0.400]"]
    assert cells[5].startswith("+0.500 [") and cells[5].endswith("(0.00 -> 0.50)") and cells[7].startswith("+1.000") and cells[7].endswith("(0.00 -> 1.00)")
    assert len(cells) == len([c for c in lines[0].strip("|").split("|")])


def test_set_reads_yaml_values_and_refuses_unknown_keys():
    assert ct.parse_set("advantage_std_floor=0.1") == ("advantage_std_floor", 0.1)
    assert ct.parse_set("dynamic_sampling=true") == ("dynamic_sampling", True)
    with pytest.raises(SystemExit, match="learning_rat"):
        ct.parse_set("learning_rat=1e-4")
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        ct.parse_set("learning_rate")


def test_a_run_key_tells_settings_apart_and_ignores_their_order():
    a = ct.run_key("group", 0, {"advantage_std_floor": 0.1, "learning_rate": 1e-4}, 0)
    assert a == ct.run_key("group", 0, {"learning_rate": 1e-4, "advantage_std_floor": 0.1}, 0)
    assert ct.run_key("group", 0, None, 0) == ct.run_key("group", 0, {}, 0)
    assert len({a, ct.run_key("group", 0, None, 0), ct.run_key("group", 4, None, 0), ct.run_key("group", 0, None, 1)}) == 4


def test_the_online_budget_after_a_warm_start_is_what_is_left_and_never_negative():
    assert ct.online_budget_s(12, 0.0) == 720.0
    assert ct.online_budget_s(12, 2.5) == pytest.approx(570.0)
    assert ct.online_budget_s(12, 13.0) == 0.0  # the warm start outlasted the budget: no on-policy iteration


def test_the_reward_puts_each_checkpoint_on_the_action_that_met_it():
    # reward_to_go needs it: the worker's return must not hold the supervisor's hand-off
    scenario = factory.scenario(scenario_id="q", reference="12",
                                checkpoints=["tool:transfer_to_mathematician", "tool:add"])
    actions = [{"agent": "supervisor", "completion": "", "tool_calls": [factory.tool("transfer_to_mathematician")]},
               {"agent": "mathematician", "completion": "", "tool_calls": [factory.tool("add", "12")]},
               {"agent": "mathematician", "completion": "It is 12."},
               {"agent": "supervisor", "completion": "", "tool_calls": [factory.tool("finish")]}]
    episode = factory.make_episode(actions, scenario, outcome="It is 12.")
    scored = CompositeReward.from_yaml(ct.REWARD).score_episode(episode)
    weights = ct.REWARD["weights"]
    rewards = scored.action_rewards
    assert rewards.sum() == pytest.approx(scored.reward)
    step = weights["step_count"] * scored.components["step_count"] / len(actions)  # each step carries its own cost
    # the hand-off's half of goal_progress on the supervisor's first action, the tool's half on the worker's call,
    # the answer on the worker's answering action
    assert rewards == pytest.approx([weights["goal_progress"] / 2 + step, weights["goal_progress"] / 2 + step,
                                     weights["task_completion"] + step, step])
    assert step < 0


def test_append_replace_moves_the_planned_runs_to_superseded_and_keeps_the_rest():
    run = {"estimator": "reward_to_go", "warm_start": 0, "overrides": {}, "seed": 0}
    other = {**run, "overrides": {"advantage_group_std": False}}
    before = {"commit": "aaaaaaa1", "runs": [run, {**other, "commit": "bbbbbbb2"}],
              "superseded": [{**run, "seed": 9, "superseded_reason": "older"}]}
    planned = {ct.run_key("reward_to_go", 0, {}, 0), ct.run_key("reward_to_go", 0, {}, 1)}
    kept, gone = ct.carry_over(before, planned, replace=False, commit="ccccccc3")
    assert [r["commit"] for r in kept] == ["aaaaaaa1", "bbbbbbb2"] and gone == before["superseded"]
    kept, gone = ct.carry_over(before, planned, replace=True, commit="ccccccc3")
    assert kept == [{**other, "commit": "bbbbbbb2"}]
    assert gone[0]["seed"] == 9 and gone[1] == {**run, "commit": "aaaaaaa1",
                                                 "superseded_reason": "run again at ccccccc (--replace)"}
