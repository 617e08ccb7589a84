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


_ANSWER_ROLES = frozenset({"ai", "assistant", "tool", "function"})


def _opening(messages: Any) -> Any:
    """A chat state's messages as the run was given them: those before the first answer (AI or tool message)."""
    if not isinstance(messages, list):
        return messages
    out = []
    for m in messages:
        role = (m.get("type") or m.get("role")) if isinstance(m, dict) else None
        if role in _ANSWER_ROLES:
            break
        out.append(m)
    return out or messages


def scenarios_from_dataset(
    dataset: TrajectoryDataset,
    input_keys: Sequence[str],
    *,
    reference_key: str | None = None,
    require_feedback: str | None = None,
    n: int | None = None,
    seed: int = 0,
    split: str = "eval",
    heldout: float | None = None,
) -> ScenarioSet:
    """Distinct inputs of successful episodes as scenarios (a seeded sample of `n` when given).

    `input_keys` pick the graph inputs out of each episode's final state (a chat state's `messages`: the user's
    opening turn, up to the first answer); `reference_key` copies a state key as the reference answer;
    `require_feedback` keeps only episodes whose feedback of that name is positive. Episodes without a recorded
    outcome are skipped (and counted in the log). `heldout` (a share in (0, 1)): each input goes to split
    ``eval`` or ``train`` by a hash of the input itself, so the split is stable as traffic grows and an input is
    never on both sides; without it every scenario gets `split`.
    """
    if heldout is not None and not 0.0 < float(heldout) < 1.0:
        raise ValueError(f"heldout must be a share in (0, 1), got {heldout!r}")
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
        inputs = {k: _opening(state[k]) if k == "messages" else state[k] for k in input_keys}
        key = json.dumps(inputs, sort_keys=True, ensure_ascii=False, default=str)
        if key in seen:
            continue
        digest = hashlib.sha256(key.encode()).hexdigest()
        sid = "trace-" + digest[:12]
        side = split if heldout is None else ("eval" if int(digest[12:20], 16) / 2**32 < float(heldout) else "train")
        seen[key] = Scenario(sid, inputs, reference=state.get(reference_key) if reference_key else None, split=side,
                             meta={"source_episode": row["episode_id"]})
    if any(skipped.values()):
        logger.info("scenarios from traces: skipped episodes %s", skipped)
    items = sorted(seen.values(), key=lambda s: s.scenario_id)
    if n is not None and n < len(items):
        items = sorted(random.Random(seed).sample(items, n), key=lambda s: s.scenario_id)
    return ScenarioSet(items)
