"""The math team's composite reward: exact correctness of the actor's \\boxed{} answer + answer format."""

from __future__ import annotations

from marft_lg.rewards.composite import CompositeReward

REWARD_CONFIG = {
    "weights": {"task_completion": 1.0, "format_compliance": 0.5},
    "components": {
        "task_completion": {"match": "exact", "boxed": True, "last_number_fallback": False},
        "format_compliance": {"agents": {"actor": r"\\boxed\{\s*-?\d+\s*\}"}},
    },
    "credit": "terminal",
    "answer_agents": ["actor"],
}


def math_reward() -> CompositeReward:
    return CompositeReward.from_yaml(REWARD_CONFIG)
