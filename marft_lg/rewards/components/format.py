"""FormatCompliance: does each agent's output follow the format the next agent (or the user) parses?"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from marft_lg.rewards.base import ComponentScore, RewardComponent
from marft_lg.rewards.registry import register_component
from marft_lg.trajectories.dataset import Episode

_FENCE = re.compile(r"^\s*```(?:json)?\s*(.*?)\s*```\s*$", re.DOTALL)
_RULE_KEYS = {"regex", "fullmatch", "json", "json_schema"}


@dataclass
class _Rule:
    regex: re.Pattern[str] | None
    fullmatch: bool
    json: bool
    schema: dict[str, Any] | None

    def ok(self, text: str) -> bool:
        if self.regex is not None:
            hit = self.regex.fullmatch(text.strip()) if self.fullmatch else self.regex.search(text)
            if not hit:
                return False
        if self.json or self.schema is not None:
            m = _FENCE.match(text)
            try:
                data = json.loads(m.group(1) if m else text)
            except json.JSONDecodeError:
                return False
            if self.schema is not None:
                import jsonschema

                return jsonschema.Draft202012Validator(self.schema).is_valid(data)
        return True


def _compile(agent: str, spec: Any) -> _Rule:
    if isinstance(spec, str):
        spec = {"regex": spec}
    if not isinstance(spec, dict):
        raise ValueError(f"format_compliance: the rule for agent {agent!r} must be a regex string or a mapping "
                         f"with keys {sorted(_RULE_KEYS)}, got {spec!r}")
    unknown = set(spec) - _RULE_KEYS
    if unknown:
        raise ValueError(f"format_compliance: unknown keys {sorted(unknown)} in the rule for agent {agent!r}; "
                         f"known: {sorted(_RULE_KEYS)}")
    try:
        regex = re.compile(spec["regex"], re.DOTALL) if spec.get("regex") else None
    except re.error as exc:
        raise ValueError(f"format_compliance: bad regex for agent {agent!r}: {exc}") from exc
    schema = spec.get("json_schema")
    if isinstance(schema, str):
        path = Path(schema)
        if not path.exists():
            raise ValueError(f"format_compliance: JSON schema file {path} for agent {agent!r} does not exist")
        schema = json.loads(path.read_text())
    if schema is not None:
        import jsonschema

        try:
            jsonschema.Draft202012Validator.check_schema(schema)
        except jsonschema.SchemaError as exc:
            raise ValueError(f"format_compliance: the JSON schema for agent {agent!r} is invalid: {exc.message}") from exc
    return _Rule(regex, bool(spec.get("fullmatch", False)), bool(spec.get("json", False)), schema)


@register_component("format_compliance")
@dataclass
class FormatCompliance(RewardComponent):
    """Fraction of checked actions whose completion follows its agent's rule (1.0 when none is checked).

    `agents` maps an agent to a rule: a regex string, or ``{regex, fullmatch, json, json_schema}``
    where `json_schema` is a schema dict or a path to a JSON file (code fences are stripped before
    parsing). `default` is the rule for agents not listed (None: they are not checked).
    Each compliant action carries its share.
    """

    name = "format_compliance"
    range = (0.0, 1.0)

    agents: dict[str, Any] = field(default_factory=dict)
    default: Any = None

    def __post_init__(self) -> None:
        self._rules = {agent: _compile(agent, spec) for agent, spec in self.agents.items()}
        self._default = None if self.default is None else _compile("<default>", self.default)

    def __call__(self, episode: Episode) -> ComponentScore:
        results: dict[int, bool] = {}
        for a in episode.actions:
            rule = self._rules.get(a.get("agent"), self._default)
            if rule is not None:
                results[int(a["order"])] = rule.ok(str(a.get("completion") or ""))
        if not results:
            return ComponentScore(1.0)
        share = 1.0 / len(results)
        return ComponentScore(sum(results.values()) * share, {o: share for o, ok in results.items() if ok})
