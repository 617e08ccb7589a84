"""The math team's reward sits on the actions that earned it (the set-up on the reasoner that wrote it, the answer and
its format on the actor) and sums to the same episode return as the whole reward on the last action would."""

from __future__ import annotations

import numpy as np
import pytest
from math_team_factory import math_dataset

from marft_lg.examples.math_team.reward import REWARD_CONFIG, math_reward
from marft_lg.rewards.composite import CompositeReward
from marft_lg.trajectories.scenarios import Scenario

SCENARIO = Scenario("p", {"question": "Omar has 2 cards, gets 5 more, then loses 4. How many?"}, reference="3",
                    checkpoints=[r"re:(?<!\d)2\s*\+\s*5(?!\d)", r"re:(?<!\d)7\s*-\s*4(?!\d)"])


def test_the_set_up_is_the_reasoners_and_the_answer_the_actors_with_the_terminal_return():
    ds = math_dataset({
        "right": ("p", [("reasoner", "2 + 5 = 7, then 7 - 4"), ("actor", "\\boxed{3}")]),
        "half": ("p", [("reasoner", "2 + 5 first"), ("actor", "it is 9")]),
        "actor-sets-up": ("p", [("reasoner", "count the cards"), ("actor", "7 - 4 so \\boxed{3}")]),
    })
    scenarios = {"p": SCENARIO.to_dict()}
    shaped = math_reward().score(ds, scenarios)
    terminal = CompositeReward.from_yaml({**REWARD_CONFIG, "credit": "terminal"}).score(ds, scenarios)
    placed = {e: np.asarray(r).tolist() for e, r in shaped.action_rewards.items()}
    assert placed["right"] == pytest.approx([0.5, 1.5])  # the whole set-up, then the boxed right answer
    assert placed["half"] == pytest.approx([0.25, 0.0])  # half the set-up; an unboxed wrong answer earns nothing
    assert placed["actor-sets-up"] == pytest.approx([0.0, 1.75])  # the actor wrote the second step itself
    for e, r in terminal.action_rewards.items():
        assert sum(placed[e]) == pytest.approx(float(np.sum(r)))
        assert np.asarray(r).tolist()[:-1] == [0.0] * (len(r) - 1)
