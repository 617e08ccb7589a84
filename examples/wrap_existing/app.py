"""A plain two-agent LangGraph app, written without marft_lg.

A researcher drafts facts about a question and a writer turns them into a short answer. Each node
uses `ChatOpenAI` pointed at any OpenAI-compatible server; the model name is the agent's role, which
is how `marft-lg serve` (or vLLM with one LoRA per role) routes the call to that agent's adapter.
"""

from __future__ import annotations

from typing import TypedDict

from langchain_core.messages import HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph


class State(TypedDict, total=False):
    question: str
    notes: str
    answer: str


def build_graph(base_url: str, api_key: str = "not-needed", max_tokens: int = 48):
    """The app as its authors wrote it: one ChatOpenAI per agent, no marft_lg anywhere."""
    researcher_llm = ChatOpenAI(base_url=base_url, api_key=api_key, model="researcher", max_tokens=max_tokens,
                                temperature=0.7, logprobs=True)
    writer_llm = ChatOpenAI(base_url=base_url, api_key=api_key, model="writer", max_tokens=max_tokens,
                            temperature=0.7, logprobs=True)

    def researcher(state: State) -> State:
        reply = researcher_llm.invoke([
            SystemMessage("You are a researcher. List two short facts that help answer the question."),
            HumanMessage(state["question"]),
        ])
        return {"notes": str(reply.content)}

    def writer(state: State) -> State:
        reply = writer_llm.invoke([
            SystemMessage("You are a writer. Answer the question in one sentence using the notes."),
            HumanMessage(f"Question: {state['question']}\nNotes: {state['notes']}"),
        ])
        return {"answer": str(reply.content)}

    graph = StateGraph(State)
    graph.add_node("researcher", researcher)
    graph.add_node("writer", writer)
    graph.add_edge(START, "researcher")
    graph.add_edge("researcher", "writer")
    graph.add_edge("writer", END)
    return graph.compile()
