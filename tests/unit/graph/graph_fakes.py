"""A deterministic in-memory ChatEngine for graph tests: answers depend on agent, version, seed and prompt."""

from __future__ import annotations

import hashlib
import threading
import time

from marft_lg.serving.types import ChatRequest, Completion


class FakeEngine:
    """Implements the `ChatEngine` protocol; `script` maps an agent to a list of canned answers (cycled)."""

    def __init__(self, agents=("planner", "writer", "critic"), versions=None, script=None, model_name="fake-135m",
                 fail=False, hang_s=0.0):
        self._agents = list(agents)
        self._versions = dict(versions or {a: "v1" for a in self._agents})
        self.script = {k: list(v) for k, v in (script or {}).items()}
        self.model_name = model_name
        self.requests: list[ChatRequest] = []
        self.fail = fail
        self.hang_s = hang_s
        self._lock = threading.Lock()
        self._calls: dict[str | None, int] = {}

    def agents(self):
        return list(self._agents)

    def versions(self):
        return dict(self._versions)

    def _answer(self, req: ChatRequest) -> Completion:
        if self.hang_s:
            time.sleep(self.hang_s)
        if self.fail:
            raise RuntimeError("fake engine exploded")
        with self._lock:
            self.requests.append(req)
            k = self._calls.get(req.agent, 0)
            self._calls[req.agent] = k + 1
        version = req.version or (self._versions.get(req.agent) if req.agent else None)
        last = req.messages[-1]["content"] if req.messages else ""
        if req.agent in self.script:
            answers = self.script[req.agent]
            text = answers[k % len(answers)]
        else:
            digest = hashlib.sha1(f"{req.agent}|{version}|{req.seed}|{last}".encode()).hexdigest()[:8]
            text = f"{req.agent or 'base'}@{version}:{digest}"
        prompt_ids = [len(m["content"]) % 97 + i for i, m in enumerate(req.messages)]
        completion_ids = [ord(c) for c in text]
        logprobs = [-(i + 1) / 7.0 for i in range(len(completion_ids))]
        return Completion(text=text, prompt_token_ids=prompt_ids, completion_token_ids=completion_ids,
                          logprobs=logprobs, agent=req.agent, adapter_version=version if req.agent else None,
                          model=self.model_name, latency_s=0.001)

    def chat(self, requests):
        return [self._answer(r) for r in requests]

    async def achat(self, requests):
        return self.chat(requests)
