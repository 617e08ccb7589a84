"""Placement (credit): turn an episode's weighted component scores into a per-action reward vector.

``credit="terminal"``: the whole reward sits on the terminal action — the last action of an
answer agent (the paper's `with_answer`), else the last action. ``credit="shaped"``: each
component's per-action attributions (times its weight) sit on the actions they name, and only the
unattributed rest of its value goes on the terminal action. Either way the vector sums to the
episode's reward, so shaping moves credit in time without changing the return before discounting.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from marft_lg.rewards.base import ComponentScore

CREDIT_MODES = ("terminal", "shaped")


def place_rewards(
    orders: Sequence[int],
    scores: Mapping[str, ComponentScore],
    weights: Mapping[str, float],
    *,
    credit: str,
    terminal_order: int | None,
    veto: tuple[float, int | None] | None = None,
) -> np.ndarray:
    """Per-action rewards in `orders` order (float64).

    `veto` is ``(veto_reward, order_of_first_offence)``: the episode's reward becomes
    `veto_reward`, placed on the offending action (shaped) or the terminal action (terminal).
    """
    if credit not in CREDIT_MODES:
        raise ValueError(f"credit must be one of {list(CREDIT_MODES)}, got {credit!r}")
    out = np.zeros(len(orders), dtype=np.float64)
    if not len(orders):
        return out
    index = {int(o): i for i, o in enumerate(orders)}
    terminal = index[terminal_order] if terminal_order is not None else len(orders) - 1
    if veto is not None:
        reward, offender = veto
        at = index[offender] if credit == "shaped" and offender is not None else terminal
        out[at] = reward
        return out
    for name, score in scores.items():
        w = float(weights[name])
        if w == 0.0:
            continue
        if credit == "terminal":
            out[terminal] += w * score.value
            continue
        attributed = 0.0
        for order, v in score.per_action.items():
            out[index[int(order)]] += w * v
            attributed += v
        out[terminal] += w * (score.value - attributed)
    return out
