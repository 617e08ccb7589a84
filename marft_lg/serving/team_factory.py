"""`team(...)`: the team a model spec asks for, one base (`Team`) or several (`MixedTeam`), built the same way;
and `TeamSpec`, the team half of every config (`marft-lg serve`'s flags here, `graph.app_spec.AppSpec` for the
configs that also build an app).

``team("embedded:smollm2-135m-instruct", ["planner", "writer"])`` is a `Team`; ``team({"planner": A, "writer":
B})`` is a `Team` when both specs resolve to one model directory and a `MixedTeam` (one `Team` per base) when they
do not. Both answer the `ServedTeam` protocol, so callers need not tell them apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from marft_lg.loading import is_import_path, load_object
from marft_lg.serving.engine.models import DEFAULT_MODEL
from marft_lg.serving.mixed_team import MixedTeam
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


@dataclass
class TeamSpec:
    """What builds a team: its base model(s), roles, registry and starting versions, engine, LoRA settings, seed."""

    model: str | dict[str, str] = DEFAULT_MODEL
    """One base model spec for every role, or ``{role: model spec}`` (a team on several bases)."""
    agents: list[str] = field(default_factory=list)
    registry: Any = None
    versions: Any = None
    """The versions the team starts on: an alias (``live``), ``{role: ref}``, or None (fresh adapters)."""
    engine: str = "hf"
    """``hf``, ``vllm``, or ``module:attr`` of a factory ``f(spec) -> ChatEngine`` (a stand-in engine)."""
    engine_options: dict[str, Any] = field(default_factory=dict)
    lora: Any = None
    """`LoraSettings` of the fresh adapters (None: the defaults)."""
    shared_adapter: bool = False
    seed: int = 0
    base_dir: str | None = None
    """The folder of the config that names this (relative files and modules load from it)."""
    source: str | None = None
    """Where the config names it (``train.yaml:12``), for error messages."""

    def build_team(self, *, registry: Any = None, versions: Any = ...) -> Any:
        """The team serving `agents` on `model` (a `MixedTeam` for several bases), from `registry` at `versions`
        (both default to the spec's); an `engine` given as ``module:attr`` is that factory's engine."""
        if is_import_path(self.engine) and self.engine not in ("hf", "vllm"):
            return load_object(self.engine, base_dir=self.base_dir, what="engine", source=self.source)(self)
        return team(self.model, list(self.agents), engine=self.engine,
                    registry=self.registry if registry is None else registry,
                    versions=self.versions if versions is ... else versions, seed=self.seed,
                    engine_options=dict(self.engine_options) or None, lora=self.lora,
                    shared_adapter=self.shared_adapter)
