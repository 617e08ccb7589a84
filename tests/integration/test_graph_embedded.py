"""A 3-node graph on the real SmolLM2-135M: the spans carry exactly the token ids and log-probs the engine returned."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from marft_lg.graph import TeamChatModel, wrap
from marft_lg.tracing import attributes as A
from marft_lg.tracing import read_spans

pytestmark = pytest.mark.integration

ROLES = ("planner", "writer", "critic")


class RecordingEngine:
    """Pass-through ChatEngine that keeps every completion the real engine returned."""

    def __init__(self, inner):
        self.inner = inner
        self.model_name = inner.model_name
        self.completions = []

    def agents(self):
        return self.inner.agents()

    def versions(self):
        return self.inner.versions()

    def chat(self, requests):
        out = self.inner.chat(requests)
        self.completions.extend(out)
        return out

    async def achat(self, requests):
        out = await self.inner.achat(requests)
        self.completions.extend(out)
        return out


def _graph(llm):
    from langchain_core.messages import HumanMessage, SystemMessage
    from langgraph.graph import END, START, MessagesState, StateGraph

    prompts = {"planner": "You plan. Give one short step.", "writer": "You write one short sentence.",
               "critic": "You review the sentence in a few words."}

    def node(role):
        def run(state):
            last = state["messages"][-1].content
            answer = llm.invoke([SystemMessage(prompts[role]), HumanMessage(last)])
            return {"messages": [answer]}
        return run

    g = StateGraph(MessagesState)
    prev = START
    for role in ROLES:
        g.add_node(role, node(role))
        g.add_edge(prev, role)
        prev = role
    g.add_edge(prev, END)
    return g.compile()


def _check_spans(trace_dir, episode_id, completions):
    calls = [s for s in read_spans(trace_dir)
             if s["attributes"].get("marft.episode.id") == episode_id and s["attributes"].get(A.GEN_AI_OPERATION_NAME) == "chat"]
    assert [c["attributes"][A.MARFT_AGENT_ROLE] for c in calls] == list(ROLES)
    assert len(calls) == len(completions)
    for span, comp in zip(calls, completions, strict=True):
        a = span["attributes"]
        assert comp.completion_token_ids, "the model produced no tokens"
        assert A.decode_ints(a[A.MARFT_PROMPT_TOKEN_IDS]) == comp.prompt_token_ids
        assert A.decode_ints(a[A.MARFT_COMPLETION_TOKEN_IDS]) == comp.completion_token_ids
        assert A.decode_floats(a[A.MARFT_COMPLETION_LOGPROBS]) == pytest.approx(comp.logprobs, abs=1e-6)
        assert a.get(A.MARFT_ADAPTER_VERSION) == comp.adapter_version
        assert A.from_genai_messages(a[A.GEN_AI_OUTPUT_MESSAGES])[0]["content"] == comp.text
        assert a[A.GEN_AI_USAGE_OUTPUT_TOKENS] == len(comp.completion_token_ids)


def test_three_node_graph_on_embedded_team(embedded_model_dir, tmp_path):
    import torch
    from langchain_core.messages import HumanMessage

    from marft_lg.serving.team import Team

    torch.set_num_threads(2)
    with Team(embedded_model_dir, list(ROLES), seed=0) as team:
        engine = RecordingEngine(team)
        app = wrap(_graph(TeamChatModel(max_tokens=8, temperature=0.8)), team=engine, trace_dir=tmp_path)
        first = app.invoke({"messages": [HumanMessage("Write about the sea.")]}, episode_id="real-1", seed=7)
        recorded = list(engine.completions)
        second = app.invoke({"messages": [HumanMessage("Write about the sea.")]}, episode_id="real-2", seed=7)
        app.flush()
    assert [m.content for m in first["messages"]] == [m.content for m in second["messages"]]  # seeded => reproducible
    assert all(c.adapter_version == "init" for c in recorded)
    _check_spans(tmp_path, "real-1", recorded)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_three_node_graph_through_marft_lg_serve(tmp_path):
    import httpx
    from langchain_core.messages import HumanMessage

    from marft_lg.graph.remote import RemoteEngine

    port = _free_port()
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "marft_lg.cli", "serve", "--agents", ",".join(ROLES), "--host", "127.0.0.1",
             "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "2"})
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 150
        while True:
            assert proc.poll() is None, log_path.read_text()
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not come up:\n" + log_path.read_text()
            time.sleep(0.5)
        engine = RecordingEngine(RemoteEngine(f"{base}/v1"))
        assert engine.agents() == list(ROLES)
        app = wrap(_graph(TeamChatModel(max_tokens=8)), team=engine, trace_dir=tmp_path / "tr")
        app.invoke({"messages": [HumanMessage("Write about the sea.")]}, episode_id="remote-1", seed=3)
        app.flush()
        _check_spans(tmp_path / "tr", "remote-1", engine.completions)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
