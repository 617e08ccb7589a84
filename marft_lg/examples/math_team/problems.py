"""Arithmetic word problems with exact integer answers, generated from a seed (train / held-out splits).

Problems are one or two steps with small numbers, so a 135M instruct model solves some of them
untuned and reinforcement has signal to work with. Each problem also names its set-up as
checkpoints (the operands joined by the right operator, e.g. ``9 - 3``), which the reward's
`goal_progress` term credits to the agent that first writes it (in practice the reasoner).
"""

from __future__ import annotations

import random

from marft_lg.trajectories.scenarios import Scenario, ScenarioSet

_NAMES = ["Tom", "Ana", "Li", "Sara", "Ben", "Mia", "Omar", "Zoe"]
_THINGS = ["apples", "books", "coins", "pens", "stickers", "marbles", "cards", "shells"]


def _op(x: int, sign: str, y: int) -> str:
    """A checkpoint regex for `x sign y` as written (`*` also as x or ×), operands in either order for + and *."""
    signs = {"+": r"\+", "-": "-", "*": r"[*x×]"}[sign]
    pairs = [(x, y), (y, x)] if sign in "+*" else [(x, y)]
    return "re:" + "|".join(rf"(?<!\d){p}\s*{signs}\s*{q}(?!\d)" for p, q in pairs)


def _one(rng: random.Random) -> tuple[str, int, list[str]]:
    name, thing = rng.choice(_NAMES), rng.choice(_THINGS)
    a, b = rng.randint(2, 9), rng.randint(1, 9)
    kind = rng.choice(["add", "sub", "mul", "add2"])
    if kind == "add":
        return (f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?", a + b,
                [_op(a, "+", b)])
    if kind == "sub":
        a = a + b
        return f"{name} has {a} {thing} and gives away {b}. How many {thing} are left?", a - b, [_op(a, "-", b)]
    if kind == "mul":
        return (f"{name} has {a} bags with {b} {thing} in each bag. How many {thing} are there in total?", a * b,
                [_op(a, "*", b)])
    c = rng.randint(1, 5)
    return (f"{name} has {a} {thing}, gets {b} more, then loses {c}. How many {thing} does {name} have?",
            a + b - c, [_op(a, "+", b), _op(a + b, "-", c)])


def make_problems(n_train: int = 32, n_heldout: int = 32, seed: int = 0) -> ScenarioSet:
    """`n_train` + `n_heldout` distinct problems; same seed, same problems."""
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[Scenario] = []
    while len(out) < n_train + n_heldout:
        question, answer, checkpoints = _one(rng)
        if question in seen:
            continue
        seen.add(question)
        split = "train" if len(out) < n_train else "heldout"
        out.append(Scenario(scenario_id=f"math-{split}-{len(out):04d}", inputs={"question": question},
                            reference=str(answer), checkpoints=checkpoints, split=split))
    return ScenarioSet(out)
