"""What each setting buys (issue #46): the demo per arm and seed, dynamic sampling and the warm start on and off, plus a
grid of settings, each a whole `marft-lg demo` run in its own run directory.

    python benchmarks/learn.py --dry-run                                  # the plan: arms x seeds, what each passes
    python benchmarks/learn.py                                            # baseline, +dynamic_sampling, +warm_start,
                                                                          # +both on seeds 0,1,2 (~15 min per run)
    python benchmarks/learn.py --arms baseline --grid 'learning_rate=1e-4,1e-3;group_size=4,8' --append
    python benchmarks/learn.py --table                                    # the Markdown table of the results file

Arms (`ARMS`): `baseline` (the demo without dynamic sampling or a warm start, its defaults until dynamic sampling
was measured here), `dynamic_sampling` (``marft.dynamic_sampling: true``, the demo's default since), `warm_start`
(the warm start's defaults before offline MARFT, no dynamic sampling), `both`. `--grid 'key=v1,v2;key2=...'` crosses every arm with every
point of the grid; a key is a `MARFTConfig` field (passed as the demo's `credit` overrides), a `DemoBudget` field
(group_size, scenarios_per_iteration, online_iterations, online_minutes, offline_passes, traces_per_problem, n_traced,
max_tokens), ``warm_start.<WarmStartConfig field>`` (only on arms with the warm start), ``lora.<LoraSettings field>``
(the agents' fresh adapters: ``lora.r=4,16``, ``lora.target_modules=q_proj+v_proj,q_proj+k_proj+v_proj+o_proj``)
or ``rollout_temperature`` (the on-policy sampler's). The held-out set is the yardstick and cannot be set.

Each run: `runs/learn/<label>-seed<k>` (and its traces `traces/demo-<label>-seed<k>`), both removed first. Writes
benchmarks/results/learn.json after each run: top-level `commit` (the code that ran, `_provenance.code_state`),
`machine`, the plan, `runs` (per arm and seed: the held-out team-reward gain with its 95% CI, strict / lenient
accuracy untuned -> tuned, each reward component's gain and CI (task_completion: is the answer right), minutes, and
the waste measured in train/metrics.jsonl: mean `equal_groups_share`, `zero_advantage_share`, `tokens_per_min`,
dynamic sampling's draws and skipped iterations) and `aggregate` per arm (promote count, mean gain, worst seed, seeds
whose task_completion CI is above 0, seeds where the tuned team is significantly worse). `--append` keeps the runs
already in the file (same budget and model) and runs only the missing ones; with `--replace` it runs the planned ones
again too, moving each older run to `superseded` (kept, with the reason). `--adopt RUN_DIR...` takes finished `marft-lg
demo` runs (benchmarks/demo.py's) as the planned runs they are the same as (seed, budget and the settings run_demo
resolves; any other is refused, saying how it differs), each with its own commit and host, instead of running them.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "learn.json"
MODEL = "embedded:smollm2-135m-instruct"

# arm -> what it passes to run_demo (`credit` over the demo's settings, `warm_start`); each arm says whether dynamic
# sampling is on, so an arm means the same runs whatever the demo's default (on since learn.json's seeds 0-2 of it)
ARMS: dict[str, dict[str, Any]] = {
    "baseline": {"credit": {"dynamic_sampling": False}, "warm_start": None},
    "dynamic_sampling": {"credit": {"dynamic_sampling": True}, "warm_start": None},
    "warm_start": {"credit": {"dynamic_sampling": False}, "warm_start": {}},
    "both": {"credit": {"dynamic_sampling": True}, "warm_start": {}},
}

# DemoBudget fields a grid may set (name, minutes and n_heldout are not settings: the held-out set is the yardstick)
BUDGET_KEYS = ("group_size", "scenarios_per_iteration", "online_iterations", "online_minutes", "offline_passes",
               "traces_per_problem", "n_traced", "max_tokens")
# MARFTConfig fields the demo sets itself from its budget or its bookkeeping: `credit` cannot override them
DEMO_OWNED = {"group_size": "a budget key here", "max_new_tokens": "set from the budget's max_tokens",
              "max_context": "fixed by the demo", "seed": "use --seeds", "offline_passes": "a budget key here",
              "offline_episodes_per_iteration": "fixed by the demo", "checkpoint_every": "fixed by the demo",
              "rollout_concurrency": "fixed by the demo", "report_to": "not a setting",
              "dynamic_sampling": "it is an arm: --arms dynamic_sampling,both"}
# names a reader may try that mean something else here
NOT_PASSABLE = {
    "temperature": "MARFTConfig.temperature does not reach the demo's sampler (the trainer samples through the app): "
                   "use rollout_temperature",
    "lora_rank": "use lora.r", "lora_r": "use lora.r", "lora_alpha": "use lora.alpha", "lora_dropout": "use lora.dropout",
    "target_modules": "use lora.target_modules (modules joined by '+': q_proj+v_proj)",
    "n_heldout": "the held-out set is the yardstick every arm is measured on; it stays the budget's",
}
GOAL = ("#46: full budget, seeds 0-4: promote on 5 of 5, mean held-out team-reward gain >= +0.30, strict accuracy at "
        "least double the untuned team's on every seed, task_completion gain's 95% CI above 0 on every seed, no seed "
        "worse; the ablation (seeds 0-2) shows what each of dynamic sampling, the warm start and the settings buys")


# ---------------------------------------------------------------------------------------------------- the plan


def _value(text: str) -> Any:
    """A grid value: true/false, null/none, an int, a float, else the string."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("null", "none"):
        return None
    for kind in (int, float):
        try:
            return kind(text.strip())
        except ValueError:
            pass
    return text.strip()


def _marft_fields() -> set[str]:
    from marft_lg.training.config import MARFTConfig

    return {f.name for f in dataclasses.fields(MARFTConfig)}


def _warm_start_fields() -> set[str]:
    from marft_lg.training.warm_start import WarmStartConfig

    return {f.name for f in dataclasses.fields(WarmStartConfig)}


def check_key(key: str) -> str:
    """Where `key` goes: ``budget``, ``marft``, ``warm_start``, ``lora`` or ``rollout``; a ValueError saying why for
    any other."""
    if key.startswith("lora."):
        from marft_lg.serving.registry.lora import LoraSettings

        known = {f.name for f in dataclasses.fields(LoraSettings)}
        if key.split(".", 1)[1] not in known:
            raise ValueError(f"--grid: unknown LoRA key {key!r}; LoraSettings takes {sorted('lora.' + k for k in known)}")
        return "lora"
    if key == "rollout_temperature":
        return "rollout"
    if key.startswith("warm_start."):
        name = key.split(".", 1)[1]
        known = _warm_start_fields()
        if name not in known:
            raise ValueError(f"--grid: unknown warm start key {key!r}; WarmStartConfig takes "
                             f"{sorted('warm_start.' + k for k in known)}")
        return "warm_start"
    if key in BUDGET_KEYS:
        return "budget"
    if key in NOT_PASSABLE:
        raise ValueError(f"--grid: {key!r} is not a setting here: {NOT_PASSABLE[key]}")
    if key in DEMO_OWNED:
        raise ValueError(f"--grid: {key!r} is not a credit override of the demo ({DEMO_OWNED[key]})")
    if key in _marft_fields():
        return "marft"
    raise ValueError(f"--grid: unknown key {key!r}; use a MARFTConfig field (e.g. learning_rate, num_minibatches, "
                     f"ppo_epochs, entropy_coef, kl_cut, credit_normalize, dynamic_sampling_max_draws), a budget "
                     f"field {list(BUDGET_KEYS)} or warm_start.<field>")


def parse_grid(spec: str | None) -> list[dict[str, Any]]:
    """``'learning_rate=5e-5,1e-4;group_size=4,8'`` -> every point of the grid, in order (``[{}]`` for no grid).
    A key given twice, one without values or one `check_key` refuses is a ValueError."""
    if not spec or not spec.strip():
        return [{}]
    axes: dict[str, list[Any]] = {}
    for part in spec.split(";"):
        if not part.strip():
            continue
        key, eq, values = part.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ValueError(f"--grid: {part.strip()!r} is not key=value[,value...]")
        check_key(key)
        if key in axes:
            raise ValueError(f"--grid: {key!r} is given twice")
        vals = [_value(v) for v in values.split(",") if v.strip()]
        if not vals:
            raise ValueError(f"--grid: {key!r} has no values")
        axes[key] = vals
    return [dict(zip(axes, combo, strict=True)) for combo in itertools.product(*axes.values())]


def _fmt_value(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def label(arm: str, settings: dict[str, Any]) -> str:
    """A run's name, safe as a directory name: the arm, then each grid setting (``baseline__learning_rate-0.0001``)."""
    parts = [arm] + [f"{k}-{_fmt_value(v)}" for k, v in settings.items()]
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", "__".join(parts))


def demo_kwargs(arm: str, settings: dict[str, Any], budget_name: str, seed: int) -> dict[str, Any]:
    """`run_demo`'s keyword arguments for one arm and grid point (budget, seed, credit, warm_start); the MARFT and
    budget values are checked here, so a bad one stops the plan, not a run 15 minutes in."""
    from marft_lg.demo import BUDGETS

    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; choose from {list(ARMS)}")
    if budget_name not in BUDGETS:
        raise ValueError(f"unknown budget {budget_name!r}; choose from {sorted(BUDGETS)}")
    credit = dict(ARMS[arm]["credit"])
    warm = None if ARMS[arm]["warm_start"] is None else dict(ARMS[arm]["warm_start"])
    budget_over: dict[str, Any] = {}
    lora: dict[str, Any] = {}
    rollout_temperature = None
    for key, value in settings.items():
        where = check_key(key)
        if where == "budget":
            budget_over[key] = value
        elif where == "marft":
            credit[key] = value
        elif where == "lora":
            lora[key.split(".", 1)[1]] = value
        elif where == "rollout":
            rollout_temperature = value
        else:
            if warm is None:
                raise ValueError(f"--grid: {key!r} needs an arm with the warm start (warm_start, both), not {arm!r}")
            warm[key.split(".", 1)[1]] = value
    budget = BUDGETS[budget_name]
    for key, value in budget_over.items():
        want = type(getattr(budget, key))
        if isinstance(value, bool) or not isinstance(value, int | float) or (want is int and not isinstance(value, int)):
            raise ValueError(f"--grid: {key} must be {'an int' if want is int else 'a number'}, got {value!r}")
        if value <= 0:
            raise ValueError(f"--grid: {key} must be > 0, got {value!r}")
    budget = dataclasses.replace(budget, **{k: (float(v) if isinstance(getattr(budget, k), float) else v)
                                            for k, v in budget_over.items()})
    _check_marft(credit, budget)
    if warm is not None:
        from marft_lg.training.warm_start import WarmStartConfig

        WarmStartConfig(**warm)  # a bad value is a ValueError naming it
    from marft_lg.demo import _lora_settings, _rollout_temperature

    _lora_settings(lora or None)  # a bad LoRA setting or temperature is a ValueError naming it, before any run
    if rollout_temperature is not None:
        _rollout_temperature(rollout_temperature, 1.0)
    return {"budget": budget, "seed": seed, "credit": credit or None, "warm_start": warm, "lora": lora or None,
            "rollout_temperature": rollout_temperature}


def _check_marft(credit: dict[str, Any], budget: Any) -> None:
    """Build the MARFTConfig the demo would build (its settings, these overrides, the budget's values)."""
    from marft_lg.demo import marft_settings
    from marft_lg.training.config import ConfigError, MARFTConfig

    try:
        MARFTConfig(**marft_settings(credit), group_size=budget.group_size, max_new_tokens=budget.max_tokens)
    except (ConfigError, TypeError) as exc:
        raise ValueError(f"--grid: {exc}") from None


def plan(arms: list[str], grid: list[dict[str, Any]], seeds: list[int], budget_name: str,
         runs_root: Path = ROOT / "runs" / "learn") -> list[dict[str, Any]]:
    """Every run, seed-major (a slower stretch of the machine hits every arm of a seed alike): label, arm, settings,
    seed, run_dir and run_demo's kwargs."""
    out = []
    for seed in seeds:
        for arm in arms:
            for settings in grid:
                name = label(arm, settings)
                out.append({"label": name, "arm": arm, "settings": settings, "seed": seed,
                            "run_dir": runs_root / f"{name}-seed{seed}",
                            "kwargs": demo_kwargs(arm, settings, budget_name, seed)})
    return out


def describe(item: dict[str, Any]) -> str:
    """One line of the dry run: what the run passes to run_demo."""
    kw = item["kwargs"]
    b = kw["budget"]
    return (f"{item['label']} seed {item['seed']} -> {item['run_dir']}: budget {b.name} (group_size {b.group_size}, "
            f"{b.scenarios_per_iteration} problems/iteration, {b.online_iterations} iterations / {b.online_minutes:g} "
            f"min, offline_passes {b.offline_passes}), credit {kw['credit']}, warm_start {kw['warm_start']}"
            + (f", lora {kw['lora']}" if kw.get("lora") else "")
            + (f", rollout_temperature {kw['rollout_temperature']:g}" if kw.get("rollout_temperature") else ""))


# ---------------------------------------------------------------------------------------------- one finished run


def _mean(values: list[Any]) -> float | None:
    xs = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.fmean(xs) if xs else None


def _ci(d: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if d is None else {k: d.get(k) for k in ("mean", "low", "high", "n")}


def _components(run_dir: Path) -> dict[str, Any]:
    """Each reward component's paired gain with its CI: the demo log's `compare` event (the demo writes no
    comparison.json), else compare/comparison.json where a run has one."""
    log = run_dir / "demo_log.jsonl"
    if log.is_file():
        for line in log.read_text().splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            if row.get("event") == "compare" and isinstance(row.get("components"), dict):
                return row["components"]
    saved = run_dir / "compare" / "comparison.json"
    if saved.is_file():
        return json.loads(saved.read_text()).get("components") or {}
    return {}


def equal_share(row: dict[str, Any]) -> float | None:
    """A row's share of comparable groups whose returns were all equal: its `equal_groups_share`, else (the row of an
    iteration whose update dynamic sampling skipped carries no group counts) from its `dynamic_sampling` report."""
    if row.get("equal_groups_share") is not None:
        return float(row["equal_groups_share"])
    ds = row.get("dynamic_sampling")
    if isinstance(ds, dict) and ds.get("dropped_equal") is not None:
        comparable = int(ds.get("informative") or 0) + int(ds["dropped_equal"])
        return int(ds["dropped_equal"]) / comparable if comparable else None
    return None


def waste(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The waste and throughput of a run's MARFT iterations (offline and on-policy rows; the warm start apart)."""
    train = [r for r in rows if r.get("phase") in ("offline", "online")]
    online = [r for r in train if r.get("phase") == "online"]
    ds = [r["dynamic_sampling"] for r in train if isinstance(r.get("dynamic_sampling"), dict)]
    ws = [r for r in rows if r.get("phase") == "warm_start"]

    def minutes(key: str) -> float:
        return round(sum(float(r.get(key) or 0) for r in train) / 60, 2)

    return {
        "equal_groups_share": _mean([equal_share(r) for r in train]),
        "equal_groups_share_online": _mean([equal_share(r) for r in online]),
        "zero_advantage_share": _mean([r.get("zero_advantage_share") for r in train]),
        "tokens_per_min": _mean([r.get("tokens_per_min") for r in train]),
        "tokens_trained": sum(int(r.get("tokens") or 0) for r in train),
        "time_minutes": {k: minutes(f"{k}_s") for k in ("rollout", "scoring", "replay", "update")},
        "dynamic_sampling": None if not ds else {
            "iterations": len(ds), "draws": sum(int(d.get("draws") or 0) for d in ds),
            "extra_draws": sum(max(0, int(d.get("draws") or 0) - 1) for d in ds),
            "dropped_groups": sum(int(d.get("dropped_groups") or 0) for d in ds),
            "short_iterations": sum(1 for d in ds if d.get("short")),
        },
        "skipped_updates": sum(1 for r in online if r.get("skipped_update")),
        "warm_start": None if not ws else {"kept_episodes": ws[-1].get("kept_episodes"),
                                           "actions": ws[-1].get("actions"),
                                           "minutes": round(float(ws[-1].get("elapsed_s") or 0) / 60, 2)},
    }


def collect(run_dir: Path) -> dict[str, Any]:
    """One finished demo run's figures: summary.json, the demo log's component CIs and train/metrics.jsonl."""
    from marft_lg.training.metrics import read_metrics

    run_dir = Path(run_dir)
    s = json.loads((run_dir / "summary.json").read_text())
    rows = read_metrics(run_dir / "train" / "metrics.jsonl")
    h = s["heldout"]
    acc = h.get("accuracy") or {}
    comps = _components(run_dir)
    online = [r for r in rows if r.get("phase") == "online"]
    return {
        "seed": s["seed"], "run_dir": str(run_dir), "code": s.get("code"), "budget": s["budget"],
        "minutes": s["minutes"],
        "iterations": {p: sum(1 for r in rows if r.get("phase") == p) for p in ("warm_start", "offline", "online")},
        "online_training_minutes": round(sum(float(r.get("rollout_s") or 0) + float(r.get("time_s") or 0)
                                             for r in online) / 60, 2),
        "heldout_n": h["pairs"], "baseline_reward": h["baseline_reward"], "candidate_reward": h["candidate_reward"],
        "gain": _ci(h["difference"]), "mde": (h.get("mde") or {}).get("mde"),
        "strict": {"untuned": (acc.get("baseline") or {}).get("strict"),
                   "tuned": (acc.get("candidate") or {}).get("strict")},
        "lenient": {"untuned": (acc.get("baseline") or {}).get("lenient"),
                    "tuned": (acc.get("candidate") or {}).get("lenient")},
        "task_completion": _ci(comps.get("task_completion")),
        "components": {k: _ci(v) for k, v in comps.items()},
        "promote": s["gate"]["promote"], "reasons": s["gate"]["reasons"],
        "waste": waste(rows),
    }


def _start_event(run_dir: Path) -> dict[str, Any]:
    """A demo run's `start` event (what it ran with), or a ValueError naming the run directory."""
    log = Path(run_dir) / "demo_log.jsonl"
    if not log.is_file() or not (Path(run_dir) / "summary.json").is_file():
        raise ValueError(f"--adopt: {run_dir} is not a finished demo run (no demo_log.jsonl or summary.json)")
    for line in log.read_text().splitlines():
        row = json.loads(line) if line.strip() else {}
        if row.get("event") == "start":
            return row
    raise ValueError(f"--adopt: {log} has no start event")


def _ran_as(start: dict[str, Any], item: dict[str, Any], model: str) -> list[str]:
    """How a demo run (its `start` event) differs from a planned run: [] when it is that run (same seed, model,
    budget and the settings run_demo resolves: MARFT settings, warm start, LoRA, rollout temperature)."""
    from marft_lg.demo import _examples, _lora_settings, _rollout_temperature, marft_settings

    kw = item["kwargs"]
    budget = dataclasses.asdict(kw["budget"])
    lora = _lora_settings(kw["lora"])
    want = {"seed": item["seed"], "model": model, "budget": budget,
            "marft": marft_settings(kw["credit"]), "warm_start": kw["warm_start"],
            "lora": None if lora is None else dataclasses.asdict(lora),
            "rollout_temperature": _rollout_temperature(kw["rollout_temperature"],
                                                        _examples().settings.ROLLOUT_TEMPERATURE)}
    ran = {"seed": start.get("seed"), "model": start.get("model"),
           "budget": {k: (start.get("budget") or {}).get(k) for k in budget},
           "marft": marft_settings(start.get("credit") or None), "warm_start": start.get("warm_start"),
           "lora": start.get("lora"), "rollout_temperature": start.get("rollout_temperature")}
    return [f"{k} {ran[k]!r} (the plan's {want[k]!r})" for k in want if ran[k] != want[k]]


def adopt(run_dirs: list[Path], items: list[dict[str, Any]], model: str) -> dict[tuple[str, int], Path]:
    """Finished `marft-lg demo` runs (e.g. benchmarks/demo.py's) taken as planned runs they are the same as, so an
    arm the demo's defaults already ran is not run again: ``{(label, seed): run_dir}``. A run that is no planned
    run, or two runs for one, is a ValueError saying how it differs."""
    out: dict[tuple[str, int], Path] = {}
    for run_dir in run_dirs:
        start = _start_event(run_dir)
        diffs = {(i["label"], i["seed"]): _ran_as(start, i, model) for i in items}
        match = [key for key, d in diffs.items() if not d]
        if not match:
            near = min(diffs.items(), key=lambda kv: len(kv[1]), default=None)
            why = "" if near is None else f"; closest {near[0][0]} seed {near[0][1]}: it ran with " + ", ".join(near[1])
            raise ValueError(f"--adopt: {run_dir} is none of the planned runs{why}")
        if match[0] in out:
            raise ValueError(f"--adopt: {run_dir} and {out[match[0]]} are both {match[0][0]} seed {match[0][1]}")
        out[match[0]] = Path(run_dir)
    return out


# ------------------------------------------------------------------------------------------------ the results


def _above(ci: dict[str, Any] | None) -> bool:
    return bool(ci) and ci.get("low") is not None and ci["low"] > 0


def _below(ci: dict[str, Any] | None) -> bool:
    return bool(ci) and ci.get("high") is not None and ci["high"] < 0


def aggregate(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per label (arm and grid point), in first-seen order: seeds, promote count, mean gain, the worst seed, seeds
    whose task_completion CI is above 0, seeds significantly worse, strict accuracy (mean untuned -> tuned, seeds
    where it at least doubled), mean minutes and waste."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by.setdefault(r["label"], []).append(r)
    out = {}
    for name, rs in by.items():
        rs = sorted(rs, key=lambda r: r["seed"])
        gains = [(r["gain"] or {}).get("mean") for r in rs]
        known = [(g, r["seed"]) for g, r in zip(gains, rs, strict=True) if g is not None]
        worst = min(known) if known else None
        doubled = [r["seed"] for r in rs
                   if r["strict"]["tuned"] is not None and r["strict"]["untuned"] is not None
                   and r["strict"]["tuned"] >= 2 * r["strict"]["untuned"] and r["strict"]["tuned"] > 0]
        out[name] = {
            "arm": rs[0]["arm"], "settings": rs[0]["settings"], "seeds": [r["seed"] for r in rs],
            "promoted": sum(bool(r["promote"]) for r in rs),
            "mean_gain": _mean(gains),
            "worst_seed": None if worst is None else {"seed": worst[1], "gain": worst[0]},
            "task_completion_above_zero": [r["seed"] for r in rs if _above(r.get("task_completion"))],
            "worse": [r["seed"] for r in rs if _below(r.get("gain"))],
            "strict_untuned": _mean([r["strict"]["untuned"] for r in rs]),
            "strict_tuned": _mean([r["strict"]["tuned"] for r in rs]),
            "strict_doubled": doubled,
            "mean_minutes": _mean([r["minutes"] for r in rs]),
            "equal_groups_share": _mean([r["waste"]["equal_groups_share"] for r in rs]),
            "zero_advantage_share": _mean([r["waste"]["zero_advantage_share"] for r in rs]),
            "tokens_per_min": _mean([r["waste"]["tokens_per_min"] for r in rs]),
        }
    return out


def _f(v: Any, spec: str = ".3f") -> str:
    return "n/a" if v is None else format(v, spec)


def _ci_cell(ci: dict[str, Any] | None) -> str:
    from marft_lg.evaluation.stats import format_ci

    return format_ci(ci.get("mean"), ci.get("low"), ci.get("high")) if ci else "n/a"


def _worst(w: dict[str, Any]) -> str:
    return f"{w['gain']:+.3f} (seed {w['seed']})"


def _draws(ds: dict[str, Any]) -> str:
    return f"{ds['draws']} ({ds['short_iterations']})"


def _arm_cell(name: str, agg: dict[str, Any]) -> str:
    arm = agg["arm"] if agg["arm"] == "baseline" else f"+{agg['arm']}"
    extra = ", ".join(f"{k}={_fmt_value(v)}" for k, v in agg["settings"].items())
    return f"{arm} ({extra})" if extra else arm


def table(results: dict[str, Any]) -> str:
    """The Markdown tables docs/training.md and the README show: one row per arm (aggregate over its seeds), then
    one per run."""
    agg = results.get("aggregate") or aggregate(results.get("runs") or [])
    lines = [
        f"Budget `{results.get('budget')}`, measured at `{(results.get('commit') or 'n/a')[:7]}`.", "",
        "| arm | seeds | promote | mean gain | worst seed | task_completion CI > 0 | tuned worse | strict untuned -> "
        "tuned (doubled) | equal groups | zero advantage | tokens/min | minutes |",
        "|---|---|---:|---:|---|---|---|---|---:|---:|---:|---:|"]
    for name, a in agg.items():
        n = len(a["seeds"])
        worst = a["worst_seed"]
        lines.append(
            f"| {_arm_cell(name, a)} | {','.join(map(str, a['seeds']))} | {a['promoted']}/{n} | "
            f"{_f(a['mean_gain'], '+.3f')} | "
            f"{'n/a' if worst is None else _worst(worst)} | "
            f"{len(a['task_completion_above_zero'])}/{n} | {len(a['worse'])}/{n} | "
            f"{_f(a['strict_untuned'], '.2f')} -> {_f(a['strict_tuned'], '.2f')} ({len(a['strict_doubled'])}/{n}) | "
            f"{_f(a['equal_groups_share'], '.2f')} | {_f(a['zero_advantage_share'], '.2f')} | "
            f"{_f(a['tokens_per_min'], '.0f')} | {_f(a['mean_minutes'], '.1f')} |")
    lines += ["", "| run | seed | team reward gain, 95% CI | task_completion gain, 95% CI | strict untuned -> tuned | "
              "equal groups | dynamic sampling draws (short) | decision |", "|---|---:|---|---|---|---:|---|---|"]
    for r in results.get("runs") or []:
        g, tc, ds = r["gain"] or {}, r.get("task_completion"), r["waste"]["dynamic_sampling"]
        lines.append(
            f"| {r['label']} | {r['seed']} | {_ci_cell(g)} | "
            f"{_ci_cell(tc)} | "
            f"{_f(r['strict']['untuned'], '.2f')} -> {_f(r['strict']['tuned'], '.2f')} | "
            f"{_f(r['waste']['equal_groups_share'], '.2f')} | "
            f"{'-' if not ds else _draws(ds)} | "
            f"{'**promote**' if r['promote'] else 'reject'} |")
    return "\n".join(lines)


def _plan_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {"budget": args.budget, "model": args.model}


# -------------------------------------------------------------------------------------------------------- main


def _run_one(spec: str) -> int:
    """Child process: one demo run (`--run-one`, JSON of the plan item); the parent collects its run directory."""
    from rich.console import Console

    from marft_lg.demo import BUDGETS, DemoBudget, run_demo

    item = json.loads(spec)
    b = item["budget"]
    budget = DemoBudget(**{f.name: b[f.name] for f in dataclasses.fields(DemoBudget)})
    assert budget.name in BUDGETS
    run_demo(budget, Path(item["run_dir"]), model=item["model"], seed=item["seed"], trace_root=ROOT / "traces",
             console=Console(), credit=item["credit"], warm_start=item["warm_start"], lora=item.get("lora"),
             rollout_temperature=item.get("rollout_temperature"))
    return 0


def run_child(spec: dict[str, Any]) -> None:
    """One demo run in a child process of its own (its model, threads and memory gone when it ends)."""
    subprocess.run([sys.executable, str(Path(__file__).resolve()), "--run-one", json.dumps(spec)], check=True,
                   cwd=ROOT)


def _supersede(runs: list[dict[str, Any]], planned: set[tuple[str, int]], superseded: list[dict[str, Any]],
               commit: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(`runs` without the planned ones, `superseded` with them added, each saying what replaces it)."""
    kept = [r for r in runs if (r["label"], r["seed"]) not in planned]
    moved = [{"reason": f"re-run by `benchmarks/learn.py --append --replace` at {commit[:7]}", "run": r}
             for r in runs if (r["label"], r["seed"]) in planned]
    return kept, superseded + moved


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {list(ARMS)}")
    ap.add_argument("--grid", default=None, help="'key=v1,v2;key2=v1,...' crossed with every arm")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--budget", default="full", help="the demo budget: full, quick or smoke")
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--runs-root", type=Path, default=ROOT / "runs" / "learn")
    ap.add_argument("--append", action="store_true",
                    help="keep the runs already in --out (same budget and model); run only the missing ones")
    ap.add_argument("--replace", action="store_true",
                    help="with --append: run the planned runs the file already holds again; each older run moves to "
                         "`superseded` with the reason")
    ap.add_argument("--adopt", nargs="+", type=Path, default=[], metavar="RUN_DIR",
                    help="finished `marft-lg demo` runs to take as the planned runs they are the same as (same seed, "
                         "budget and settings), instead of running those")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    ap.add_argument("--table", action="store_true", help="print the Markdown table of --out and exit")
    ap.add_argument("--run-one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.run_one is not None:
        return _run_one(args.run_one)
    if args.table:
        if not args.out.is_file():
            ap.error(f"--table: {args.out} does not exist (run the benchmark first)")
        print(table(json.loads(args.out.read_text())))
        return 0
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        items = plan(arms, parse_grid(args.grid), seeds, args.budget, args.runs_root)
        adopted = adopt(args.adopt, items, args.model)
    except ValueError as exc:
        ap.error(str(exc))
    if args.dry_run:
        for item in items:
            key = (item["label"], item["seed"])
            print(describe(item) + (f" (adopted: {adopted[key]})" if key in adopted else ""))
        print(f"{len(items)} runs; results -> {args.out}")
        return 0

    from marft_lg._durable import write_atomic
    from marft_lg._provenance import code_state, machine

    out: dict[str, Any] = {**code_state(), "benchmark": "learn", "machine": machine(), "goal": GOAL,
                           **_plan_settings(args), "arms": {a: ARMS[a] for a in arms}, "grid": args.grid,
                           "seeds": seeds, "runs": [], "aggregate": {}}
    if args.append and args.out.is_file():
        before = json.loads(args.out.read_text())
        if {k: before.get(k) for k in _plan_settings(args)} != _plan_settings(args):
            ap.error(f"--append: {args.out} was measured with budget {before.get('budget')!r} and model "
                     f"{before.get('model')!r}")
        out["runs"] = [{**r, "commit": r.get("commit", before.get("commit"))} for r in before.get("runs", [])]
        out.update({k: v for k, v in before.items() if k not in out})  # superseded, reference_runs: kept as they are
        if args.replace:
            out["runs"], out["superseded"] = _supersede(out["runs"], {(i["label"], i["seed"]) for i in items},
                                                        list(out.get("superseded") or []), out["commit"])
    elif args.replace:
        ap.error("--replace needs --append (the file whose runs it replaces)")
    done = {(r["label"], r["seed"]) for r in out["runs"]}
    held = sorted(set(adopted) & done)
    if held:
        ap.error(f"--adopt: {args.out} already holds {held[0][0]} seed {held[0][1]}; add --replace to replace it")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for item in items:
        key = (item["label"], item["seed"])
        if key in done:
            continue
        if key in adopted:  # ran elsewhere: its own commit and host
            figures = collect(adopted[key])
            code = figures.get("code") or {}
            run = {"label": item["label"], "arm": item["arm"], "settings": item["settings"], **figures,
                   "commit": code.get("commit"), "machine": code.get("machine"), "adopted": True}
        else:
            run_dir = item["run_dir"]
            for owned in (run_dir, ROOT / "traces" / f"demo-{run_dir.name}"):  # a fresh run: nothing of an earlier one
                shutil.rmtree(owned, ignore_errors=True)
            kw = item["kwargs"]
            spec = {"budget": dataclasses.asdict(kw["budget"]), "run_dir": str(run_dir), "model": args.model,
                    "seed": item["seed"], "credit": kw["credit"], "warm_start": kw["warm_start"], "lora": kw["lora"],
                    "rollout_temperature": kw["rollout_temperature"]}
            run_child(spec)
            run = {"label": item["label"], "arm": item["arm"], "settings": item["settings"], **collect(run_dir),
                   "commit": out["commit"], "machine": machine()}  # --append mixes hosts: each run names its own
        out["runs"].append(run)
        out["aggregate"] = aggregate(out["runs"])
        write_atomic(args.out, json.dumps(out, indent=2, default=str) + "\n")
        g = run["gain"] or {}
        print(json.dumps({"label": run["label"], "seed": run["seed"], "minutes": run["minutes"],
                          "gain": g.get("mean"), "low": g.get("low"), "high": g.get("high"),
                          "promote": run["promote"]}), flush=True)
    out["aggregate"] = aggregate(out["runs"])
    write_atomic(args.out, json.dumps(out, indent=2, default=str) + "\n")
    print(table(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
