"""The math team's strict (\\boxed{}) and lenient (last number) accuracy on hand-made actor answers."""

from __future__ import annotations

import pytest
from math_team_factory import math_dataset

from marft_lg.examples.math_team.accuracy import answer_accuracy, answer_checks
from marft_lg.trajectories.scenarios import Scenario


@pytest.mark.parametrize(("text", "reference", "strict", "lenient"), [
    ("3 + 4 = 7. The answer is \\boxed{7}.", "7", True, True),
    ("The answer is \\boxed{8}, or maybe 7", "7", False, True),  # boxed wrong, last number right
    ("\\boxed{7} is wrong, it is 8", "7", True, False),  # the last number need not be the boxed one
    ("I cannot tell.", "7", False, False),  # no number at all
    ("", "7", False, False),
    ("2 - 5 = \\boxed{-3}", "-3", True, True),  # negative numbers
    ("The answer is -3", "3", False, False),
    ("5 - 3 leaves 2", "-2", False, False),
    ("The answer is \\boxed{ 7 }", "7", True, True),  # spaces inside the box
    ("\\boxed{7.0}", "7", True, True),  # equal as numbers
    ("\\boxed{seven}", "7", False, False),
    ("3 + 4 = 7", "7", False, True),  # right, not in the taught format
])
def test_answer_checks(text, reference, strict, lenient):
    assert answer_checks(text, reference) == (strict, lenient)


def test_answer_accuracy_reads_the_actors_last_answer_and_counts_failed_runs_as_wrong():
    scenarios = [Scenario("p1", {"question": "?"}, reference="7"), Scenario("p2", {"question": "?"}, reference="12"),
                 Scenario("p3", {"question": "?"}, reference="-4"), Scenario("p4", {"question": "?"}, reference="5")]
    ds = math_dataset({
        "e1": ("p1", [("reasoner", "add: 3 + 4"), ("actor", "\\boxed{7}")]),  # strict and lenient
        "e2": ("p2", [("reasoner", "the answer is \\boxed{12}"), ("actor", "it is 12")]),  # the reasoner's box is not the actor's
        "e3": ("p3", [("actor", "\\boxed{4}"), ("actor", "so \\boxed{-4}")]),  # the actor's last action counts
        "e4": ("p4", []),  # failed before acting: wrong on both
        "e5": ("unknown", [("actor", "\\boxed{1}")]),  # no reference: not counted
    })
    acc = answer_accuracy(ds, scenarios)
    assert acc == {"strict": 2 / 4, "lenient": 3 / 4, "n": 4}
    # a {id: scenario dict} map works too (what comparisons pass around)
    assert answer_accuracy(ds, {s.scenario_id: s.to_dict() for s in scenarios}) == acc
    assert answer_accuracy(ds, []) == {"strict": None, "lenient": None, "n": 0}


def test_learn_evaluate_returns_the_accuracy_of_the_episodes_it_ran(monkeypatch):
    from marft_lg.examples.math_team import learn
    from marft_lg.examples.math_team.reward import math_reward

    scenarios = [Scenario("p1", {"question": "?"}, reference="7"), Scenario("p2", {"question": "?"}, reference="6")]
    ds = math_dataset({"e1": ("p1", [("reasoner", "3 + 4"), ("actor", "3 + 4 = \\boxed{7}")]),
                   "e2": ("p2", [("reasoner", "9 - 3"), ("actor", "9 - 3 = 6")])})

    class FakeCollector:
        def __init__(self, app, **kw):
            pass

        def collect(self, scenarios, k, iteration, seed):
            return ds

    monkeypatch.setattr("marft_lg.training.rollout.GraphCollector", FakeCollector)
    scores, comps, acc = learn.evaluate(None, scenarios, math_reward(), tag="t", seed=0)
    assert acc == {"strict": 0.5, "lenient": 1.0, "n": 2}
    assert scores[0] > scores[1] > 0  # both right, only the first in the \boxed{} format
    assert comps["format_compliance"] == 0.5
