"""A two-agent LangGraph app (planner -> writer) for the library-stages test: `build_graph(llm)`."""

from __future__ import annotations

from typing import Any, TypedDict


class State(TypedDict, total=False):
    question: str
    plan: str
    answer: str


def build_graph(llm: Any) -> Any:
    from langchain_core.messages import HumanMessage, SystemMessage
    from langgraph.graph import END, START, StateGraph

    def planner(state: State) -> dict:
        return {"plan": llm.invoke([SystemMessage("Plan the answer."), HumanMessage(state["question"])]).content}

    def writer(state: State) -> dict:
        msg = HumanMessage(f"Question: {state['question']}\nPlan: {state['plan']}")
        return {"answer": llm.invoke([SystemMessage("Reply exactly as 'ANSWER: <number>'."), msg]).content}

    g = StateGraph(State)
    g.add_node("planner", planner)
    g.add_node("writer", writer)
    g.add_edge(START, "planner")
    g.add_edge("planner", "writer")
    g.add_edge("writer", END)
    return g.compile()
