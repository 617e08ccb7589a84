"""An app and an engine that rollout workers load by `file.py:attr`, as they load a user's config (the tests and
`benchmarks/distributed.py` name them)."""

from __future__ import annotations

import hashlib
import operator
import os
import threading
import time
from pathlib import Path
from typing import Annotated, TypedDict

from langgraph.graph import END, START, StateGraph

from marft_lg.serving.types import ChatRequest, Completion


class State(TypedDict, total=False):
    msgs: Annotated[list, operator.add]


def two_agents(llm):
    """planner -> writer, one LLM call each on the last message."""
    g = StateGraph(State)
    g.add_node("planner", lambda s: {"msgs": [llm.invoke(f"plan: {s['msgs'][-1]}").content]})
    g.add_node("writer", lambda s: {"msgs": [llm.invoke(f"write: {s['msgs'][-1]}").content]})
    g.add_edge(START, "planner")
    g.add_edge("planner", "writer")
    g.add_edge("writer", END)
    return g.compile()


def _wait_for_chat_spans(trace_dir: str, n: int, timeout_s: float = 60.0) -> None:
    """Until the trace files this process wrote under `trace_dir` hold `n` chat spans (a condition, not a timer)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        files = Path(trace_dir).rglob(f"*-{os.getpid()}-*.jsonl")
        if sum(f.read_bytes().count(b'"name":"chat ') for f in files) >= n:
            return
        time.sleep(0.02)
    raise TimeoutError(f"{n} chat spans never reached {trace_dir}")


class FixedLatencyEngine:
    """A `ChatEngine` that answers every call after `latency_s` (the spec's `engine_options`, default 0.05 s) with
    text and tokens derived from the request: what measures the orchestration's own cost, not a model's."""

    def __init__(self, spec):
        self.latency_s = float(spec.engine_options.get("latency_s", 0.05))
        self._agents = list(spec.agents)
        self._versions = {a: "init" for a in self._agents}
        self._lock = threading.Lock()
        # `die_once` (a file path) + `die_after` (calls): the first worker to answer that many calls exits on the
        # spot, mid-iteration, exactly once across all workers (the file decides): a kill with no timer to race
        self._die_once, self._die_after, self._calls = (spec.engine_options.get("die_once"),
                                                        int(spec.engine_options.get("die_after", 0)), 0)
        # `die_traced` (the workers' trace folder): before dying, wait until this process's trace files there hold
        # the chat spans of every call it answered, so the death leaves whole and partial episodes on disk for sure
        self._traced = spec.engine_options.get("die_traced")

    def _maybe_die(self):
        with self._lock:
            self._calls += 1
            if not self._die_once or self._calls != self._die_after:
                return
        try:
            os.close(os.open(self._die_once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return  # another worker died already
        if self._traced:
            _wait_for_chat_spans(self._traced, self._die_after - 1)
        os._exit(1)

    def agents(self):
        return list(self._agents)

    def versions(self):
        with self._lock:
            return dict(self._versions)

    def load_version(self, role, ref):
        with self._lock:
            self._versions[role] = ref
        return ref

    def _answer(self, req: ChatRequest) -> Completion:
        version = req.version or self.versions().get(req.agent)
        last = req.messages[-1]["content"] if req.messages else ""
        text = f"{req.agent}@{version}:" + hashlib.sha1(f"{req.agent}|{version}|{req.seed}|{last}".encode()).hexdigest()[:8]
        ids = [ord(c) for c in text]
        return Completion(text=text, prompt_token_ids=[len(last) % 97, 1, 2], completion_token_ids=ids,
                          logprobs=[-0.5] * len(ids), agent=req.agent, adapter_version=version, model="fixed-latency",
                          latency_s=self.latency_s)

    def chat(self, requests):
        self._maybe_die()
        time.sleep(self.latency_s)
        return [self._answer(r) for r in requests]

    async def achat(self, requests):
        import asyncio

        self._maybe_die()
        await asyncio.sleep(self.latency_s)
        return [self._answer(r) for r in requests]
