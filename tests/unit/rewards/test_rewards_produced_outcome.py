"""Outcome checks read only what the app produced: a graph's final state echoes its input (the question), and a
checkpoint or an answer matched there was met by the question, not by the team."""

from __future__ import annotations

import json

import pytest
from rewards_factory import make_dataset, make_episode, scenario

from marft_lg.rewards import CompositeReward, GoalProgress, TaskCompletion
from marft_lg.rewards.components.outcome import outcome_text, produced_outcome

QUESTION = "Which city is the capital of France, Paris or Lyon?"
CAPITAL = scenario(inputs={"question": QUESTION}, reference="Paris", checkpoints=["Paris"])


def _episode(answer: str, outcome: dict | None = None):
    return make_episode([{"agent": "solver", "completion": "thinking"}], CAPITAL,
                        outcome=json.dumps(outcome or {"question": QUESTION, "answer": answer}))


def test_a_checkpoint_in_the_echoed_question_is_not_met_by_a_wrong_answer():
    assert GoalProgress()(_episode("Lyon")).value == 0.0
    assert GoalProgress()(_episode("It is Paris.")).value == 1.0


def test_a_checkpoint_in_a_completion_or_a_nested_produced_field_is_met():
    ep = make_episode([{"agent": "solver", "completion": "paris, surely"}], CAPITAL,
                      outcome=json.dumps({"question": QUESTION, "answer": "?"}))
    assert GoalProgress()(ep).per_action == {0: 1.0}
    nested = _episode("", {"question": QUESTION, "result": {"city": "Paris\n(France)"}})
    assert GoalProgress()(nested).value == 1.0


def test_echoed_messages_are_dropped_and_the_apps_own_replies_kept():
    ep = make_episode([{"agent": "solver", "completion": ""}],
                      scenario(inputs={"messages": [["user", QUESTION]]}, checkpoints=["Paris", "re:lyon"]),
                      outcome=json.dumps({"messages": [{"role": "user", "content": QUESTION},
                                                       {"role": "assistant", "content": "Lyon."}]}))
    assert produced_outcome(ep) == {"messages": [{"role": "assistant", "content": "Lyon."}]}
    assert GoalProgress()(ep).value == 0.5


def test_an_outcome_that_only_repeats_its_input_produced_nothing():
    ep = make_episode([{"agent": "solver", "completion": ""}], CAPITAL, outcome=json.dumps(QUESTION))
    assert produced_outcome(ep) is None and outcome_text(ep) == ""
    assert GoalProgress()(ep).value == 0.0


def test_task_completion_on_the_outcome_ignores_the_echoed_question():
    comp = TaskCompletion(source="outcome", match="contains")
    assert comp(_episode("Lyon")).value == 0.0
    assert comp(_episode("Paris")).value == 1.0
    assert TaskCompletion(source="outcome", outcome_key="question", match="contains")(_episode("Lyon")).value == 1.0


def test_scored_through_the_composite_with_a_scenario_set():
    ds = make_dataset([{"episode_id": "wrong", "scenario_id": "s1", "actions": [{"agent": "solver"}],
                        "outcome": json.dumps({"question": QUESTION, "answer": "Lyon"})},
                       {"episode_id": "right", "scenario_id": "s1", "actions": [{"agent": "solver"}],
                        "outcome": json.dumps({"question": QUESTION, "answer": "Paris"})}])
    result = CompositeReward({"goal_progress": 1.0}).score(ds, {"s1": CAPITAL})
    assert result.episodes.set_index("episode_id")["goal_progress"].to_dict() == pytest.approx(
        {"wrong": 0.0, "right": 1.0})
