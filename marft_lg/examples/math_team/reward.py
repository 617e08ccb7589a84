"""The math team's composite reward: exact correctness of the actor's answer + the \\boxed{} answer format + the
problem's set-up written (each placed on the action that earned it).

The answer is the actor's \\boxed{} content, else the last number it wrote. The untuned 135M actor
almost never uses \\boxed{} (its greedy held-out format rate is 0), so a boxed-only check gives a reward
of 0 everywhere and nothing to learn from; the last-number fallback gives correct answers credit while
the format term still pays for learning \\boxed{}.
"""

from __future__ import annotations

from marft_lg.rewards.composite import CompositeReward

REWARD_CONFIG = {
    "weights": {"task_completion": 1.0, "format_compliance": 0.5, "goal_progress": 0.5},
    "components": {
        "task_completion": {"match": "exact", "boxed": True, "last_number_fallback": True},
        "format_compliance": {"agents": {"actor": r"\\boxed\{\s*-?\d+\s*\}"}},
        "goal_progress": {},
    },
    # each component's share on the action that earned it (the set-up on the agent that first wrote it, the answer
    # and its format on the actor): the episode's return is the same as on the last action, so the group baseline's
    # advantages are too; per-agent figures and `credit: reward_to_go` need to know who earned what
    "credit": "shaped",
    "answer_agents": ["actor"],
}


def math_reward() -> CompositeReward:
    return CompositeReward.from_yaml(REWARD_CONFIG)
