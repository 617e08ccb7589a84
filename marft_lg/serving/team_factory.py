"""`team(...)`: the team a model spec asks for, one base (`Team`) or several (`MixedTeam`), built the same way.

``team("embedded:smollm2-135m-instruct", ["planner", "writer"])`` is a `Team`; ``team({"planner": A, "writer":
B})`` is a `Team` when both specs resolve to one model directory and a `MixedTeam` (one `Team` per base) when they
do not. Both answer the `ServedTeam` protocol, so callers need not tell them apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from marft_lg.serving.mixed_team import MixedTeam
from marft_lg.serving.models import DEFAULT_MODEL
from marft_lg.serving.team import ModelSpec, Team, plan_bases


def team(model: ModelSpec | Mapping[str, ModelSpec] = DEFAULT_MODEL, agents: list[str] | tuple[str, ...] = (),
         **kwargs: Any) -> Team | MixedTeam:
    """A `Team` on one base model, or a `MixedTeam` when a ``{role: model spec}`` mapping spans several; `kwargs`
    as `Team` takes them (engine, registry, versions, lora, seed, engine_options, ...)."""
    if isinstance(model, Mapping):
        _, groups = plan_bases(model, agents)
        if len(groups) > 1:
            return MixedTeam(model, agents, **kwargs)
    return Team(model, agents, **kwargs)
