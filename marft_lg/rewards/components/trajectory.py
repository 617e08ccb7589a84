"""TrajectoryScore: the mean of per-step scores, from a rule or an LLM judge; each step carries its share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from marft_lg.rewards.base import ComponentScore, RewardComponent, action_list
from marft_lg.rewards.components.judge import LLMJudge
from marft_lg.rewards.components.tools import _errors
from marft_lg.rewards.registry import load_object, register_component
from marft_lg.trajectories.dataset import Episode


def basic_step_rule(action: dict[str, Any], episode: Episode) -> float:
    """0 for an empty completion or one repeating an earlier completion verbatim (a wasted step),
    else the fraction of the action's tool calls that succeeded (1.0 without tool calls)."""
    text = str(action.get("completion") or "").strip()
    if not text:
        return 0.0
    earlier = {str(a.get("completion") or "").strip() for a in episode.actions if a["order"] < action["order"]}
    if text in earlier:
        return 0.0
    calls = len(action_list(action.get("tool_calls")))
    errors = _errors(action)
    return 1.0 if calls == 0 and errors == 0 else max(0.0, 1.0 - errors / max(calls, errors))


STEP_RULES: dict[str, Callable[[dict[str, Any], Episode], float]] = {"basic": basic_step_rule}


@register_component("trajectory_score")
@dataclass
class TrajectoryScore(RewardComponent):
    """Mean per-step score in [0, 1]; step ``i`` carries ``score_i / n`` so shaped credit rewards good steps.

    `rule` is ``"basic"`` (see `basic_step_rule`), an import path or a callable
    ``fn(action, episode) -> float in [0, 1]``; `judge` (an `LLMJudge` or its options as a dict)
    asks a chat model instead. An episode without actions scores 0.
    """

    name = "trajectory_score"
    range = (0.0, 1.0)

    rule: str | Callable[..., float] = "basic"
    judge: LLMJudge | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.judge, dict):
            self.judge = LLMJudge(**self.judge)
        if callable(self.rule):
            self._rule = self.rule
        elif self.rule in STEP_RULES:
            self._rule = STEP_RULES[self.rule]
        elif ":" in self.rule:
            self._rule = load_object(self.rule)
        else:
            raise ValueError(f"trajectory_score: unknown rule {self.rule!r}; use one of {sorted(STEP_RULES)} "
                             "or an import path 'pkg.module:fn'")

    def __call__(self, episode: Episode) -> ComponentScore:
        if not episode.actions:
            return ComponentScore(0.0)
        if self.judge is not None:
            scores = self.judge.score_steps(episode)
        else:
            scores = [float(self._rule(a, episode)) for a in episode.actions]
        for a, s in zip(episode.actions, scores, strict=True):
            if not 0.0 <= s <= 1.0:
                raise ValueError(f"trajectory_score: step score {s} for action {a['order']} (span {a.get('span_id')}) "
                                 f"of episode {episode.episode_id!r} is outside [0, 1]")
        n = len(scores)
        return ComponentScore(sum(scores) / n, {int(a["order"]): s / n for a, s in zip(episode.actions, scores, strict=True)})

    def options(self) -> dict[str, Any]:
        out = super().options()
        if isinstance(self.judge, LLMJudge):
            out["judge"] = self.judge.options()
        return out
