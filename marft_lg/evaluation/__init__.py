"""marft_lg.evaluation: shadow-compare a candidate team against the live one, gate, promote, roll back.

Modules: `shadow` (replay / mirrored pairs), `comparison` (paired per-unit comparison),
`agent_metrics`, `drift` (per-agent KL), `stats` (paired bootstrap), `gate` (YAML promotion gate),
`promotion` (promote/rollback + server hot swap), `report` (Markdown/HTML/PNG); `scenarios_from_dataset` lives in
`trajectories.scenario_sets` (training takes scenarios from traces too).
Names below are imported on first use so `import marft_lg.evaluation` stays cheap.
"""

from __future__ import annotations

from marft_lg._lazy import lazy_exports

_EXPORTS = {
    "shadow_compare": ".shadow", "compare_mirrored": ".shadow",
    "compare_datasets": ".comparison", "ComparisonResult": ".comparison",
    "PromotionGate": ".gate", "GateDecision": ".gate",
    "promote": ".promotion", "rollback": ".promotion", "PromotionError": ".promotion",
    "write_report": ".report", "print_summary": ".report",
    "paired_bootstrap": ".stats", "bootstrap_ci": ".stats", "PairedCI": ".stats",
    "policy_drift": ".drift", "scenarios_from_dataset": "marft_lg.trajectories.scenario_sets",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
