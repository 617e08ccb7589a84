"""A human-in-the-loop app as LangGraph's docs write one: a drafter writes, a person approves or rejects the draft
at an `interrupt()`, a rejected draft goes to a reviser; checkpointed, resumed with ``Command(resume=...)``."""

from __future__ import annotations

from typing import Any, TypedDict

from langchain_core.messages import HumanMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import interrupt


class State(TypedDict, total=False):
    topic: str
    draft: str
    verdict: Any
    final: str


def drafter_app(draft_llm: Any, revise_llm: Any, checkpointer: Any = None) -> Any:
    def drafter(state: State) -> State:
        return {"draft": draft_llm.invoke([HumanMessage(f"Write one line about {state['topic']}.")]).content}

    def review(state: State) -> State:
        return {"verdict": interrupt({"draft": state["draft"], "question": "approve this draft?"})}

    def reviser(state: State) -> State:
        return {"final": revise_llm.invoke([HumanMessage(f"Improve this draft: {state['draft']}")]).content}

    def route(state: State) -> str:
        return END if state.get("verdict") == "approved" else "reviser"

    g = StateGraph(State)
    g.add_node("drafter", drafter)
    g.add_node("review", review)
    g.add_node("reviser", reviser)
    g.add_edge(START, "drafter")
    g.add_edge("drafter", "review")
    g.add_conditional_edges("review", route, ["reviser", END])
    g.add_edge("reviser", END)
    return g.compile(checkpointer=checkpointer if checkpointer is not None else InMemorySaver())


def build() -> Any:
    """The app on plain ChatOpenAI (models named after the team's roles), for `AppSpec` / `marft-lg run`."""
    from chatopenai_apps import chat

    return drafter_app(chat("drafter"), chat("reviser"))


def reject_once(payload: Any) -> str:
    """A simulated reviewer: rejects every draft (so the reviser runs)."""
    assert isinstance(payload, dict) and "draft" in payload
    return "rejected"


def approve_even(payload: Any) -> str:
    """A simulated approver that judges the draft itself: approves drafts of even length (the tiny model's drafts
    vary, so a group's verdicts do too)."""
    return "approved" if len(str(payload.get("draft", ""))) % 2 == 0 else "rejected"
