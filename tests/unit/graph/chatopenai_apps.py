"""Apps written as LangGraph's tutorials write them, on plain `ChatOpenAI` (nothing of marft_lg inside), and a
scripted team: a real `Team` on the tiny model whose completions' text is scripted per role (the prompt ids, the
adapter version and the rest are the engine's own), so tool calls and their errors are deterministic."""

from __future__ import annotations

import itertools
import warnings
from typing import Any

from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver

HANDOFF = '<tool_call>{"name": "transfer_to_bob", "arguments": {}}</tool_call>'
UNKNOWN_TOOL = '<tool_call>{"name": "teleport", "arguments": {"to": "Rome"}}</tool_call> It is sunny.'


@tool
def weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


@tool
def add(a: float, b: float) -> float:
    """Add two numbers."""
    return a + b


def chat(model: str, base_url: str = "http://127.0.0.1:9/v1", **kwargs: Any) -> Any:
    """A plain ChatOpenAI for `model`, at a URL where nothing listens (only a redirect reaches the team)."""
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=model, base_url=base_url, api_key="unused", max_retries=0,
                      **{"max_tokens": 32, "temperature": 1.0, **kwargs})


def external(model: str, text: str = "Paris is in France.") -> Any:
    """A ChatOpenAI for a hosted model the team does not serve, answered by a stand-in endpoint."""
    import httpx

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={
            "id": "chatcmpl-external", "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}})

    return chat(model, "https://api.example.com/v1", http_client=httpx.Client(transport=httpx.MockTransport(answer)))


def swarm(base_url: str = "http://127.0.0.1:9/v1", *, models: tuple[str, str] = ("alice", "bob"), **llm: Any) -> Any:
    """A langgraph-swarm support desk: alice (math, can hand off to bob) and bob (weather, can hand off to alice),
    each a prebuilt ReAct agent on its own ChatOpenAI (`llm`: more of its settings), compiled with a checkpointer."""
    from langgraph.prebuilt import create_react_agent
    from langgraph_swarm import create_handoff_tool, create_swarm

    with warnings.catch_warnings():  # LangGraph 1.x moved create_react_agent; the tutorials still use it
        warnings.simplefilter("ignore")
        alice = create_react_agent(chat(models[0], base_url, **llm), [add, create_handoff_tool(agent_name="bob")],
                                   prompt="You are Alice, a math helper. Weather questions go to Bob.", name="alice")
        bob = create_react_agent(chat(models[1], base_url, **{"max_tokens": 24, **llm}),
                                 [weather, create_handoff_tool(agent_name="alice")],
                                 prompt="You are Bob, a weather expert. Call the weather tool.", name="bob")
    return create_swarm([alice, bob], default_active_agent="alice").compile(checkpointer=InMemorySaver())


def build_swarm() -> Any:
    """A zero-argument factory of the app, as a config names it (`app.py:build_swarm`)."""
    return swarm()


def scripted(team: Any, texts: dict[str, list[str]]) -> list[Any]:
    """Make `team.achat` answer each role with its next scripted text (cycling), tokenised by the role's tokenizer,
    keeping everything else the engine produced (prompt ids, version). Returns the list that receives every
    request the team answered."""
    seen: list[Any] = []
    cycles = {role: itertools.cycle(items) for role, items in texts.items()}
    real = team.achat

    async def achat(requests):
        seen.extend(requests)
        completions = await real(requests)
        for c in completions:
            if c.agent in cycles:
                c.text = next(cycles[c.agent])
                ids = team.tokenizer_for(c.agent)(c.text, add_special_tokens=False)["input_ids"]
                c.completion_token_ids, c.logprobs = list(ids), [-0.25] * len(ids)
                c.finish_reason = "stop"  # a scripted answer is whole, whatever length the model's own draw reached
        return completions

    team.achat = achat
    return seen


def two_step(planner: Any, writer: Any) -> Any:
    """planner -> writer, each a plain chat model call in a node (the wrap_existing shape)."""
    from typing import TypedDict

    from langgraph.graph import END, START, StateGraph

    class State(TypedDict, total=False):
        question: str
        notes: str
        answer: str

    def plan(state: State) -> State:
        return {"notes": str(planner.invoke([SystemMessage("List two facts."), HumanMessage(state["question"])]).content)}

    def write(state: State) -> State:
        return {"answer": str(writer.invoke([HumanMessage(f"{state['question']}\n{state['notes']}")]).content)}

    g = StateGraph(State)
    g.add_node("planner", plan)
    g.add_node("writer", write)
    g.add_edge(START, "planner")
    g.add_edge("planner", "writer")
    g.add_edge("writer", END)
    return g.compile()
