"""The dual LaMAS of the MARFT paper (App. B.3) as a LangGraph app: reasoner -> actor.

The profiles are the paper's, in chat form: the reasoner guides, the actor computes and answers
inside \\boxed{}. `build_graph(llm)` takes any LangChain chat model (e.g. `TeamChatModel`, which
routes each node to its agent's adapter).
"""

from __future__ import annotations

from typing import Any, TypedDict

from langchain_core.messages import HumanMessage, SystemMessage
from langgraph.graph import END, START, StateGraph

REASONER_PROFILE = (
    "Two LLM agents (Reasoner -> Actor) collaborate step-by-step to solve math problems. You are the "
    "**Reasoner**: Analyze the original problem, historical actions, and reflection data (if provided) to "
    "determine the critical next step. Guide the Actor by providing concise reasoning for the optimal operation."
)
ACTOR_PROFILE = (
    "Two LLM agents (Reasoner -> Actor) collaborate step-by-step. You are the **Actor**: Execute operations "
    "using the original problem, action history, and Reasoner's guidance. Provide final answer within \\boxed{}."
)
ROLES = ["reasoner", "actor"]


class MathState(TypedDict, total=False):
    question: str
    reasoning: str
    answer: str


def build_graph(llm: Any):
    """Compile the reasoner -> actor graph over `llm` (nodes are named after their agent roles)."""

    def reasoner(state: MathState) -> dict[str, str]:
        msg = llm.invoke([SystemMessage(REASONER_PROFILE), HumanMessage(f"Problem: {state['question']}")])
        return {"reasoning": str(msg.content)}

    def actor(state: MathState) -> dict[str, str]:
        msg = llm.invoke([SystemMessage(ACTOR_PROFILE),
                          HumanMessage(f"Problem: {state['question']}\nReasoner: {state['reasoning']}")])
        return {"answer": str(msg.content)}

    g = StateGraph(MathState)
    g.add_node("reasoner", reasoner)
    g.add_node("actor", actor)
    g.add_edge(START, "reasoner")
    g.add_edge("reasoner", "actor")
    g.add_edge("actor", END)
    return g.compile()
