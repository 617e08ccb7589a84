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


@pytest.mark.integration
def test_group_judge_on_the_served_base_model_scores_a_fixed_group(embedded_model_dir, tmp_path):
    """The relative judge with no engine named, bound to the team as the trainer binds it: the base model without
    adapters judges a group of two attempts at one input in one call; the grammar makes the reply parse, every
    attempt gets a score in [0, 1], and a second judge over the same cache makes no call."""
    import torch

    from marft_lg.rewards.components.group_judge import GroupJudge
    from marft_lg.rewards.composite import CompositeReward
    from marft_lg.serving.team import Team

    torch.set_num_threads(1)
    question = scenario(inputs="What is 6*7?")
    group = [make_episode([{"agent": "solver", "completion": r"6 times 7 is 42, so the answer is \boxed{42}."}],
                          question, episode_id="right"),
             make_episode([{"agent": "solver", "completion": "banana banana"}], question, episode_id="nonsense")]
    team = Team(embedded_model_dir, agents=["solver"])
    try:
        judge = GroupJudge(retries=0, max_tokens=256, cache_dir=str(tmp_path / "cache"))
        reward = CompositeReward({"group_judge": 1.0}, {"group_judge": judge})
        reward.bind_default_engine(team)
        scores = judge.score_group(group)
        again = GroupJudge(retries=0, max_tokens=256, cache_dir=str(tmp_path / "cache"))
        again.bind_default_engine(team)
        assert again.score_group(group) == scores and again.calls == 0
    finally:
        team.close()
    assert set(scores) == {"right", "nonsense"} and judge.calls == 1
    assert all(0.0 <= s.value <= 1.0 for s in scores.values())
