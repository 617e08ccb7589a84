"""The LLM judge on the real embedded 135M model (base weights, adapters disabled)."""

from __future__ import annotations

import pytest
from rewards_factory import make_episode, scenario

from marft_lg.rewards import LLMJudge, TrajectoryScore


@pytest.mark.integration
def test_base_model_judge_scores_a_right_step_above_nonsense(embedded_model_dir):
    import torch

    from marft_lg.serving.team import Team

    torch.set_num_threads(1)
    team = Team(embedded_model_dir, agents=["solver"])
    try:
        ep = make_episode([
            {"agent": "solver", "completion": r"6 times 7 is 42, so the answer is \boxed{42}."},
            {"agent": "solver", "completion": "banana banana"},
        ], scenario(inputs="What is 6*7?"))
        score = TrajectoryScore(judge=LLMJudge(engine=team))(ep)  # on_unparsable="error": replies must be numbers
    finally:
        team.close()
    assert score.per_action[0] > score.per_action[1]
    assert 0.0 <= score.value <= 1.0
