r"""The math team's answer accuracy, strict and lenient, separate from its composite reward.

strict: the actor's last answer holds a \boxed{N} whose content equals the reference (the format the
team is taught). lenient: the last number the actor wrote equals the reference, boxed or not (what
an untuned model that ignores the format still gets right). The reward mixes the two rules
(\boxed{} content, else the last number); reporting both shows whether a gain is format or arithmetic.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from marft_lg.rewards.answers import extract_boxed, last_number, to_number
from marft_lg.trajectories.dataset import TrajectoryDataset
from marft_lg.trajectories.scenarios import Scenario


def _equal(answer: str | None, reference: str) -> bool:
    """Equal as numbers when both are numbers (``7.0`` = ``7``), else as stripped text."""
    if answer is None:
        return False
    a, r = to_number(answer), to_number(reference)
    if a is not None and r is not None:
        return a == r
    return answer.strip() == reference.strip()


def answer_checks(text: str, reference: str) -> tuple[bool, bool]:
    r"""(strict, lenient) for one answer: \boxed{} content equals `reference`; the last number does."""
    return _equal(extract_boxed(text), reference), _equal(last_number(text), reference)


def _references(scenarios: Iterable[Scenario] | Mapping[str, Any]) -> dict[str, str]:
    """scenario id -> reference, from Scenario objects or a ``{id: {"reference": ...}}`` map."""
    if isinstance(scenarios, Mapping):
        items = [(sid, s.get("reference") if isinstance(s, Mapping) else getattr(s, "reference", None))
                 for sid, s in scenarios.items()]
    else:
        items = [(s.scenario_id, s.reference) for s in scenarios]
    return {str(sid): str(ref) for sid, ref in items if ref is not None}


def answer_accuracy(dataset: TrajectoryDataset, scenarios: Iterable[Scenario] | Mapping[str, Any], *,
                    agent: str = "actor") -> dict[str, float | int | None]:
    """``{"strict", "lenient", "n"}`` over the dataset's episodes whose scenario has a reference.

    The answer is `agent`'s last action in the episode; an episode where it never acted (a failed
    run) counts as wrong on both. The rates are None when no episode has a reference (n = 0).
    """
    refs = _references(scenarios)
    acts = dataset.actions
    last = acts[acts["agent"] == agent].groupby("episode_id", sort=False)["completion"].last()
    strict = lenient = n = 0
    for eid, sid in zip(dataset.episodes["episode_id"], dataset.episodes["scenario_id"], strict=True):
        ref = refs.get(str(sid))
        if ref is None:
            continue
        n += 1
        text = last.get(eid)
        if isinstance(text, str):
            s, m = answer_checks(text, ref)
            strict, lenient = strict + s, lenient + m
    return {"strict": strict / n if n else None, "lenient": lenient / n if n else None, "n": n}
