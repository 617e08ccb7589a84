"""A tutorial-style LangGraph app: a supervisor routes to two prebuilt ReAct workers with tools.

Nothing here knows about marft_lg. Each agent is a plain `ChatOpenAI` whose `model` is the agent's
name, pointed at an OpenAI-compatible server (`marft-lg serve --agents supervisor,researcher,mathematician`
answers each name with that agent's LoRA adapter). `build_graph(llm)` takes any chat model instead,
which is how marft_lg's trainer runs the same app on-policy.

The supervisor hands off with a tool call it must make (`tool_choice="required"`, one call): the server decodes
it under a grammar, so every routing decision is a well-formed call of one of its three tools, whatever the
model's size, and the trainer learns which one to pick. The mathematician's `divide` raises on zero; its `ToolNode(handle_tool_errors=True)` turns the exception
into an error `ToolMessage` the model sees (and the trace records as a tool error), instead of ending
the run.
"""

from __future__ import annotations

import os
from typing import Any

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode

try:  # LangGraph 1.x still ships the classic prebuilt agent (LangChain's create_agent is its successor)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from langgraph.prebuilt import create_react_agent
except ImportError:  # pragma: no cover
    from langchain.agents import create_agent as create_react_agent

FACTS = {"otel": "OpenTelemetry is a standard for traces, metrics and logs.",
         "lora": "LoRA trains small low-rank matrices beside frozen weights.",
         "ppo": "PPO clips the policy ratio to keep updates small."}


@tool
def lookup(topic: str) -> str:
    """Look up a short fact about a topic (otel, lora or ppo)."""
    return FACTS.get(topic.strip().lower(), f"no fact about {topic!r}")


@tool
def add(a: float, b: float) -> float:
    """Add two numbers."""
    return a + b


@tool
def multiply(a: float, b: float) -> float:
    """Multiply two numbers."""
    return a * b


@tool
def divide(a: float, b: float) -> float:
    """Divide a by b."""
    return a / b


@tool
def transfer_to_researcher() -> str:
    """Hand the question to the researcher (questions about facts)."""
    return "researcher"


@tool
def transfer_to_mathematician() -> str:
    """Hand the question to the mathematician (arithmetic)."""
    return "mathematician"


@tool
def finish() -> str:
    """End: the last message answers the question."""
    return "finish"


ROUTES = {"transfer_to_researcher": "researcher", "transfer_to_mathematician": "mathematician", "finish": END}
SUPERVISOR_PROMPT = ("You are a supervisor. Call transfer_to_researcher for questions about facts, "
                     "transfer_to_mathematician for arithmetic, or finish when the last message answers the question.")


def _handoff(question: str, name: str, call_id: str) -> list[Any]:
    call = {"name": name, "args": {}, "id": call_id, "type": "tool_call"}
    return [HumanMessage(question), AIMessage("", tool_calls=[call]), ToolMessage(ROUTES[name], tool_call_id=call_id)]


SUPERVISOR_EXAMPLES = [  # few-shot turns: a 135M model follows examples better than instructions
    *_handoff("What is lora?", "transfer_to_researcher", "example_1"),
    *_handoff("What is 6 times 7?", "transfer_to_mathematician", "example_2"),
]
RESEARCHER_PROMPT = (
    "You are a researcher. Call the lookup tool once, then answer in one sentence. Example:\n"
    '<tool_call>{"name": "lookup", "arguments": {"topic": "otel"}}</tool_call>'
)
MATH_PROMPT = (
    "You are a mathematician. Call one tool with the two numbers, then give the result. Example:\n"
    '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
)
WORKERS = ("researcher", "mathematician")


def _model(llm: Any, role: str) -> Any:
    if llm is not None:
        return llm
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=role, base_url=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"),
                      api_key=os.environ.get("OPENAI_API_KEY", "unused"), max_tokens=64, temperature=0.7)


def build_graph(llm: Any = None) -> Any:
    """The compiled app; `llm` (any LangChain chat model) serves every agent, else one ChatOpenAI per agent."""
    supervisor_llm = _model(llm, "supervisor").bind_tools([transfer_to_researcher, transfer_to_mathematician, finish],
                                                          tool_choice="required", parallel_tool_calls=False)
    researcher = create_react_agent(_model(llm, "researcher"), [lookup], prompt=RESEARCHER_PROMPT, name="researcher")
    mathematician = create_react_agent(_model(llm, "mathematician"), ToolNode([add, multiply, divide], handle_tool_errors=True),
                                       prompt=MATH_PROMPT, name="mathematician")

    def supervisor(state: MessagesState) -> dict:
        reply = supervisor_llm.invoke([SystemMessage(SUPERVISOR_PROMPT), *SUPERVISOR_EXAMPLES, *state["messages"]])
        done = [ToolMessage(ROUTES.get(c["name"], END), tool_call_id=c["id"]) for c in reply.tool_calls]
        return {"messages": [reply, *done]}

    def route(state: MessagesState) -> str:
        turns = sum(1 for m in state["messages"] if getattr(m, "name", None) in WORKERS)
        reply = next(m for m in reversed(state["messages"]) if isinstance(m, AIMessage))  # the supervisor's
        choice = ROUTES.get(reply.tool_calls[0]["name"], END) if reply.tool_calls else END
        return END if choice == END or turns >= 2 else choice

    graph = StateGraph(MessagesState)
    graph.add_node("supervisor", supervisor)
    graph.add_node(researcher)
    graph.add_node(mathematician)
    graph.add_edge(START, "supervisor")
    graph.add_conditional_edges("supervisor", route, [*WORKERS, END])
    for worker in WORKERS:
        graph.add_edge(worker, "supervisor")
    return graph.compile()


graph = build_graph()
