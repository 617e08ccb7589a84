"""Tool-use components: how often tool calls failed (ToolErrorRate) and whether the right tools were used
(ToolSelectionAccuracy, against the scenario's `expected_tools`).

A call the request forced by name (``tool_choice`` naming the function, recorded in the action's `constraint`) was
not the model's choice: selection accuracy leaves it out. Under ``tool_choice: "required"`` the model still chose
which tool, so those calls count. Errors count whatever forced the call: they are what the model wrote."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from marft_lg.constraints import forced_tool, load_constraint
from marft_lg.rewards.base import ComponentScore, RewardComponent, action_list, action_number
from marft_lg.rewards.registry import register_component
from marft_lg.trajectories.dataset import Episode


def chosen_calls(action: dict[str, Any]) -> list[dict[str, Any]]:
    """The action's tool calls the model chose: none when the request forced one tool by name."""
    if forced_tool(load_constraint(action.get("constraint"))) is not None:
        return []
    return [tc for tc in action_list(action.get("tool_calls")) if isinstance(tc, dict)]


def _errors(action: dict[str, Any]) -> int:
    calls = action_list(action.get("tool_calls"))
    counted = action_number(action.get("tool_errors"), default=-1.0)
    return int(counted) if counted >= 0 else sum(1 for tc in calls if tc.get("error"))


@register_component("tool_error_rate")
@dataclass
class ToolErrorRate(RewardComponent):
    """Failed tool calls / tool calls in the episode (0.0 without tool calls); weight it negatively.

    Each action carries its own failures' share, so shaped credit lands on the call that failed.
    """

    name = "tool_error_rate"
    range = (0.0, 1.0)

    def __call__(self, episode: Episode) -> ComponentScore:
        calls = sum(len(action_list(a.get("tool_calls"))) for a in episode.actions)
        errors = {int(a["order"]): _errors(a) for a in episode.actions}
        total_errors = sum(errors.values())
        denominator = max(calls, total_errors)
        if denominator == 0:
            return ComponentScore(0.0)
        return ComponentScore(total_errors / denominator,
                              {o: e / denominator for o, e in errors.items() if e})


@register_component("tool_selection_accuracy")
@dataclass
class ToolSelectionAccuracy(RewardComponent):
    """How well the tools called match the scenario's `expected_tools`, in [0, 1].

    `metric`: ``"f1"`` (default; catches both skipped and hoarded tools), ``"recall"`` (expected
    tools that were called), ``"precision"`` (calls that were to an expected tool) or
    ``"jaccard"`` (of the name sets). A scenario expecting no tools scores 1.0 when none was called.
    """

    name = "tool_selection_accuracy"
    range = (0.0, 1.0)

    metric: str = "f1"

    def __post_init__(self) -> None:
        if self.metric not in ("f1", "recall", "precision", "jaccard"):
            raise ValueError(f"tool_selection_accuracy: metric must be f1, recall, precision or jaccard, got {self.metric!r}")

    def __call__(self, episode: Episode) -> float:
        if episode.scenario is None:
            raise ValueError(f"tool_selection_accuracy needs the episode's scenario (expected_tools); episode "
                             f"{episode.episode_id!r} has scenario {episode.info.get('scenario_id')!r} which "
                             "was not given: pass --scenarios / scenarios=")
        expected = set(episode.scenario.get("expected_tools") or [])
        called = [tc.get("name") for a in episode.actions for tc in chosen_calls(a)]
        if not expected:
            return 1.0 if not called else 0.0
        if not called:
            return 0.0
        used = set(called)
        recall = len(expected & used) / len(expected)
        precision = sum(1 for name in called if name in expected) / len(called)
        if self.metric == "recall":
            return recall
        if self.metric == "precision":
            return precision
        if self.metric == "jaccard":
            return len(expected & used) / len(expected | used)
        return 0.0 if recall + precision == 0 else 2 * recall * precision / (recall + precision)
