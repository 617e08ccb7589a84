"""Small LangGraph apps for the graph tests, each built around one topology, all using TeamChatModel."""

from __future__ import annotations

import operator
from typing import Annotated, TypedDict

from langgraph.graph import END, START, StateGraph
from langgraph.types import Send

from marft_lg.tracing import read_spans


class State(TypedDict, total=False):
    msgs: Annotated[list, operator.add]
    topics: list
    rounds: int


def linear(llm, names=("planner", "writer", "critic")):
    """planner -> writer -> critic, each one LLM call on the last message."""
    g = StateGraph(State)
    prev = START
    for name in names:
        def node(state, name=name):
            return {"msgs": [llm.invoke(f"{name}: {state['msgs'][-1]}").content]}
        g.add_node(name, node)
        g.add_edge(prev, name)
        prev = name
    g.add_edge(prev, END)
    return g.compile()


def critic_loop(llm, max_rounds=3):
    """writer <-> critic loop: the critic sends back to the writer until `max_rounds` writer turns."""
    g = StateGraph(State)

    def writer(state):
        return {"msgs": [llm.invoke(f"draft: {state['msgs'][-1]}").content], "rounds": state.get("rounds", 0) + 1}

    def critic(state):
        return {"msgs": [llm.invoke(f"review: {state['msgs'][-1]}").content]}

    g.add_node("writer", writer)
    g.add_node("critic", critic)
    g.add_edge(START, "writer")
    g.add_edge("writer", "critic")
    g.add_conditional_edges("critic", lambda s: "writer" if s["rounds"] < max_rounds else END, ["writer", END])
    return g.compile()


def fan_out(llm):
    """planner -> Send one `writer` task per topic (parallel) -> critic."""
    g = StateGraph(State)

    def planner(state):
        llm.invoke(f"plan: {state['msgs'][-1]}")
        return {"topics": ["a", "b", "c"]}

    def writer(state):
        return {"msgs": [llm.invoke(f"write about {state['topic']}").content]}

    def critic(state):
        return {"msgs": [llm.invoke("review: " + " | ".join(sorted(state["msgs"][1:]))).content]}

    g.add_node("planner", planner)
    g.add_node("writer", writer)
    g.add_node("critic", critic)
    g.add_edge(START, "planner")
    g.add_conditional_edges("planner", lambda s: [Send("writer", {"topic": t}) for t in s["topics"]], ["writer"])
    g.add_edge("writer", "critic")
    g.add_edge("critic", END)
    return g.compile()


def with_subgraph(llm):
    """planner -> research (a compiled subgraph with node `researcher`) -> writer."""
    sub = StateGraph(State)
    sub.add_node("researcher", lambda s: {"msgs": [llm.invoke(f"research: {s['msgs'][-1]}").content]})
    sub.add_edge(START, "researcher")
    sub.add_edge("researcher", END)
    g = StateGraph(State)
    g.add_node("planner", lambda s: {"msgs": [llm.invoke(f"plan: {s['msgs'][-1]}").content]})
    g.add_node("research", sub.compile())
    g.add_node("writer", lambda s: {"msgs": [llm.invoke(f"write: {s['msgs'][-1]}").content]})
    g.add_edge(START, "planner")
    g.add_edge("planner", "research")
    g.add_edge("research", "writer")
    g.add_edge("writer", END)
    return g.compile()


def spans(app, trace_dir):
    """Flush the wrapped app and read its spans back from the JSONL files."""
    assert app.flush()
    return read_spans(trace_dir)


def by_episode(all_spans, episode_id):
    return [s for s in all_spans if s["attributes"].get("marft.episode.id") == episode_id]


def chats(span_list):
    return [s for s in span_list if s["attributes"].get("gen_ai.operation.name") == "chat"]


def agents(span_list):
    return [s for s in span_list if s["attributes"].get("gen_ai.operation.name") == "invoke_agent"]
