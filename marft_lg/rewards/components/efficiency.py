"""Efficiency components: how many steps (StepCount, StepEfficiency) and what they cost (Cost).

Give these negative weights (step_count, cost) or positive ones (step_efficiency): without a cost
term MARFT can learn that more steps sometimes win and ship a much more expensive team.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from marft_lg.rewards.base import ComponentScore, RewardComponent, action_list, action_number
from marft_lg.rewards.registry import register_component
from marft_lg.trajectories.dataset import Episode


def _counted_orders(episode: Episode, count: str) -> list[int]:
    """Orders of the actions that count as steps: every action, or the first action of each LangGraph step."""
    if count == "actions":
        return [int(a["order"]) for a in episode.actions]
    seen: set[Any] = set()
    out = []
    for a in episode.actions:
        step = a.get("step")
        key = ("order", a["order"]) if step is None or (isinstance(step, float) and math.isnan(step)) else step
        if key not in seen:
            seen.add(key)
            out.append(int(a["order"]))
    return out


def _check_count(count: str) -> None:
    if count not in ("actions", "steps"):
        raise ValueError(f"count must be 'actions' (one per LLM call) or 'steps' (LangGraph super-steps), got {count!r}")


def _scenario_meta(episode: Episode, key: str, default: float) -> float:
    meta = (episode.scenario or {}).get("meta") or {}
    return float(meta.get(key, default))


@register_component("step_count")
@dataclass
class StepCount(RewardComponent):
    """Normalised step count ``min(n, max_steps) / max_steps`` in [0, 1]; weight it negatively.

    `count="actions"` counts LLM calls, `"steps"` LangGraph super-steps. A scenario's
    ``meta["max_steps"]`` overrides `max_steps`. Each counted step carries ``1 / max_steps``.
    """

    name = "step_count"
    range = (0.0, 1.0)

    max_steps: int = 10
    count: str = "actions"

    def __post_init__(self) -> None:
        _check_count(self.count)
        if self.max_steps <= 0:
            raise ValueError(f"step_count: max_steps must be positive, got {self.max_steps}")

    def __call__(self, episode: Episode) -> ComponentScore:
        max_steps = _scenario_meta(episode, "max_steps", self.max_steps)
        orders = _counted_orders(episode, self.count)[: int(max_steps)]
        return ComponentScore(len(orders) / max_steps, {o: 1.0 / max_steps for o in orders})


@register_component("step_efficiency")
@dataclass
class StepEfficiency(RewardComponent):
    """``min(1, optimal_steps / n)``: 1.0 for a run as short as the best known one, falling as it grows.

    A scenario's ``meta["optimal_steps"]`` overrides `optimal_steps`; an episode without steps scores 0.
    """

    name = "step_efficiency"
    range = (0.0, 1.0)

    optimal_steps: int = 1
    count: str = "actions"

    def __post_init__(self) -> None:
        _check_count(self.count)
        if self.optimal_steps <= 0:
            raise ValueError(f"step_efficiency: optimal_steps must be positive, got {self.optimal_steps}")

    def __call__(self, episode: Episode) -> float:
        n = len(_counted_orders(episode, self.count))
        return 0.0 if n == 0 else min(1.0, _scenario_meta(episode, "optimal_steps", self.optimal_steps) / n)


@register_component("cost")
@dataclass
class Cost(RewardComponent):
    """Price of the episode in budget units: ``sum(in_tok*input_token_cost + out_tok*output_token_cost
    + latency_s*latency_cost) / budget``; weight it negatively. Each action carries its own share.

    Defaults count thousands of tokens. Token counts fall back to the token-id lists when missing.
    """

    name = "cost"
    range = (0.0, math.inf)

    input_token_cost: float = 1.0
    output_token_cost: float = 1.0
    latency_cost: float = 0.0
    budget: float = 1000.0

    def __post_init__(self) -> None:
        if self.budget <= 0:
            raise ValueError(f"cost: budget must be positive, got {self.budget}")
        if min(self.input_token_cost, self.output_token_cost, self.latency_cost) < 0:
            raise ValueError("cost: prices must be >= 0 (give the component a negative weight instead)")

    def __call__(self, episode: Episode) -> ComponentScore:
        per_action = {}
        for a in episode.actions:
            tin = _tokens(a, "input_tokens", "prompt_token_ids")
            tout = _tokens(a, "output_tokens", "completion_token_ids")
            latency = action_number(a.get("latency_s"))
            per_action[int(a["order"])] = (tin * self.input_token_cost + tout * self.output_token_cost
                                           + latency * self.latency_cost) / self.budget
        return ComponentScore(sum(per_action.values()), per_action)


def _tokens(action: dict[str, Any], count_col: str, ids_col: str) -> float:
    value = action_number(action.get(count_col), default=math.nan)
    return float(len(action_list(action.get(ids_col)))) if math.isnan(value) else value
