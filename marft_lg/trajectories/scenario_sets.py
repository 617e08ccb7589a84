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
from pathlib import Path
from typing import Any

from marft_lg._config import unknown_keys
from marft_lg.trajectories.dataset import TrajectoryDataset
from marft_lg.trajectories.scenarios import Scenario, ScenarioSet

logger = logging.getLogger("marft_lg.trajectories")


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


def _input_of(state: dict[str, Any], input_keys: Sequence[str]) -> tuple[dict[str, Any], str, str] | None:
    """(the run's inputs, their canonical JSON, its sha256) from a final state; None when a key is missing."""
    if any(k not in state for k in input_keys):
        return None
    inputs = {k: _opening(state[k]) if k == "messages" else state[k] for k in input_keys}
    key = json.dumps(inputs, sort_keys=True, ensure_ascii=False, default=str)
    return inputs, key, hashlib.sha256(key.encode()).hexdigest()


def label_with_inputs(dataset: TrajectoryDataset, input_keys: Sequence[str]) -> tuple[TrajectoryDataset, int]:
    """`dataset` with each episode that has no scenario given the id of its input's `scenarios_from_dataset`
    scenario (``trace-<hash>``), so the episodes of one question asked several times form one group (a group-relative
    baseline, the warm start's best of group) instead of groups of one; returns it and how many were labelled."""
    episodes = dataset.episodes.copy()
    labelled = 0
    ids = list(episodes["scenario_id"])
    for i, (sid, outcome) in enumerate(zip(ids, episodes["outcome"], strict=True)):
        if sid is not None and not (isinstance(sid, float) and sid != sid):
            continue
        state = _outcome(outcome)
        found = _input_of(state, input_keys) if state is not None else None
        if found is not None:
            ids[i] = "trace-" + found[2][:12]
            labelled += 1
    episodes["scenario_id"] = ids
    return TrajectoryDataset(episodes=episodes, actions=dataset.actions), labelled


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
    ``heldout`` or ``train`` by a hash of the input itself, so the split is stable as traffic grows and an input is
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
        found = _input_of(state, input_keys)
        if found is None:
            skipped["missing_keys"] += 1
            continue
        inputs, key, digest = found
        if key in seen:
            continue
        sid = "trace-" + digest[:12]
        side = split if heldout is None else ("heldout" if int(digest[12:20], 16) / 2**32 < float(heldout) else "train")
        seen[key] = Scenario(sid, inputs, reference=state.get(reference_key) if reference_key else None, split=side,
                             meta={"source_episode": row["episode_id"]})
    if any(skipped.values()):
        logger.info("scenarios from traces: skipped episodes %s", skipped)
    items = sorted(seen.values(), key=lambda s: s.scenario_id)
    if n is not None and n < len(items):
        items = sorted(random.Random(seed).sample(items, n), key=lambda s: s.scenario_id)
    return ScenarioSet(items)


FROM_TRACES_KEYS = ("from_traces", "input_keys", "heldout", "n", "seed", "reference_key", "require_feedback")


def check_scenario_source(spec: Any, where: str = "scenarios") -> Any:
    """A scenario source as a config gives it: a scenario file (str), or ``{from_traces: DIR, input_keys: [...],
    heldout: 0.2, n: null, seed: 0, reference_key: null, require_feedback: null}`` (users' inputs from mined
    traces). Returns it checked; errors are ValueErrors naming `where` and the key."""
    if spec is None or isinstance(spec, str):
        return spec
    if not isinstance(spec, dict):
        raise ValueError(f"{where}: a scenario file, or {{from_traces: DIR, input_keys: [...]}}; got "
                         f"{type(spec).__name__}")
    unknown = unknown_keys(spec, FROM_TRACES_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; from_traces takes {list(FROM_TRACES_KEYS)}")
    if not isinstance(spec.get("from_traces"), str) or not spec["from_traces"]:
        raise ValueError(f"{where}.from_traces: the trace folder (or `marft-lg mine --out` folder) whose users' "
                         "inputs become the scenarios")
    keys = spec.get("input_keys")
    if not isinstance(keys, list) or not keys or not all(isinstance(k, str) and k for k in keys):
        raise ValueError(f"{where}.input_keys: the graph's input keys, e.g. [question] or [messages]")
    heldout = spec.get("heldout", 0.2)
    if heldout is not None and (isinstance(heldout, bool) or not isinstance(heldout, int | float)
                                or not 0 < heldout < 1):
        raise ValueError(f"{where}.heldout: a share in (0, 1) held out as split heldout, got {heldout!r}")
    for key in ("n", "seed"):
        v = spec.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < (1 if key == "n" else 0)):
            raise ValueError(f"{where}.{key}: an int >= {1 if key == 'n' else 0}, got {v!r}")
    return spec


def load_scenarios(spec: Any, *, base_dir: str | Path | None = None, max_line_bytes: int | None = None) -> ScenarioSet:
    """The scenarios a `check_scenario_source` spec names: the file read, or the users' inputs of the traces'
    successful episodes (no references: rewards that need none, a judge or the users' feedback, score them)."""
    spec = check_scenario_source(spec)
    if spec is None:
        raise ValueError("no scenarios given")
    base = Path(base_dir) if base_dir is not None else Path(".")
    if isinstance(spec, str):
        return ScenarioSet.load(base / spec)
    source = base / spec["from_traces"]
    if not source.exists():
        raise ValueError(f"scenarios.from_traces: {source} does not exist")
    if source.is_dir() and (source / "episodes.parquet").exists():
        dataset = TrajectoryDataset.from_parquet(source)
    else:
        from marft_lg.trajectories.mining import mine

        dataset = mine([source], **({} if max_line_bytes is None else {"max_line_bytes": max_line_bytes}))
    out = scenarios_from_dataset(dataset, spec["input_keys"], reference_key=spec.get("reference_key"),
                                 require_feedback=spec.get("require_feedback"), n=spec.get("n"),
                                 seed=spec.get("seed") or 0, heldout=spec.get("heldout", 0.2))
    if not len(out):
        raise ValueError(f"scenarios.from_traces: no successful episode under {source} has the inputs "
                         f"{spec['input_keys']} in its final state ({len(dataset)} episode(s) read)")
    return out
