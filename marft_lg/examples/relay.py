"""A relay team for blame checks: a messenger reads a secret word and tells it to a recorder, who writes it down.

The untuned 135M model runs it well, and either agent can break an episode on its own, so when one agent's adapter
is broken the blame report (`marft-lg attribute`, `evaluation.attribution`) should name that agent. Used by
tests/integration/test_credit_real.py and benchmarks/blame.py.
"""

from __future__ import annotations

from typing import Any, TypedDict

from marft_lg.rewards.composite import CompositeReward
from marft_lg.trajectories.scenarios import Scenario

ROLES = ["messenger", "recorder"]
WORDS = ["river", "castle", "pencil", "garden", "rocket", "violin", "tomato", "bridge", "candle", "forest",
         "mirror", "pepper"]

REWARD_CONFIG = {  # 1 when the recorder's note contains the secret word
    "weights": {"task_completion": 1.0},
    "components": {"task_completion": {"match": "contains"}},
    "credit": "terminal",
    "answer_agents": ["recorder"],
}


class RelayState(TypedDict, total=False):
    word: str
    note: str
    answer: str


def build_graph(llm: Any):
    """Compile messenger -> recorder over `llm` (nodes named after their roles)."""
    from langchain_core.messages import HumanMessage, SystemMessage
    from langgraph.graph import END, START, StateGraph

    def messenger(state: RelayState) -> dict[str, str]:
        text = llm.invoke([SystemMessage("Repeat the secret word to your teammate in one short sentence."),
                           HumanMessage(f"The secret word is {state['word']}.")]).content
        return {"note": str(text)}

    def recorder(state: RelayState) -> dict[str, str]:
        text = llm.invoke([SystemMessage("Your teammate told you a secret word. Write only that word."),
                           HumanMessage(f"Teammate: {state['note']}")]).content
        return {"answer": str(text)}

    g = StateGraph(RelayState)
    g.add_node("messenger", messenger)
    g.add_node("recorder", recorder)
    g.add_edge(START, "messenger")
    g.add_edge("messenger", "recorder")
    g.add_edge("recorder", END)
    return g.compile()


def relay_scenarios(n: int = len(WORDS)) -> list[Scenario]:
    """The first `n` secret words as scenarios (reference: the word)."""
    if not 1 <= n <= len(WORDS):
        raise ValueError(f"n={n}: between 1 and {len(WORDS)} secret words")
    return [Scenario(f"w{i}", {"word": w}, reference=w) for i, w in enumerate(WORDS[:n])]


def relay_reward() -> CompositeReward:
    return CompositeReward.from_yaml(REWARD_CONFIG)
