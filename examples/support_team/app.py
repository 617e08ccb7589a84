"""The support team: planner -> (Send) researchers with a `lookup` tool -> writer <-> critic (<= 2 revisions).

A plain LangGraph app: it takes any langchain-core chat model, so it runs on marft_lg's
`TeamChatModel`, on `ChatOpenAI`, or on the scripted `FakeSupportModel` used by tests.
Every prompt quotes the earlier outputs it builds on, verbatim, so the dependencies between agent
actions can be recovered from traces.
"""

from __future__ import annotations

import json
import operator
from functools import cache
from pathlib import Path
from typing import Annotated, Any, TypedDict

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import ToolException, tool
from langgraph.graph import END, START, StateGraph
from langgraph.types import Send

HERE = Path(__file__).resolve().parent
KNOWLEDGE_BASE = HERE / "knowledge_base.json"
SCENARIOS = HERE / "scenarios.jsonl"
MAX_REVISIONS = 2
MAX_TOPICS = 3

PLANNER_PROMPT = (
    "You are the planner of a customer-support team. List the knowledge-base topics needed to answer "
    "the customer's question, as one line: 'TOPICS: topic_a, topic_b'. Known topics: {topics}."
)
RESEARCHER_PROMPT = (
    "You are a researcher of a customer-support team. Use the `lookup` tool to fetch the knowledge-base "
    "entry for your topic, then state the facts you found in one line starting with 'FINDING'."
)
WRITER_PROMPT = (
    "You are the writer of a customer-support team. Answer the customer's question using only the "
    "findings. Start with 'ANSWER:' and end with 'Thank you.'"
)
CRITIC_PROMPT = (
    "You are the critic of a customer-support team. Reply 'APPROVE: <reason>' if the draft answers the "
    "question from the findings and ends politely, else 'REVISE: <what to fix>'."
)


@cache
def knowledge_base() -> dict[str, str]:
    """The shipped knowledge base: topic -> fact."""
    return json.loads(KNOWLEDGE_BASE.read_text())


@tool
def lookup(topic: str) -> str:
    """Look up a topic in the support knowledge base and return its entry."""
    key = topic.strip().lower().replace(" ", "_")
    kb = knowledge_base()
    if key not in kb:
        raise ToolException(f"unknown topic {topic!r}; known topics: {', '.join(sorted(kb))}")
    return kb[key]


class SupportState(TypedDict, total=False):
    question: str
    plan: str
    topics: list[str]
    findings: Annotated[list[str], operator.add]
    draft: str
    critique: str
    revisions: int
    answer: str


class ResearchTask(TypedDict):
    question: str
    plan: str
    topic: str


def parse_topics(plan: str) -> list[str]:
    """'TOPICS: a, b' -> ['a', 'b'] (at most MAX_TOPICS, duplicates dropped)."""
    line = next((ln for ln in plan.splitlines() if ln.strip().upper().startswith("TOPICS:")), plan)
    body = line.split(":", 1)[1] if ":" in line else line
    topics: list[str] = []
    for raw in body.split(","):
        t = raw.strip().strip(".").lower().replace(" ", "_")
        if t and t not in topics:
            topics.append(t)
    return topics[:MAX_TOPICS]


def build_graph(llm: BaseChatModel) -> Any:
    """Compile the support-team graph around one chat model (agents are told apart by node name)."""
    researcher_llm = llm.bind_tools([lookup])

    def planner(state: SupportState) -> dict[str, Any]:
        prompt = [
            SystemMessage(PLANNER_PROMPT.format(topics=", ".join(sorted(knowledge_base())))),
            HumanMessage(state["question"]),
        ]
        plan = _text(llm.invoke(prompt))
        return {"plan": plan, "topics": parse_topics(plan), "revisions": 0}

    def fan_out(state: SupportState) -> list[Send] | str:
        if not state.get("topics"):
            return "writer"
        return [Send("researcher", {"question": state["question"], "plan": state["plan"], "topic": t})
                for t in state["topics"]]

    def researcher(task: ResearchTask) -> dict[str, Any]:
        messages: list[BaseMessage] = [
            SystemMessage(RESEARCHER_PROMPT),
            HumanMessage(f"Question: {task['question']}\nPlan:\n{task['plan']}\nYour topic: {task['topic']}"),
        ]
        first = researcher_llm.invoke(messages)
        if not getattr(first, "tool_calls", None):
            return {"findings": [_text(first)]}
        messages.append(first)
        for call in first.tool_calls[:2]:
            try:
                messages.append(lookup.invoke(call))
            except ToolException as exc:
                messages.append(ToolMessage(content=f"Error: {exc}", tool_call_id=call["id"], status="error"))
        return {"findings": [_text(researcher_llm.invoke(messages))]}

    def writer(state: SupportState) -> dict[str, Any]:
        findings = "\n".join(state.get("findings") or []) or "(no findings)"
        text = f"Question: {state['question']}\nFindings:\n{findings}"
        if state.get("critique"):
            text += f"\nPrevious draft:\n{state['draft']}\nCritique:\n{state['critique']}"
        draft = _text(llm.invoke([SystemMessage(WRITER_PROMPT), HumanMessage(text)]))
        revisions = state.get("revisions", 0) + (1 if state.get("critique") else 0)
        return {"draft": draft, "answer": draft, "revisions": revisions}

    def critic(state: SupportState) -> dict[str, Any]:
        findings = "\n".join(state.get("findings") or []) or "(no findings)"
        text = f"Question: {state['question']}\nFindings:\n{findings}\nDraft:\n{state['draft']}"
        return {"critique": _text(llm.invoke([SystemMessage(CRITIC_PROMPT), HumanMessage(text)]))}

    def after_critic(state: SupportState) -> str:
        wants_revision = state.get("critique", "").strip().upper().startswith("REVISE")
        return "writer" if wants_revision and state.get("revisions", 0) < MAX_REVISIONS else END

    g = StateGraph(SupportState)
    g.add_node("planner", planner)
    g.add_node("researcher", researcher)
    g.add_node("writer", writer)
    g.add_node("critic", critic)
    g.add_edge(START, "planner")
    g.add_conditional_edges("planner", fan_out, ["researcher", "writer"])
    g.add_edge("researcher", "writer")
    g.add_edge("writer", "critic")
    g.add_conditional_edges("critic", after_critic, ["writer", END])
    return g.compile()


def _text(message: AIMessage | BaseMessage) -> str:
    content = message.content
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
