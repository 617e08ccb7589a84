"""Counterfactual replay of one step of a recorded episode, at the chat-call level.

A replay runs the episode's app again on the same input. Every call the app makes before the replayed step is
answered from the record (the same completion token ids, log-probs and adapter version, nothing recomputed), as long
as it asks what the recorded call asked (the same rendered prompt token ids, or messages when the engine cannot
render); the replayed step is sampled afresh from a reference policy (the agent's own current adapter by default, a
pinned version, the base model, or another engine); every call after it is answered as usual. A call before the step
that matches nothing recorded means the upstream did not repeat (a tool whose result changed): the replay is marked
`diverged` and is not used as a counterfactual.

`ReplayPlan` is plain data (it travels to rollout workers); `ReplayState` is one replay's progress; `ReplayEngine`
answers a `ChatEngine`'s calls for one replay (`TeamChatModel` in process, the loopback server for HTTP apps).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from marft_lg.serving.engine.streaming import streams
from marft_lg.serving.types import ChatRequest, Completion, TokenListener
from marft_lg.tracing.attributes import REPLAY_OF


@dataclass(frozen=True)
class RecordedCall:
    """One recorded LLM call of the episode: who made it, what it was asked, what it answered."""

    order: int
    agent: str | None
    prompt_ids: tuple[int, ...] | None
    messages_key: str | None
    completion_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str
    adapter_version: str | None = None

    def asks(self, prompt_ids: Sequence[int] | None, key: str | None) -> bool:
        """Whether a call with these rendered prompt ids (or, without ids, this `messages_key`) asks what this one
        asked."""
        if self.prompt_ids is not None and prompt_ids is not None:
            return tuple(prompt_ids) == self.prompt_ids
        return self.messages_key is not None and self.messages_key == key

    def completion(self, decode: Any = None) -> Completion:
        text = decode(list(self.completion_ids)) if decode is not None and self.completion_ids else self.text
        return Completion(text=text, prompt_token_ids=list(self.prompt_ids or ()),
                          completion_token_ids=list(self.completion_ids), logprobs=list(self.logprobs),
                          finish_reason="stop", agent=self.agent, adapter_version=self.adapter_version,
                          extra={"replay": "recorded", "order": self.order})


@dataclass(frozen=True)
class ReplayPlan:
    """Re-run `episode_id` with its calls before order `step` held as recorded (`held`) and `step` (`target`)
    sampled from `reference`: None (the agent's current adapter), ``"base"`` (the base model, adapters off), a
    version ref (``"v3"``, ``"live"``) or ``"engine"`` (the `ReplayEngine`'s `reference_engine`)."""

    episode_id: str
    step: int
    agent: str
    held: tuple[RecordedCall, ...]
    target: RecordedCall
    reference: str | None = None
    index: int = 0
    later: tuple[RecordedCall, ...] = ()
    """The recorded calls after the step: one of them asked again before the step is sampled is a parallel branch
    (it does not depend on the step), not a sign that the upstream changed."""

    @property
    def metadata(self) -> dict[str, Any]:
        """What a replay episode's metadata says about it."""
        return {REPLAY_OF: self.episode_id, "replay_step": self.step, "replay_agent": self.agent,
                "replay_index": self.index, "replay_reference": self.reference or "self"}


def messages_key(messages: Sequence[Any] | None) -> str | None:
    """A canonical text of a prompt's messages (role and content only), to match calls where no token ids exist."""
    if not messages:
        return None
    out = []
    for m in messages:
        if not isinstance(m, dict):
            return None
        content = m.get("content")
        if isinstance(content, list):  # content parts: their text
            content = "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
        out.append([str(m.get("role", "")), "" if content is None else str(content)])
    return json.dumps(out, ensure_ascii=False)


@dataclass
class ReplayState:
    """One replay's progress: the held calls not answered yet, whether the step was sampled, what went wrong."""

    plan: ReplayPlan
    pending: list[RecordedCall] = field(default_factory=list)
    step_done: bool = False
    diverged: str | None = None
    answered_from_record: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.pending = list(self.plan.held)

    def route(self, agent: str | None, prompt_ids: list[int] | None, key: str | None) -> RecordedCall | str:
        """What answers a call: a held `RecordedCall`, ``"step"`` (sample it from the reference) or ``"free"``."""
        with self._lock:
            for i, call in enumerate(self.pending):  # agent None: a call the base model answers (an unmapped node)
                if (agent is None or call.agent == agent) and call.asks(prompt_ids, key):
                    self.answered_from_record += 1
                    return self.pending.pop(i)
            target = self.plan.target
            if not self.step_done and target.agent == agent and target.asks(prompt_ids, key):
                self.step_done = True
                return "step"
            parallel = any((agent is None or c.agent == agent) and c.asks(prompt_ids, key)
                           for c in self.plan.later)
            if not self.step_done and self.diverged is None and not parallel:
                self.diverged = (f"a call of {agent!r} before the replayed step asked what no recorded call asked "
                                 "(the upstream did not repeat)")
            return "free"

    def outcome(self) -> dict[str, Any]:
        """The replay's metadata at its end: whether it is a usable counterfactual, and why not."""
        with self._lock:
            diverged = self.diverged
            if diverged is None and not self.step_done:
                diverged = "the replayed step was never asked again"
            elif diverged is None and self.pending:
                diverged = f"{len(self.pending)} recorded call(s) before the step were not asked again"
            return {**self.plan.metadata, "replay_diverged": diverged, "replay_held": self.answered_from_record}


class ReplayEngine:
    """A `ChatEngine` that answers one replay's calls: held calls from the record, the step from the reference,
    the rest from `inner` (the team). Everything else is `inner`'s."""

    def __init__(self, inner: Any, state: ReplayState, reference_engine: Any = None):
        self.inner, self.state, self.reference_engine = inner, state, reference_engine
        self.model_name = getattr(inner, "model_name", "")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def agents(self) -> list[str]:
        return list(self.inner.agents())

    def versions(self) -> dict[str, str]:
        return dict(self.inner.versions())

    def _encode(self, request: ChatRequest) -> list[int] | None:
        if request.agent is None:
            return None
        try:
            engine = self.inner.team_of(request.agent).engine
            return list(engine.encode(request))
        except Exception:  # noqa: BLE001 - an engine that cannot render here: match on messages
            return None

    def _decode(self, agent: str | None) -> Any:
        try:
            tok = self.inner.tokenizer_for(agent)
        except Exception:  # noqa: BLE001 - no tokenizer here: the recorded text
            return None
        return lambda ids: tok.decode(ids, skip_special_tokens=True)

    def _plan(self, requests: list[ChatRequest]) -> list[tuple[str, Any]]:
        """Per request: ("record", Completion), ("step", request for the reference) or ("free", request)."""
        out: list[tuple[str, Any]] = []
        for r in requests:
            got = self.state.route(r.agent, self._encode(r), messages_key(r.messages))
            if isinstance(got, RecordedCall):
                out.append(("record", got.completion(self._decode(r.agent))))
            elif got == "step":
                out.append(("step", self._step_request(r)))
            else:
                out.append(("free", r))
        return out

    def _step_request(self, request: ChatRequest) -> ChatRequest:
        ref = self.state.plan.reference
        if ref in (None, "engine"):
            return request
        if ref == "base":
            return replace(request, agent=None, version=None)
        return replace(request, version=ref)

    def _engine_for(self, kind: str) -> Any:
        if kind == "step" and self.state.plan.reference == "engine":
            if self.reference_engine is None:
                raise ValueError("replay reference 'engine' needs a reference engine")
            return self.reference_engine
        return self.inner

    def chat(self, requests: list[ChatRequest]) -> list[Completion]:
        plan = self._plan(requests)
        out: list[Completion | None] = [c if k == "record" else None for k, c in plan]
        for kind in ("step", "free"):
            idx = [i for i, (k, _) in enumerate(plan) if k == kind]
            if idx:
                for i, c in zip(idx, self._engine_for(kind).chat([plan[i][1] for i in idx]), strict=True):
                    out[i] = _mark(c, kind)
        return out  # type: ignore[return-value]

    async def achat(self, requests: list[ChatRequest],
                    listeners: list[TokenListener | None] | None = None) -> list[Completion]:
        plan = self._plan(requests)
        listeners = listeners or [None] * len(requests)
        out: list[Completion | None] = [None] * len(requests)
        for i, (kind, value) in enumerate(plan):
            if kind == "record":
                out[i] = value
                if listeners[i] is not None:  # a streaming caller hears the recorded tokens at once
                    listeners[i](list(value.completion_token_ids), list(value.logprobs))
        for kind in ("step", "free"):
            idx = [i for i, (k, _) in enumerate(plan) if k == kind]
            if not idx:
                continue
            engine = self._engine_for(kind)
            reqs = [plan[i][1] for i in idx]
            if streams(engine.achat) and any(listeners[i] for i in idx):
                got = await engine.achat(reqs, [listeners[i] for i in idx])
            else:
                got = await engine.achat(reqs)
            for i, c in zip(idx, got, strict=True):
                out[i] = _mark(c, kind)
        return out  # type: ignore[return-value]


def _mark(completion: Completion, kind: str) -> Completion:
    if kind == "step":
        completion.extra = {**completion.extra, "replay": "step"}
    return completion


def recorded_calls(actions: Any) -> list[RecordedCall]:
    """One episode's actions (rows of `TrajectoryDataset.actions`, in order) as `RecordedCall`s."""
    calls = []
    for row in actions.itertuples(index=False):
        prompt = getattr(row, "prompt_token_ids", None)
        ids = getattr(row, "completion_token_ids", None)
        lps = getattr(row, "completion_logprobs", None)
        version = getattr(row, "adapter_version", None)
        calls.append(RecordedCall(
            order=int(row.order), agent=row.agent,
            prompt_ids=tuple(int(t) for t in prompt) if _is_list(prompt) else None,
            messages_key=messages_key(row.messages if isinstance(row.messages, list) else None),
            completion_ids=tuple(int(t) for t in ids) if _is_list(ids) else (),
            logprobs=tuple(float(x) for x in lps) if _is_list(lps) else (),
            text=str(row.completion or ""), adapter_version=version if isinstance(version, str) else None))
    return calls


def _is_list(value: Any) -> bool:
    return value is not None and not isinstance(value, float | str) and len(value) > 0
