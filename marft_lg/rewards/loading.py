"""Reward configuration: build components from names, import paths and option dicts, and write them back.

The YAML shape::

    credit: terminal            # or shaped
    answer_agents: [actor]      # whose last action holds the answer (the paper's with_answer)
    errored: unscored           # episodes whose run failed: unscored (default), score, or zero
    weights:                    # one entry per component; 0 records a column without using it
      task_completion: 1.0
      step_count: -0.1
      my_score: 0.2
    components:                 # optional per-component options; `type` picks the class
      task_completion: {match: symbolic}
      my_score: {type: "my_pkg.rewards:MyScore", range: [0, 1]}
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from marft_lg._config import YamlDoc, convert
from marft_lg.loading import is_import_path
from marft_lg.rewards.base import FunctionComponent, RewardComponent, as_component
from marft_lg.rewards.registry import (
    get_component_class,
    import_path_of,
    known_components,
    load_object,
)

TOP_LEVEL_KEYS = ("weights", "components", "credit", "answer_agents", "errored")
# What scoring does with an episode whose run failed (status "error"): leave it unscored (out of training), score
# it as if it had finished, or give it reward 0 (a failure the team learns from; a safety veto still applies).
ERRORED_MODES = ("unscored", "score", "zero")


def build_component(name: str, spec: Any) -> tuple[RewardComponent, str | None]:
    """A component for weight key `name` from `spec` (None, instance, callable, type string or options dict).

    Returns the component and the type string it was built from (None for Python objects).
    """
    if spec is None:
        spec = {}
    if isinstance(spec, RewardComponent) or (callable(spec) and not isinstance(spec, str)):
        return as_component(spec, name), None
    if isinstance(spec, str):
        spec = {"type": spec}
    if not isinstance(spec, Mapping):
        raise ValueError(f"reward component {name!r}: options must be a mapping, a type name or an import path, "
                         f"got {type(spec).__name__}")
    options = dict(spec)
    type_name = str(options.pop("type", name))
    bounds = options.pop("range", None)
    target = _resolve_type(name, type_name)
    if isinstance(target, type) and issubclass(target, RewardComponent):
        _check_options(name, type_name, target, options)
        comp = _construct(name, type_name, target, options)
        if bounds is not None:
            try:
                comp.range = _bounds(name, bounds)
            except AttributeError as exc:
                raise ValueError(f"reward component {name!r} ({type_name}) computes its range from its options; "
                                 "set those instead of 'range'") from exc
        return comp, type_name
    if isinstance(target, type):
        inst = _construct(name, type_name, target, options)
        rng = _bounds(name, bounds) if bounds is not None else getattr(inst, "range", (-math.inf, math.inf))
        wrapped = FunctionComponent(inst, name, rng)
        wrapped.options_given = options
        return wrapped, type_name
    if not callable(target):
        raise ValueError(f"reward component {name!r}: {type_name!r} is not a class or a function")
    if options:
        raise ValueError(f"reward component {name!r}: {type_name!r} is a plain function and takes no options "
                         f"(got {sorted(options)}); only 'range' may be set")
    rng = _bounds(name, bounds) if bounds is not None else getattr(target, "range", (-math.inf, math.inf))
    return FunctionComponent(target, name, rng), type_name


def parse_config(data: Any, *, source: str = "<dict>", doc: YamlDoc | None = None) -> dict[str, Any]:
    """Check a reward config mapping's shape and types; returns CompositeReward keyword arguments.

    Errors are `ConfigError`s naming `source` (or `doc`'s file and line) and the key."""
    from marft_lg.rewards.placement import CREDIT_MODES

    doc = doc if doc is not None else YamlDoc.of(data, source)
    if not isinstance(data, Mapping):
        raise doc.error(f"a reward config must be a mapping with keys {list(TOP_LEVEL_KEYS)}, got "
                        f"{type(data).__name__}")
    unknown = [k for k in data if k not in TOP_LEVEL_KEYS]
    if unknown:
        also = f" (also unknown: {[str(k) for k in unknown[1:]]})" if len(unknown) > 1 else ""
        raise doc.error(f"unknown key; a reward config has {list(TOP_LEVEL_KEYS)}{also}", (unknown[0],))
    weights = data.get("weights")
    if not weights:
        raise doc.error("'weights' is missing or empty; e.g. weights: {task_completion: 1.0}", ("weights",))
    if not isinstance(weights, Mapping):
        raise doc.error(f"'weights' must map component names to numbers, got {type(weights).__name__} {weights!r:.60}",
                        ("weights",))
    checked: dict[str, float] = {}
    for name, w in weights.items():
        if not isinstance(name, str) or not name:
            raise doc.error(f"a component name must be non-empty text, got {type(name).__name__} {name!r}",
                            ("weights", name))
        checked[name] = convert(w, float, doc, ("weights", name))
    components = data.get("components") or {}
    if not isinstance(components, Mapping):
        raise doc.error(f"'components' must map component names to options, got {type(components).__name__}",
                        ("components",))
    for name, spec in components.items():
        if name not in checked:
            raise doc.error(f"component {name!r} has options but no weight; add it to weights (weight 0 records "
                            f"the column without adding to the reward). Weights: {sorted(checked)}",
                            ("components", name))
        if spec is not None and not isinstance(spec, str | Mapping):
            raise doc.error(f"options must be a mapping, a type name or an import path, got "
                            f"{type(spec).__name__} {spec!r:.60}", ("components", name))
    credit = data.get("credit", "terminal")
    if credit not in CREDIT_MODES:
        raise doc.error(f"credit must be one of {list(CREDIT_MODES)}, got {credit!r}", ("credit",))
    answer_agents = data.get("answer_agents")
    if answer_agents is not None:
        answer_agents = convert(answer_agents, list[str], doc, ("answer_agents",))
        if not all(answer_agents):
            raise doc.error("agent names must be non-empty", ("answer_agents",))
    errored = data.get("errored", "unscored")
    if errored not in ERRORED_MODES:
        raise doc.error(f"errored must be one of {list(ERRORED_MODES)}, got {errored!r}", ("errored",))
    return {"weights": checked, "components": dict(components), "credit": credit, "answer_agents": answer_agents,
            "errored": errored}


def component_spec(name: str, comp: RewardComponent, type_name: str | None, inherited: set[str]) -> dict[str, Any]:
    """The YAML options of one component (the inverse of `build_component`)."""
    if type_name is None:
        type_name = _type_name_of(name, comp)
    if isinstance(comp, FunctionComponent):
        out: dict[str, Any] = dict(getattr(comp, "options_given", {}))
        if all(math.isfinite(b) for b in comp.range):
            out["range"] = list(comp.range)
    else:
        out = {k: _serialisable(name, k, v) for k, v in comp.options().items()}
        cls = type(comp)
        if "answer_agents" in inherited:
            out["answer_agents"] = None
        declared = getattr(cls, "range", None)
        if not isinstance(declared, property) and tuple(comp.range) != tuple(declared or ()):
            out["range"] = list(comp.range)
    if type_name != name:
        out = {"type": type_name, **out}
    return out


def _construct(name: str, type_name: str, target: type, options: dict[str, Any]) -> Any:
    """`target(**options)`; whatever it raises for bad options becomes a ValueError naming the component."""
    try:
        return target(**options)
    except ValueError:
        raise
    except Exception as exc:  # a component's constructor may raise anything for a bad option value
        raise ValueError(f"reward component {name!r} ({type_name}): {type(exc).__name__}: {exc}") from exc


def _resolve_type(name: str, type_name: str) -> Any:
    cls = get_component_class(type_name)
    if cls is not None:
        return cls
    if is_import_path(type_name):
        return load_object(type_name, what="reward component" if name == type_name else f"reward component {name!r} of type")
    raise ValueError(f"unknown reward component {type_name!r} (weight key {name!r}); known: {known_components()}; "
                     "or give a user component as an import path 'pkg.module:Name' or 'file.py:Name'")


def _check_options(name: str, type_name: str, cls: type, options: Mapping[str, Any]) -> None:
    if not dataclasses.is_dataclass(cls):
        return
    known = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = set(options) - set(known)
    if unknown:
        raise ValueError(f"reward component {name!r} ({type_name}): unknown options {sorted(unknown)}; "
                         f"known: {known + ['range', 'type']}")


def _bounds(name: str, value: Any) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"reward component {name!r}: range must be [low, high], got {value!r}") from exc
    if not lo <= hi:
        raise ValueError(f"reward component {name!r}: range low {lo} is above high {hi}")
    return lo, hi


def _type_name_of(name: str, comp: RewardComponent) -> str:
    target: Any = comp.fn if isinstance(comp, FunctionComponent) else type(comp)
    registered = getattr(target, "name", None)
    if isinstance(target, type) and registered and get_component_class(registered) is target:
        return registered
    path = import_path_of(target)
    if path is None:
        raise ValueError(f"reward component {name!r} ({target!r}) cannot be written to YAML: it has no import path "
                         "(a lambda, a local function or a module loaded from a file); define it at module level")
    return path


def _serialisable(name: str, key: str, value: Any) -> Any:
    if callable(value) and not isinstance(value, type | str):
        path = import_path_of(value)
        if path is None:
            raise ValueError(f"reward component {name!r}: option {key!r} holds {value!r}, which has no import path; "
                             "define it at module level to write this reward to YAML")
        return path
    return value

