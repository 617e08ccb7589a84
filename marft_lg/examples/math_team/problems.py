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


def _one(rng: random.Random) -> tuple[str, int, list[str], tuple]:
    """(question, answer, checkpoints, arithmetic): the arithmetic is what a problem computes, names aside."""
    name, thing = rng.choice(_NAMES), rng.choice(_THINGS)
    a, b = rng.randint(2, 9), rng.randint(1, 9)
    kind = rng.choice(["add", "sub", "mul", "add2"])
    if kind == "add":
        return (f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?", a + b,
                [_op(a, "+", b)], ("+", min(a, b), max(a, b)))
    if kind == "sub":
        a = a + b
        return (f"{name} has {a} {thing} and gives away {b}. How many {thing} are left?", a - b, [_op(a, "-", b)],
                ("-", a, b))
    if kind == "mul":
        return (f"{name} has {a} bags with {b} {thing} in each bag. How many {thing} are there in total?", a * b,
                [_op(a, "*", b)], ("*", min(a, b), max(a, b)))
    c = rng.randint(1, 5)
    return (f"{name} has {a} {thing}, gets {b} more, then loses {c}. How many {thing} does {name} have?",
            a + b - c, [_op(a, "+", b), _op(a + b, "-", c)], ("+-", min(a, b), max(a, b), c))


def make_problems(n_train: int = 32, n_heldout: int = 32, seed: int = 0) -> ScenarioSet:
    """`n_train` + `n_heldout` distinct problems; same seed, same problems.

    No held-out problem computes what a training problem does (same operands and operators under
    other names would be a memorised answer, not a solved problem), and held-out problems differ
    from each other in their arithmetic too. A ValueError says when the arithmetic runs out.
    """
    rng = random.Random(seed)
    seen: set[str] = set()
    trained: set[tuple] = set()
    held: set[tuple] = set()
    out: list[Scenario] = []
    tries = 0
    while len(out) < n_train + n_heldout:
        tries += 1
        if tries > 100 * (n_train + n_heldout) + 10_000:
            raise ValueError(f"cannot make {n_heldout} held-out problems whose arithmetic differs from the "
                             f"{n_train} training problems' (found {len(out) - n_train}); ask for fewer")
        question, answer, checkpoints, arithmetic = _one(rng)
        if question in seen:
            continue
        split = "train" if len(out) < n_train else "heldout"
        if split == "heldout":
            if arithmetic in trained or arithmetic in held:
                continue
            held.add(arithmetic)
        else:
            trained.add(arithmetic)
        seen.add(question)
        out.append(Scenario(scenario_id=f"math-{split}-{len(out):04d}", inputs={"question": question},
                            reference=str(answer), checkpoints=checkpoints, split=split))
    return ScenarioSet(out)
