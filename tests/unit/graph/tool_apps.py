"""Tutorial-style multi-agent apps on a fake tool-calling chat model (any LangChain model, not TeamChatModel).

`ToolFake` supports `bind_tools` and answers from the conversation alone (so concurrent runs are
deterministic): a supervisor hands off to the workers of its plan in turn, then finishes; a worker
calls its tool (plus one malformed call on its first turn: an `invalid_tool_calls` entry), then
answers with the tool's result.
"""

from __future__ import annotations

import operator
import warnings
from typing import Annotated, Any, TypedDict

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode
from langgraph.types import Send

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from langgraph.prebuilt import create_react_agent

PLAN = ("researcher", "mathematician", "researcher")


@tool
def lookup(topic: str) -> str:
    """Look a topic up."""
    return f"facts about {topic}"


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool
def divide(a: int, b: int) -> float:
    """Divide a by b (raises on b = 0)."""
    return a / b


class ToolFake(BaseChatModel):
    """A scripted tool-calling chat model; its answer depends only on the messages and the bound tools."""

    tool_names: list[str] = []
    plan: tuple[str, ...] = PLAN

    @property
    def _llm_type(self) -> str:
        return "tool-fake"

    def bind_tools(self, tools: Any, **kwargs: Any) -> ToolFake:
        names = [convert_to_openai_tool(t)["function"]["name"] for t in tools]
        return self.model_copy(update={"tool_names": names})

    def _generate(self, messages, stop=None, run_manager=None, **kwargs) -> ChatResult:
        return ChatResult(generations=[ChatGeneration(message=self._answer(messages))])

    def _answer(self, messages: list[Any]) -> AIMessage:
        handoffs = [n for n in self.tool_names if n.startswith("transfer_to_")]
        if handoffs:  # a supervisor (langgraph-supervisor) or a swarm agent: hand off along the plan
            done = sum(1 for m in messages if isinstance(m, AIMessage)
                       and any(tc["name"].startswith("transfer_to_") for tc in m.tool_calls))
            returns = sum(1 for m in messages if isinstance(m, ToolMessage) and "back to" in str(m.content).lower())
            if done < len(self.plan) and done <= returns + (1 if done == 0 else 0):
                target = f"transfer_to_{self.plan[done]}"
                if target in handoffs:
                    return AIMessage(content="", tool_calls=[{"name": target, "args": {}, "id": f"h{done}"}])
            return AIMessage(content=f"final answer after {done} hand-offs")
        if self.tool_names:  # a worker with tools (a hand-off's "transferred" tool message is not a result)
            results = [m for m in messages if isinstance(m, ToolMessage) and "transferred" not in str(m.content).lower()]
            if results and messages[-1] is results[-1]:
                return AIMessage(content=f"worker result: {results[-1].content}")
            first_turn = not results
            name = self.tool_names[0]
            args = {"topic": "otel"} if name == "lookup" else {"a": 6, "b": 0 if name == "divide" else 3}
            invalid = ([{"name": name, "args": '{"a": 1,', "id": "bad-1", "error": "unparsable arguments",
                         "type": "invalid_tool_call"}] if first_turn else [])
            return AIMessage(content="", tool_calls=[{"name": name, "args": args, "id": f"c{len(messages)}"}],
                             invalid_tool_calls=invalid)
        # a plain supervisor node: route by how many worker answers it has seen
        answers = sum(1 for m in messages if isinstance(m, AIMessage) and str(m.content).startswith("worker result"))
        return AIMessage(content=f"route {self.plan[answers]}" if answers < len(self.plan) else "FINISH")


def hand_written_supervisor(llm: BaseChatModel):
    """A supervisor node that routes (conditional edges) to two `create_react_agent` workers with tools."""
    researcher = create_react_agent(llm, [lookup], name="researcher")
    mathematician = create_react_agent(llm, ToolNode([divide], handle_tool_errors=True), name="mathematician")

    def supervisor(state: MessagesState):
        return {"messages": [llm.invoke(state["messages"])]}

    def route(state: MessagesState) -> str:
        text = str(state["messages"][-1].content)
        return text.split()[-1] if text.startswith("route ") else END

    g = StateGraph(MessagesState)
    g.add_node("supervisor", supervisor)
    g.add_node(researcher)
    g.add_node(mathematician)
    g.add_edge(START, "supervisor")
    g.add_conditional_edges("supervisor", route, ["researcher", "mathematician", END])
    g.add_edge("researcher", "supervisor")
    g.add_edge("mathematician", "supervisor")
    return g.compile()


def prebuilt_supervisor(llm: BaseChatModel):
    """langgraph-supervisor's `create_supervisor` over two `create_react_agent` workers."""
    from langgraph_supervisor import create_supervisor

    researcher = create_react_agent(llm, [lookup], name="researcher")
    mathematician = create_react_agent(llm, [add], name="mathematician")
    return create_supervisor([researcher, mathematician], model=llm, prompt="You route work.").compile()


def swarm(llm: BaseChatModel):
    """langgraph-swarm: two agents that hand off to each other."""
    from langgraph_swarm import create_handoff_tool, create_swarm

    a = create_react_agent(llm.model_copy(update={"plan": ("mathematician",)}),
                           [create_handoff_tool(agent_name="mathematician"), lookup], name="researcher")
    b = create_react_agent(llm.model_copy(update={"plan": ()}), [add], name="mathematician")
    return create_swarm([a, b], default_active_agent="researcher").compile()


class Team(TypedDict, total=False):
    messages: Annotated[list, operator.add]
    topics: list


def nested_custom(llm: BaseChatModel):
    """A custom (unnamed) subgraph `team` with two inner LLM nodes, between an outer planner and critic."""
    inner = StateGraph(Team)
    for name in ("drafter", "editor"):
        inner.add_node(name, lambda s, name=name: {"messages": [llm.invoke(f"{name}: {s['messages'][-1]}").content]})
    inner.add_edge(START, "drafter")
    inner.add_edge("drafter", "editor")
    inner.add_edge("editor", END)
    outer = StateGraph(Team)
    outer.add_node("planner", lambda s: {"messages": [llm.invoke(f"plan: {s['messages'][-1]}").content]})
    outer.add_node("team", inner.compile())
    outer.add_node("critic", lambda s: {"messages": [llm.invoke(f"review: {s['messages'][-1]}").content]})
    outer.add_edge(START, "planner")
    outer.add_edge("planner", "team")
    outer.add_edge("team", "critic")
    outer.add_edge("critic", END)
    return outer.compile()


def send_fan_out(llm: BaseChatModel):
    """planner -> one `create_react_agent` worker task per topic (`Send`, parallel) -> synthesizer."""
    worker = create_react_agent(llm, [lookup], name="worker")

    def planner(state: Team):
        llm.invoke("plan: " + str(state["messages"][-1]))
        return {"topics": ["a", "b", "c"]}

    def synthesizer(state: Team):
        return {"messages": [llm.invoke("combine: " + " | ".join(str(getattr(m, "content", m)) for m in state["messages"]))]}

    g = StateGraph(Team)
    g.add_node("planner", planner)
    g.add_node(worker)
    g.add_node("synthesizer", synthesizer)
    g.add_edge(START, "planner")
    g.add_conditional_edges("planner", lambda s: [Send("worker", {"messages": [HumanMessage(f"research {t}")]})
                                                  for t in s["topics"]], ["worker"])
    g.add_edge("worker", "synthesizer")
    g.add_edge("synthesizer", END)
    return g.compile()
