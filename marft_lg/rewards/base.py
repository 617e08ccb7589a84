"""What a reward component is: a named scorer of one episode with a declared range.

A component is a `RewardComponent` (usually a small dataclass whose fields are its options) or a
plain callable wrapped by `FunctionComponent`. It returns a float or a `ComponentScore` whose
`per_action` says which action (by `order`) earned or lost what; built-ins keep the per-action
values summing to the episode value so shaped credit moves reward around without changing it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

from marft_lg.trajectories.dataset import Episode, TrajectoryDataset

Number = float | int


@runtime_checkable
class Scorer(Protocol):
    """A reward over a dataset (`CompositeReward`): ``score(dataset, scenarios)`` -> an object with ``.episodes`` (a
    row per episode: reward, components) and ``.action_rewards``. What the trainer and the comparison take."""

    def score(self, dataset: TrajectoryDataset, scenarios: Any = None) -> Any: ...


@dataclass
class ComponentScore:
    """A component's score for one episode, with optional attributions to actions (keys: action `order`)."""

    value: float
    per_action: dict[int, float] = field(default_factory=dict)


class ScoreError(ValueError):
    """A component returned something that is not a usable score (NaN, inf, out of range, bad attribution)."""


class RewardComponent:
    """Base class of reward components.

    Subclasses set `name` (the registry name and default column) and `range` (the declared
    closed interval of values; assign it without a type annotation so a dataclass does not make it
    an option) and implement `__call__(episode)`. Dataclass fields are the component's options:
    they are what YAML sets and what `options()` writes back.
    """

    name: ClassVar[str] = ""
    range: tuple[float, float] = (-math.inf, math.inf)
    veto_reward: float = 0.0

    def __call__(self, episode: Episode) -> float | ComponentScore:
        raise NotImplementedError

    def prepare(self, groups: Sequence[Sequence[Episode]]) -> None:
        """Group hook, optional: `CompositeReward.score` calls it once, before scoring episode by episode, with the
        finished episodes grouped by the input they ran (their `scenario_id`: the K episodes the trainer compares;
        an episode without a scenario is a group of its own). A component that scores an episode relative to the
        others of its group (`group_judge`) computes its scores here and `__call__` returns them; one that fails
        for a group keeps the error and raises it from `__call__`, so those episodes come back unscored. It must
        not raise itself. The default does nothing."""
        return None

    @property
    def is_veto(self) -> bool:
        """True when a non-zero value must replace the episode's reward with `veto_reward`."""
        return False

    def options(self) -> dict[str, Any]:
        """The options that rebuild this component (dataclass fields), for YAML round trips."""
        if not dataclasses.is_dataclass(self):
            return {}
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self) if f.init}


class FunctionComponent(RewardComponent):
    """Adapts a plain callable `fn(episode) -> float | ComponentScore` to a component."""

    def __init__(self, fn: Callable[[Episode], Any], name: str | None = None,
                 range: Sequence[float] = (-math.inf, math.inf)):
        if not callable(fn):
            raise TypeError(f"reward component {name or fn!r} is not callable")
        self.fn = fn
        self.component_name = name or getattr(fn, "__name__", type(fn).__name__)
        self.range = (float(range[0]), float(range[1]))
        self.options_given: dict[str, Any] = {}

    def __call__(self, episode: Episode) -> float | ComponentScore:
        return self.fn(episode)

    def __repr__(self) -> str:
        return f"FunctionComponent({self.component_name!r})"


def as_component(obj: Any, name: str) -> RewardComponent:
    """A `RewardComponent` as is; a class is instantiated with no options; a callable is wrapped."""
    if isinstance(obj, RewardComponent):
        return obj
    if isinstance(obj, type):
        inst = obj()
        return inst if isinstance(inst, RewardComponent) else FunctionComponent(inst, name, getattr(inst, "range", _ANY))
    if callable(obj):
        return FunctionComponent(obj, name, getattr(obj, "range", _ANY))
    raise TypeError(f"reward component {name!r}: expected a RewardComponent, a class or a callable, got {type(obj).__name__}")


_ANY = (-math.inf, math.inf)


def check_score(name: str, raw: Any, episode: Episode, bounds: Sequence[float]) -> ComponentScore:
    """Validate a component's return value; raise `ScoreError` naming the component and the episode."""
    where = f"component {name!r} on episode {episode.episode_id!r}"
    score = raw if isinstance(raw, ComponentScore) else ComponentScore(_to_float(raw, where))
    value = _to_float(score.value, where)
    lo, hi = float(bounds[0]), float(bounds[1])
    if not lo - 1e-9 <= value <= hi + 1e-9:
        raise ScoreError(f"{where} returned {value}, outside its declared range [{lo}, {hi}]")
    orders = {int(a["order"]) for a in episode.actions}
    per_action: dict[int, float] = {}
    for key, v in (score.per_action or {}).items():
        order = int(key)
        if order not in orders:
            raise ScoreError(f"{where} attributed {v} to action order {order}, which the episode does not have "
                             f"(orders {sorted(orders)})")
        per_action[order] = per_action.get(order, 0.0) + _to_float(v, f"{where} (action {order})")
    return ComponentScore(value, per_action)


def _to_float(value: Any, where: str) -> float:
    if isinstance(value, bool):
        return float(value)
    try:
        out = float(value)
    except (TypeError, ValueError) as exc:
        raise ScoreError(f"{where} returned {value!r}, not a number") from exc
    if not math.isfinite(out):
        raise ScoreError(f"{where} returned {out}; scores must be finite numbers")
    return out


def answer_order(episode: Episode, answer_agents: Sequence[str] | None) -> int | None:
    """`order` of the action holding the answer: the last one by an answer agent, else the last action.

    Mirrors the paper's `with_answer` profile flag; None for an episode without actions.
    """
    if not episode.actions:
        return None
    if answer_agents:
        wanted = set(answer_agents)
        for action in reversed(episode.actions):
            if action.get("agent") in wanted:
                return int(action["order"])
    return int(episode.actions[-1]["order"])


def action_list(value: Any) -> list[Any]:
    """A list column cell (list, tuple, numpy array, None or NaN) as a list."""
    if value is None:
        return []
    if isinstance(value, float) and math.isnan(value):
        return []
    if hasattr(value, "tolist") and not isinstance(value, str):
        value = value.tolist()
    return list(value) if isinstance(value, list | tuple) else [value]


def action_number(value: Any, default: float = 0.0) -> float:
    """A numeric column cell (int, float, numpy scalar, None or NaN) as a float."""
    if value is None:
        return default
    try:
        out = float(value)
    except (TypeError, ValueError):
        return default
    return default if math.isnan(out) else out


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value
