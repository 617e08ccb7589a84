"""marft_lg.rewards: pluggable reward components, their weighted composite, and per-action credit placement."""

from marft_lg.rewards.base import ComponentScore, FunctionComponent, RewardComponent, ScoreError
from marft_lg.rewards.components import (
    ContentSafety,
    Cost,
    Feedback,
    FormatCompliance,
    GoalProgress,
    GroupJudge,
    HandoffLoopRate,
    LLMJudge,
    PromptInjection,
    StepCount,
    StepEfficiency,
    TaskCompletion,
    ToolErrorRate,
    ToolSelectionAccuracy,
    TrajectoryScore,
)
from marft_lg.rewards.composite import CompositeReward, EpisodeReward, RewardResult
from marft_lg.rewards.registry import known_components, register_component

__all__ = [
    "ComponentScore",
    "CompositeReward",
    "ContentSafety",
    "Cost",
    "EpisodeReward",
    "Feedback",
    "FormatCompliance",
    "FunctionComponent",
    "GoalProgress",
    "GroupJudge",
    "HandoffLoopRate",
    "LLMJudge",
    "PromptInjection",
    "RewardComponent",
    "RewardResult",
    "ScoreError",
    "StepCount",
    "StepEfficiency",
    "TaskCompletion",
    "ToolErrorRate",
    "ToolSelectionAccuracy",
    "TrajectoryScore",
    "known_components",
    "register_component",
]
