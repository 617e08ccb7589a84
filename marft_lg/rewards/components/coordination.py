"""Coordination components: HandoffLoopRate catches two agents passing control back and forth."""

from __future__ import annotations

from dataclasses import dataclass

from marft_lg.rewards.base import ComponentScore, RewardComponent
from marft_lg.rewards.registry import register_component
from marft_lg.trajectories.dataset import Episode


def handoff_loops(agents_in_order: list[tuple[str, int]], max_passes: int = 2) -> list[list[int]]:
    """Ping-pong loops: for each stretch where two agents alternate with more than `max_passes`
    hand-offs, the orders of the actions that received the excess hand-offs.

    `agents_in_order` is ``[(agent, order), ...]``; consecutive actions by one agent are one turn.
    """
    turns: list[tuple[str, int]] = []
    for agent, order in agents_in_order:
        if not turns or turns[-1][0] != agent:
            turns.append((agent, order))
    loops: list[list[int]] = []
    start = 0
    for i in range(1, len(turns) + 1):
        alternating = i < len(turns) and (i - start < 2 or turns[i][0] == turns[i - 2][0])
        if not alternating:
            passes = i - start - 1
            if passes > max_passes:
                loops.append([order for _, order in turns[start + max_passes + 1:i]])
            start = i - 1
    return loops


@register_component("handoff_loop_rate")
@dataclass
class HandoffLoopRate(RewardComponent):
    """1.0 when two agents pass control back and forth more than `max_passes` times in a row, else 0.0.

    Averaged over episodes this is the handoff-loop rate; weight it negatively. The penalty is
    shared among the actions that received the excess hand-offs.
    """

    name = "handoff_loop_rate"
    range = (0.0, 1.0)

    max_passes: int = 2

    def __call__(self, episode: Episode) -> ComponentScore:
        loops = handoff_loops([(a["agent"], int(a["order"])) for a in episode.actions], self.max_passes)
        if not loops:
            return ComponentScore(0.0)
        orders = [o for loop in loops for o in loop]
        return ComponentScore(1.0, {o: 1.0 / len(orders) for o in orders})
