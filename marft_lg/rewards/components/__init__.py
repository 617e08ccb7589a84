"""Built-in reward components; importing this package registers them under their field names."""

from marft_lg.rewards.components.coordination import HandoffLoopRate
from marft_lg.rewards.components.efficiency import Cost, StepCount, StepEfficiency
from marft_lg.rewards.components.format import FormatCompliance
from marft_lg.rewards.components.group_judge import GroupJudge
from marft_lg.rewards.components.judge import LLMJudge
from marft_lg.rewards.components.outcome import Feedback, GoalProgress, TaskCompletion
from marft_lg.rewards.components.safety import ContentSafety, PromptInjection
from marft_lg.rewards.components.tools import ToolErrorRate, ToolSelectionAccuracy
from marft_lg.rewards.components.trajectory import TrajectoryScore

__all__ = [
    "ContentSafety",
    "Cost",
    "Feedback",
    "FormatCompliance",
    "GoalProgress",
    "GroupJudge",
    "HandoffLoopRate",
    "LLMJudge",
    "PromptInjection",
    "StepCount",
    "StepEfficiency",
    "TaskCompletion",
    "ToolErrorRate",
    "ToolSelectionAccuracy",
    "TrajectoryScore",
]
