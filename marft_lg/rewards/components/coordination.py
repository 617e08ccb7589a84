"""Coordination components: HandoffLoopRate catches two agents passing control back and forth without progress.

`handoff_loops` is the one definition of a handoff loop; the reward component here and the `handoff_loops`
agent and episode metrics of the shadow comparison (`marft_lg.evaluation.agent_metrics`) both use it.

The rule (the playbook's "two agents pass control back and forth more than twice", made exact):

- consecutive actions by one agent are one **turn**; each change of agent is a **hand-off**;
- an action makes **progress** when one of its tool calls succeeded (recorded without an error), or when
  its completion is non-empty and new to the episode (no earlier completion has the same text, ignoring case
  and whitespace); a turn makes progress when one of its actions does;
- a **loop** is a run of more than `max_passes` consecutive hand-offs between the same two agents in which
  every hand-off after the first comes from a turn that made no progress; the turns that receive the
  hand-offs beyond the `max_passes`-th are the loop's **excess**.

So a supervisor dispatching to worker A, then B, then A again is no loop (each pair has two hand-offs), and
neither is a critic and a writer revising back and forth while the drafts change; the same two agents
bouncing an empty or repeated message is.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from marft_lg.rewards.base import ComponentScore, RewardComponent, action_list
from marft_lg.rewards.registry import register_component
from marft_lg.trajectories.dataset import Episode


def _text_key(completion: Any) -> str:
    return " ".join(str(completion).split()).casefold() if isinstance(completion, str) else ""


def _made_progress(action: Mapping[str, Any], seen: set[str]) -> bool:
    """Whether `action` made progress (see the module docstring); adds its completion to `seen`."""
    tool_ok = any(isinstance(tc, Mapping) and not tc.get("error") for tc in action_list(action.get("tool_calls")))
    text = _text_key(action.get("completion"))
    new_text = bool(text) and text not in seen
    if text:
        seen.add(text)
    return tool_ok or new_text


def handoff_loops(actions: Iterable[Mapping[str, Any]], max_passes: int = 2) -> list[list[int]]:
    """The handoff loops of one episode: for each loop, the `order`s of the actions that received its excess
    hand-offs (the first action of each receiving turn). Empty when there is none.

    `actions` are action rows (`agent`, `order`, and `completion` / `tool_calls` for progress), in any order.
    """
    turns: list[list[Any]] = []  # [agent, order of its first action, made progress]
    seen: set[str] = set()
    for a in sorted(actions, key=lambda a: int(a["order"])):
        progressed = _made_progress(a, seen)
        agent = a.get("agent")
        if turns and turns[-1][0] == agent:
            turns[-1][2] = turns[-1][2] or progressed
        else:
            turns.append([agent, int(a["order"]), progressed])
    loops: list[list[int]] = []
    current: list[int] = []
    pair: frozenset | None = None
    passes = 0
    for sender, receiver in zip(turns, turns[1:], strict=False):
        this_pair = frozenset((sender[0], receiver[0]))
        if this_pair == pair and not sender[2]:
            passes += 1
        else:
            if current:
                loops.append(current)
                current = []
            pair, passes = this_pair, 1
        if passes > max_passes:
            current.append(receiver[1])
    if current:
        loops.append(current)
    return loops


@register_component("handoff_loop_rate")
@dataclass
class HandoffLoopRate(RewardComponent):
    """1.0 when the episode has a handoff loop (two agents passing control back and forth more than
    `max_passes` times in a row without progress; see `handoff_loops`), else 0.0.

    Averaged over episodes this is the handoff-loop rate; weight it negatively. The penalty is
    shared among the actions that received the excess hand-offs.
    """

    name = "handoff_loop_rate"
    range = (0.0, 1.0)

    max_passes: int = 2

    def __call__(self, episode: Episode) -> ComponentScore:
        loops = handoff_loops(episode.actions, self.max_passes)
        if not loops:
            return ComponentScore(0.0)
        orders = [o for loop in loops for o in loop]
        return ComponentScore(1.0, {o: 1.0 / len(orders) for o in orders})
