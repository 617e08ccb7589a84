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
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2, default=str))
        tmp.replace(p)
        return p

    @classmethod
    def read(cls, path: str | Path) -> GateDecision:
        p = Path(path)
        if p.is_dir():
            p = p / "decision.json"
        if not p.exists():
            raise FileNotFoundError(f"no gate decision at {p}: run `marft-lg compare ... --gate GATE.yaml` first")
        data = json.loads(p.read_text())
        return cls(promote=bool(data["promote"]), reasons=list(data["reasons"]),
                   checks=[GateCheck(**c) for c in data["checks"]], gate=data.get("gate", {}),
                   created=data.get("created", ""), context=data.get("context", {}))


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
        self.safety = [s if isinstance(s, SafetyCheck) else SafetyCheck(**s) for s in self.safety]
        unknown = set(self.agent_tolerance) - set(AGENT_METRICS)
        for overrides in self.agent_overrides.values():
            unknown |= set(overrides) - set(AGENT_METRICS)
        if unknown:
            raise ValueError(f"unknown per-agent metrics {sorted(unknown)} in gate; known: {list(AGENT_METRICS)}")

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "<dict>") -> PromotionGate:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"{source}: unknown gate keys {sorted(unknown)}; known: {sorted(known)}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ValueError(f"{source}: bad gate entry ({exc})") from exc

    @classmethod
    def from_yaml(cls, path: str | Path) -> PromotionGate:
        """Load a gate from YAML (missing keys keep their defaults)."""
        import yaml

        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"gate file {p} does not exist")
        data = yaml.safe_load(p.read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{p}: a gate is a YAML mapping of settings, got {type(data).__name__}")
        return cls.from_dict(data.get("gate", data), source=str(p))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def _tolerance(self, table: dict[str, float], key: str) -> float | None:
        return table.get(key, table.get("*"))

    def evaluate(self, result: ComparisonResult, *, context: dict[str, Any] | None = None) -> GateDecision:
        """Run every check on `result`; promote only if all pass."""
        checks: list[GateCheck] = []
        n = result.team.n
        checks.append(GateCheck("enough_pairs", n >= self.min_pairs, n, self.min_pairs,
                                f"{n} paired scenarios (need >= {self.min_pairs})"))
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
