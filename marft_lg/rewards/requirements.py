"""What a reward needs from the episodes it scores, checked before any work is spent on them.

A component may declare it with a `needs()` method returning some of: ``reference`` (a reference answer per
scenario), ``feedback`` (a value users record after the run), ``resume`` (a person's answer at an `interrupt()`).
`uncomputable` names the weighted components that can never be computed on the episodes at hand: fresh episodes
(on-policy training, a comparison) never get after-the-fact feedback, scenarios without references (users' inputs
from traces) give `task_completion` nothing to match, and an app's interrupts are only answered by a resume policy.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

REFERENCE, FEEDBACK, RESUME = "reference", "feedback", "resume"

_STAND_INS = ("a judge (group_judge, trajectory_score with judge:), interrupt_feedback with a resume policy that "
              "stands in for the user (a simulated approver), or checks that need no answer (format, tools)")


def reward_needs(reward: Any) -> dict[str, set[str]]:
    """``{component name: what it needs}`` of `reward`'s weighted components that declare needs."""
    components = getattr(reward, "components", None)
    weights = getattr(reward, "weights", None)
    if not isinstance(components, Mapping):  # a plain callable or another Scorer: nothing declared
        return {}
    weights = weights if isinstance(weights, Mapping) else {}
    out: dict[str, set[str]] = {}
    for name, comp in components.items():
        needs = getattr(comp, "needs", None)
        if callable(needs) and float(weights.get(name, 1.0)) != 0.0:
            wanted = set(needs())
            if wanted:
                out[name] = wanted
    return out


def uncomputable(reward: Any, *, scenarios: Iterable[Any] | None = None, fresh: bool = False,
                 resumes: bool | None = None) -> list[str]:
    """Why `reward` can never be computed on the episodes at hand (empty: it can).

    `scenarios`: the scenarios the episodes run (None: not known); `fresh`: the episodes are new runs (on-policy,
    comparison), so no user will have given feedback on them; `resumes`: whether the runner answers interrupts
    (None: not known)."""
    problems = []
    items = list(scenarios) if scenarios is not None else None
    for name, needs in reward_needs(reward).items():
        if REFERENCE in needs and items is not None and items and all(
                getattr(s, "reference", None) is None for s in items):
            problems.append(f"{name} needs a reference answer and none of the {len(items)} scenarios has one "
                            f"(users' inputs carry none): score them with {_STAND_INS}")
        if FEEDBACK in needs and fresh:
            problems.append(f"{name} is what users record after a run; the new episodes of on-policy training or "
                            f"a comparison never get it: use {_STAND_INS}, or give {name} a default")
        if RESUME in needs and fresh and resumes is False:
            problems.append(f"{name} scores the answer given at the app's interrupt(); nothing answers it in these "
                            "runs: give a resume policy (train.yaml online.resume, job.yaml resume, "
                            "wrap(..., resume=)) that stands in for the user")
    return problems


def signal_counts(reward: Any, table: Any) -> dict[str, dict[str, int]]:
    """``{component: {"scored": n, "episodes": N}}``: how many episodes each weighted component of `reward` scored
    in a `RewardResult.episodes` table (a failed or missing signal is NaN there), so a report can say which signals
    the reward really rested on."""
    weights = getattr(reward, "weights", None)
    weights = weights if isinstance(weights, Mapping) else {}
    total = len(table)
    out = {}
    for name, w in weights.items():
        if float(w) == 0.0:
            continue
        scored = int(table[name].notna().sum()) if name in getattr(table, "columns", ()) else 0
        out[name] = {"scored": scored, "episodes": total}
    return out
