"""Frozen scenario sets built from mined traces: a reproducible sample of real inputs.

A wrapped LangGraph run records its final state as the episode `outcome`; the input keys of that
state (e.g. ``question``) are what the graph was invoked with, so they become the scenario inputs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from collections.abc import Sequence
from typing import Any

from marft_lg.trajectories.dataset import TrajectoryDataset
from marft_lg.trajectories.scenarios import Scenario, ScenarioSet

logger = logging.getLogger("marft_lg.evaluation")


def _outcome(value: Any) -> dict[str, Any] | None:
    if isinstance(value, dict):
        return value
    if isinstance(value, str):
        try:
            data = json.loads(value)
        except json.JSONDecodeError:
            return None
        return data if isinstance(data, dict) else None
    return None


def scenarios_from_dataset(
    dataset: TrajectoryDataset,
    input_keys: Sequence[str],
    *,
    reference_key: str | None = None,
    require_feedback: str | None = None,
    n: int | None = None,
    seed: int = 0,
    split: str = "eval",
) -> ScenarioSet:
    """Distinct inputs of successful episodes as scenarios (a seeded sample of `n` when given).

    `input_keys` pick the graph inputs out of each episode's final state; `reference_key` copies
    a state key as the reference answer; `require_feedback` keeps only episodes whose feedback of
    that name is positive. Episodes without a recorded outcome are skipped (and counted in the log).
    """
    if not input_keys:
        raise ValueError("input_keys must name at least one key of the graph's input, e.g. ['question']")
    seen: dict[str, Scenario] = {}
    skipped = {"status": 0, "no_outcome": 0, "missing_keys": 0, "feedback": 0}
    for row in dataset.episodes.to_dict("records"):
        if row.get("status") not in (None, "ok"):
            skipped["status"] += 1
            continue
        if require_feedback is not None:
            value = (row.get("feedback") or {}).get(require_feedback)
            if not (isinstance(value, int | float) and value > 0) and value is not True:
                skipped["feedback"] += 1
                continue
        state = _outcome(row.get("outcome"))
        if state is None:
            skipped["no_outcome"] += 1
            continue
        if any(k not in state for k in input_keys):
            skipped["missing_keys"] += 1
            continue
        inputs = {k: state[k] for k in input_keys}
        key = json.dumps(inputs, sort_keys=True, ensure_ascii=False, default=str)
        if key in seen:
            continue
        sid = "trace-" + hashlib.sha256(key.encode()).hexdigest()[:12]
        seen[key] = Scenario(sid, inputs, reference=state.get(reference_key) if reference_key else None, split=split,
                             meta={"source_episode": row["episode_id"]})
    if any(skipped.values()):
        logger.info("scenarios from traces: skipped episodes %s", skipped)
    items = sorted(seen.values(), key=lambda s: s.scenario_id)
    if n is not None and n < len(items):
        items = sorted(random.Random(seed).sample(items, n), key=lambda s: s.scenario_id)
    return ScenarioSet(items)
