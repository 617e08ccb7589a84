"""A team on two base models around a frozen planner: the planner is a hosted API that marft_lg does not
train (here a stand-in, `external.py`), the solver runs on SmolLM2-135M, the checker on a small local model
with a tokenizer of its own.

Nothing here knows about marft_lg. Every agent is a plain `ChatOpenAI`: the planner at `EXTERNAL_BASE_URL`,
the two workers at `OPENAI_BASE_URL` with `model` set to their role (`marft-lg serve --agents
solver=embedded:smollm2-135m-instruct,checker=bases/checker` answers each role on its own base). The trainer
calls `build_graph(llm)`: the workers then use `llm`; the planner stays on the external endpoint, so it is
traced as part of the environment and never trained.
"""

from __future__ import annotations

import os
from typing import Any

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langgraph.graph import END, START, MessagesState, StateGraph

SOLVER_PROMPT = "You solve arithmetic. Follow the plan and end with the result as \\boxed{N}."
CHECKER_PROMPT = "You check a solution. Repeat the final number and say 'correct' or 'wrong'."


def _chat(role: str, url_env: str, default_url: str, max_tokens: int, **kwargs: Any) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=role, base_url=os.environ.get(url_env, default_url),
                      api_key=os.environ.get("OPENAI_API_KEY", "unused"), max_tokens=max_tokens, temperature=0.7,
                      **kwargs)


def _worker(role: str, max_tokens: int) -> Any:
    # Log-probs with each token written as "token_id:N" (vLLM's `return_tokens_as_token_ids`, which `marft-lg
    # serve` honours too): the trace then holds the exact tokens and behaviour log-probs of every worker action.
    return _chat(role, "OPENAI_BASE_URL", "http://127.0.0.1:8000/v1", max_tokens, logprobs=True,
                 extra_body={"return_tokens_as_token_ids": True})


def build_graph(llm: Any = None) -> Any:
    """The compiled app; `llm` (any LangChain chat model) serves the two workers, the planner stays external."""
    planner_llm = _chat("external-planner", "EXTERNAL_BASE_URL", "http://127.0.0.1:8001/v1", 48)
    solver_llm = llm if llm is not None else _worker("solver", 48)
    checker_llm = llm if llm is not None else _worker("checker", 24)

    def question(state: MessagesState) -> str:
        return str(state["messages"][0].content)

    def planner(state: MessagesState) -> dict:
        reply = planner_llm.invoke([HumanMessage(f"Write a one-line plan for: {question(state)}")])
        return {"messages": [AIMessage(str(reply.content), name="planner")]}

    def solver(state: MessagesState) -> dict:
        plan = str(state["messages"][-1].content)
        reply = solver_llm.invoke([SystemMessage(SOLVER_PROMPT), HumanMessage(f"{question(state)}\nPlan: {plan}")])
        return {"messages": [AIMessage(str(reply.content), name="solver")]}

    def checker(state: MessagesState) -> dict:
        answer = str(state["messages"][-1].content)
        reply = checker_llm.invoke([SystemMessage(CHECKER_PROMPT),
                                    HumanMessage(f"{question(state)}\nSolution: {answer}")])
        return {"messages": [AIMessage(str(reply.content), name="checker")]}

    graph = StateGraph(MessagesState)
    for name, fn in (("planner", planner), ("solver", solver), ("checker", checker)):
        graph.add_node(name, fn)
    graph.add_edge(START, "planner")
    graph.add_edge("planner", "solver")
    graph.add_edge("solver", "checker")
    graph.add_edge("checker", END)
    return graph.compile()


graph = build_graph()
