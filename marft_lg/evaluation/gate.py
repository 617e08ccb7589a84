"""The promotion gate: a YAML policy that turns a ComparisonResult into promote / reject, with reasons.

A candidate is promoted only when every check passes: the team reward gained enough with a CI
lower bound above zero, no reward component and no agent regressed beyond its tolerance, every
safety check holds, and the cost stays under a ceiling relative to the baseline.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from marft_lg._config import ConfigError, YamlDoc, check_fields, check_int, check_range, load_yaml
from marft_lg._durable import write_atomic
from marft_lg.evaluation.agent_metrics import AGENT_METRICS, EPISODE_METRICS, HIGHER_IS_BETTER
from marft_lg.evaluation.comparison import ComparisonResult


@dataclass
class SafetyCheck:
    """A must-pass check on the candidate: its mean `component` (reward component or episode metric)
    must be >= `min` and/or <= `max`; with `no_regression` it must also not fall below the baseline."""

    name: str
    component: str
    min: float | None = None
    max: float | None = None
    no_regression: bool = False

    def __post_init__(self) -> None:
        for key in ("name", "component"):
            if not isinstance(getattr(self, key), str) or not getattr(self, key):
                raise ConfigError(f"expected non-empty text, got {getattr(self, key)!r}", key=key)
        check_range("min", self.min, allow_none=True)
        check_range("max", self.max, allow_none=True)
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ConfigError(f"min {self.min} is above max {self.max}", key="min")
        if not isinstance(self.no_regression, bool):
            raise ConfigError(f"expected true or false, got {self.no_regression!r}", key="no_regression")


@dataclass
class GateCheck:
    """One evaluated check: what was measured against what, and whether it passed."""

    name: str
    passed: bool
    value: float | None
    threshold: float | None
    detail: str


@dataclass
class GateDecision:
    """promote (True/False), the failed checks' reasons, and every check that was run."""

    promote: bool
    reasons: list[str]
    checks: list[GateCheck]
    gate: dict[str, Any]
    created: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    context: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"decision": "promote" if self.promote else "reject", "promote": self.promote, "reasons": self.reasons,
                "checks": [asdict(c) for c in self.checks], "gate": self.gate, "created": self.created,
                "context": self.context}

    def write(self, path: str | Path) -> Path:
        """Write the decision as JSON (atomically); `path` may be a run directory."""
        p = Path(path)
        if p.is_dir() or not p.suffix:
            p = p / "decision.json"
        p.parent.mkdir(parents=True, exist_ok=True)
        return write_atomic(p, json.dumps(self.to_dict(), indent=2, default=str))

    @classmethod
    def read(cls, path: str | Path) -> GateDecision:
        p = Path(path)
        if p.is_dir():
            p = p / "decision.json"
        if not p.exists():
            raise FileNotFoundError(f"no gate decision at {p}: run `marft-lg compare ... --gate GATE.yaml` first")
        try:
            data = json.loads(p.read_text())
            return cls(promote=bool(data["promote"]), reasons=list(data["reasons"]),
                       checks=[GateCheck(**c) for c in data["checks"]], gate=data.get("gate", {}),
                       created=data.get("created", ""), context=data.get("context", {}))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"gate decision {p} cannot be read as JSON: {exc}") from None
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"gate decision {p} is not a `marft-lg compare` decision.json (bad or missing "
                             f"{exc})") from None


def _fmt(v: float | None) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:+.4g}"


def _clean(v: float | None) -> float | None:
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


@dataclass
class PromotionGate:
    """Promotion policy. Tolerances are absolute: a drop (or, for costs, a rise) of the mean paired
    difference beyond the tolerance is a regression. Keys ``"*"`` set the default."""

    min_team_reward_gain: float = 0.0  # mean(candidate - baseline) team reward must be >= this
    require_ci_lower_above_zero: bool = True  # and the CI's lower bound must be > 0
    min_pairs: int = 5  # fewer paired scenarios than this: not enough evidence, reject
    component_tolerance: dict[str, float] = field(default_factory=lambda: {"*": 0.05})
    # per-agent metric -> tolerated regression; only the metrics listed are checked
    agent_tolerance: dict[str, float] = field(default_factory=lambda: {"reward": 0.05, "format_compliance": 0.05,
                                                                         "tool_accuracy": 0.05})
    agent_overrides: dict[str, dict[str, float]] = field(default_factory=dict)  # agent -> {metric: tolerance}
    safety: list[SafetyCheck] = field(default_factory=list)
    max_cost_ratio: float | None = 1.5  # candidate mean tokens / baseline mean tokens
    max_error_rate_increase: float = 0.0  # candidate episode error rate - baseline's

    def __post_init__(self) -> None:
        """Check types and ranges; a bad value raises `ConfigError` (a ValueError) naming the key."""
        if not isinstance(self.safety, list):
            raise ConfigError(f"expected a list of safety checks, got {type(self.safety).__name__}", key="safety")
        checks = []
        for i, s in enumerate(self.safety):
            if not isinstance(s, SafetyCheck | dict):
                raise ConfigError(f"expected a safety check mapping {{name, component, min, max, no_regression}}, "
                                  f"got {type(s).__name__}", key=("safety", i))
            if isinstance(s, SafetyCheck):
                checks.append(s)
                continue
            try:
                checks.append(SafetyCheck(**s))
            except TypeError as exc:
                raise ConfigError(f"bad safety check ({exc})", key=("safety", i)) from None
            except ConfigError as exc:
                raise ConfigError(exc.problem, key=("safety", i, *exc.key)) from None
        self.safety = checks
        check_range("min_team_reward_gain", self.min_team_reward_gain)
        check_int("min_pairs", self.min_pairs, low=1)
        check_range("max_cost_ratio", self.max_cost_ratio, low=0.0, low_open=True, allow_none=True)
        check_range("max_error_rate_increase", self.max_error_rate_increase)
        if not isinstance(self.require_ci_lower_above_zero, bool):
            raise ConfigError(f"expected true or false, got {self.require_ci_lower_above_zero!r}",
                              key="require_ci_lower_above_zero")
        tables = [("component_tolerance", self.component_tolerance), ("agent_tolerance", self.agent_tolerance)]
        if not isinstance(self.agent_overrides, dict):
            raise ConfigError("expected a mapping {agent: {metric: tolerance}}", key="agent_overrides")
        tables += [(("agent_overrides", a), t) for a, t in self.agent_overrides.items()]
        for key, table in tables:
            if not isinstance(table, dict):
                raise ConfigError(f"expected a mapping of names to tolerances, got {type(table).__name__}", key=key)
            for name, tol in table.items():
                check_range((*((key,) if isinstance(key, str) else key), str(name)), tol, low=0.0)
        unknown = set(self.agent_tolerance) - set(AGENT_METRICS)
        for overrides in self.agent_overrides.values():
            unknown |= set(overrides) - set(AGENT_METRICS)
        if unknown:
            raise ConfigError(f"unknown per-agent metrics {sorted(unknown)} in gate; known: {list(AGENT_METRICS)}")

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "<dict>", doc: YamlDoc | None = None) -> PromotionGate:
        """Build from a mapping; unknown keys, wrong types and out-of-range values raise `ConfigError` (a
        ValueError) naming `source` (or `doc`'s file and line) and the key."""
        doc = doc if doc is not None else YamlDoc.of(data, source)
        if not isinstance(data, dict):
            raise doc.error(f"a gate is a mapping of settings, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = [k for k in data if k not in known]
        if unknown:
            lines = "".join(f"\n  {doc.error('unknown gate key', (k,))}" for k in unknown)
            raise ConfigError(f"unknown gate keys {sorted(map(str, unknown))}; known: {sorted(known)}{lines}",
                              path=doc.source)
        checked = check_fields(cls, data, doc, what="gate")
        try:
            return cls(**checked)
        except ConfigError as exc:
            raise doc.locate(exc) from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> PromotionGate:
        """Load a gate from YAML (missing keys keep their defaults; the settings may sit under a `gate:` key)."""
        doc = load_yaml(path, what="gate file")
        if doc.data is None:
            return cls()
        if not isinstance(doc.data, dict):
            raise doc.error(f"a gate is a YAML mapping of settings, got {type(doc.data).__name__}")
        if "gate" in doc.data:
            doc = doc.at("gate")
        return cls.from_dict(doc.data if doc.data is not None else {}, doc=doc)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def _tolerance(self, table: dict[str, float], key: str) -> float | None:
        return table.get(key, table.get("*"))

    def evaluate(self, result: ComparisonResult, *, context: dict[str, Any] | None = None) -> GateDecision:
        """Run every check on `result`; promote only if all pass."""
        checks: list[GateCheck] = []
        n = result.team.n
        checks.append(GateCheck("enough_pairs", n >= self.min_pairs, n, self.min_pairs,
                                f"{n} paired scenarios (need >= {self.min_pairs})" + _few_pairs_why(result, n)))
        team = result.team
        checks.append(GateCheck("team_reward_gain", not math.isnan(team.mean) and team.mean >= self.min_team_reward_gain,
                                _clean(team.mean), self.min_team_reward_gain,
                                f"team reward delta {_fmt(team.mean)} (need >= {self.min_team_reward_gain:+g})"))
        if self.require_ci_lower_above_zero:
            ok = team.defined and team.low > 0
            checks.append(GateCheck("team_reward_ci_lower_above_zero", ok, _clean(team.low), 0.0,
                                    f"{team.confidence:.0%} CI [{_fmt(team.low)}, {_fmt(team.high)}] "
                                    f"(lower bound must be > 0)"))
        for name, ci in result.components.items():
            tol = self._tolerance(self.component_tolerance, name)
            if tol is None or math.isnan(ci.mean):
                continue
            if result.component_signs.get(name, 1) < 0:  # a cost component (negative weight): a rise is the regression
                ok, bound, word = ci.mean <= tol, tol, "rise"
            else:
                ok, bound, word = ci.mean >= -tol, -tol, "drop"
            checks.append(GateCheck(f"component:{name}", ok, _clean(ci.mean), bound,
                                    f"component {name!r} delta {_fmt(ci.mean)} (tolerated {word} {tol:g})"))
        for agent, metrics in result.agents.items():
            table = {**self.agent_tolerance, **self.agent_overrides.get(agent, {})}
            for metric, tol in table.items():
                ci = metrics.get(metric)
                if ci is None or math.isnan(ci.mean):
                    continue
                if metric in HIGHER_IS_BETTER:
                    ok, bound, word = ci.mean >= -tol, -tol, "drop"
                else:
                    ok, bound, word = ci.mean <= tol, tol, "rise"
                checks.append(GateCheck(f"agent:{agent}:{metric}", ok, _clean(ci.mean), bound,
                                        f"agent {agent!r} {metric} delta {_fmt(ci.mean)} (tolerated {word} {tol:g})"))
        for s in self.safety:
            checks.append(self._safety(s, result))
        if self.max_cost_ratio is not None:
            ratio = result.cost_ratio("tokens")
            ok = math.isnan(ratio) or ratio <= self.max_cost_ratio
            checks.append(GateCheck("cost_ratio", ok, _clean(ratio), self.max_cost_ratio,
                                    f"candidate uses {_fmt(ratio)}x the baseline's tokens (ceiling {self.max_cost_ratio:g}x)"))
        err = result.episode_metrics["error"].mean
        if not math.isnan(err):
            checks.append(GateCheck("error_rate", err <= self.max_error_rate_increase, _clean(err),
                                    self.max_error_rate_increase,
                                    f"episode error rate delta {_fmt(err)} (tolerated rise {self.max_error_rate_increase:g})"))
        reasons = [c.detail for c in checks if not c.passed]
        return GateDecision(promote=not reasons, reasons=reasons, checks=checks, gate=self.to_dict(),
                            context={**result.meta, **(context or {})})

    def _safety(self, s: SafetyCheck, result: ComparisonResult) -> GateCheck:
        known = set(result.candidate.components) | set(EPISODE_METRICS) | {"reward"}
        if s.component not in known:
            return GateCheck(f"safety:{s.name}", False, None, None,
                             f"safety check {s.name!r}: {s.component!r} was not measured (known: {sorted(known)})")
        value = result.side_mean("candidate", s.component)
        problems = []
        if math.isnan(value):
            problems.append("no scored candidate episodes")
        if s.min is not None and not value >= s.min:
            problems.append(f"mean {_fmt(value)} < min {s.min:g}")
        if s.max is not None and not value <= s.max:
            problems.append(f"mean {_fmt(value)} > max {s.max:g}")
        if s.no_regression:
            base = result.side_mean("baseline", s.component)
            if value < base:
                problems.append(f"regressed from baseline {_fmt(base)}")
        threshold = s.min if s.min is not None else s.max
        detail = f"safety check {s.name!r} on {s.component!r}: " + ("; ".join(problems) if problems else f"ok ({_fmt(value)})")
        return GateCheck(f"safety:{s.name}", not problems, _clean(value), threshold, detail)


def _few_pairs_why(result: ComparisonResult, n: int) -> str:
    """Why fewer pairs than scenarios were compared: episodes the reward could not score, on each side."""
    sides = [(name, side) for name, side in (("baseline", result.baseline), ("candidate", result.candidate))
             if side.reward_errors]
    if not sides:
        return ""
    counts = ", ".join(f"{name} {side.reward_errors} of {len(side.episodes)}" for name, side in sides)
    first = next((side.unscored_reasons[0] for _, side in sides if side.unscored_reasons), None)
    return f"; unscored episodes: {counts}" + (f" (first: {first})" if first else "")
