"""The dual LaMAS of the MARFT paper (App. B.3) as a LangGraph app: reasoner -> actor.

The profiles are the paper's, in chat form: the reasoner guides, the actor computes and answers
inside \\boxed{}. Each profile is followed by worked example turns: the 135M model never writes
\\boxed{} when only told to (0 of 32 sampled answers), but copies the format it has been shown
(~0.8 of greedy answers), which gives reinforcement a reward that varies between samples.
`build_graph(llm)` takes any LangChain chat model (e.g. `TeamChatModel`, which routes each node to
its agent's adapter).
"""

from __future__ import annotations

from typing import Any, TypedDict

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
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

_EXAMPLES = [  # (problem, reasoner's guidance, actor's answer)
    ("Sam has 3 pens and gets 4 more. How many pens does Sam have now?",
     "Sam gets more pens, so add: 3 + 4.", "3 + 4 = 7. The answer is \\boxed{7}."),
    ("Eva has 9 cups and gives away 3. How many cups are left?",
     "Eva gives cups away, so subtract: 9 - 3.", "9 - 3 = 6. The answer is \\boxed{6}."),
]


def reasoner_messages(question: str) -> list:
    shots = [m for q, r, _ in _EXAMPLES for m in (HumanMessage(f"Problem: {q}"), AIMessage(r))]
    return [SystemMessage(REASONER_PROFILE), *shots, HumanMessage(f"Problem: {question}")]


def actor_messages(question: str, reasoning: str) -> list:
    shots = [m for q, r, a in _EXAMPLES for m in (HumanMessage(f"Problem: {q}\nReasoner: {r}"), AIMessage(a))]
    return [SystemMessage(ACTOR_PROFILE), *shots, HumanMessage(f"Problem: {question}\nReasoner: {reasoning}")]


class MathState(TypedDict, total=False):
    question: str
    reasoning: str
    answer: str


def build_graph(llm: Any, *, reasoner_tokens: int | None = None, actor_tokens: int | None = None):
    """Compile the reasoner -> actor graph over `llm` (nodes are named after their agent roles).

    `reasoner_tokens` / `actor_tokens` cap each agent's reply (None: the chat model's own max_tokens).
    """
    r_kw = {"max_tokens": reasoner_tokens} if reasoner_tokens else {}
    a_kw = {"max_tokens": actor_tokens} if actor_tokens else {}

    def reasoner(state: MathState) -> dict[str, str]:
        msg = llm.invoke(reasoner_messages(state["question"]), **r_kw)
        return {"reasoning": str(msg.content)}

    def actor(state: MathState) -> dict[str, str]:
        msg = llm.invoke(actor_messages(state["question"], state["reasoning"]), **a_kw)
        return {"answer": str(msg.content)}

    g = StateGraph(MathState)
    g.add_node("reasoner", reasoner)
    g.add_node("actor", actor)
    g.add_edge(START, "reasoner")
    g.add_edge("reasoner", "actor")
    g.add_edge("actor", END)
    return g.compile()


def app_spec(max_tokens: int, temperature: float, node_roles: dict[str, str] | None = None) -> Any:
    """The math team as the demo runs it, an `AppSpec` on `TeamChatModel`: each agent's reply capped at its
    `settings.REPLY_TOKENS` (never above `max_tokens`), every call at `temperature`. The demo's rollouts, its
    held-out comparison and the curve's replays all build their app here, so they run the same app."""
    from functools import partial

    from marft_lg.examples.math_team.settings import REPLY_TOKENS
    from marft_lg.graph.app_spec import AppSpec

    caps = {k: min(v, max_tokens) for k, v in REPLY_TOKENS.items()}
    return AppSpec(app=partial(build_graph, **caps), node_roles=node_roles,
                   chat_model={"max_tokens": max_tokens, "temperature": temperature})
