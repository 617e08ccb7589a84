"""LLMJudge: per-step scores from a chat model, e.g. the served base model with adapters disabled.

Any object with ``chat(list[ChatRequest]) -> list[Completion]`` works as the engine (a `Team`,
an `OpenAIEngineClient`); from YAML give `base_url` (an OpenAI-compatible server such as
`marft-lg serve` or vLLM) or `engine: "pkg.mod:factory"`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from marft_lg.rewards.base import action_list
from marft_lg.rewards.registry import load_object
from marft_lg.serving.types import ChatRequest, Completion
from marft_lg.trajectories.dataset import Episode

DEFAULT_SYSTEM_PROMPT = (
    "You rate one step of a team of AI agents from 0 (useless or wrong) to 10 (exactly right). "
    "Reply with the number only."
)
DEFAULT_TEMPLATE = "Task: {task}\nStep by '{agent}': {completion}"
# Worked examples sent as earlier chat turns: small models (the embedded 135M one) answer with a bare
# number after them, while without them they reply in prose.
DEFAULT_EXAMPLES: tuple[tuple[str, str], ...] = (
    ("Task: What is 2+3?\nStep by 'solver': 2 plus 3 is 5, so the answer is 5.", "10"),
    ("Task: What is the capital of France?\nStep by 'solver': I like turtles.", "0"),
    ("Task: Sort 3,1,2.\nStep by 'planner': First find the smallest number, then repeat.", "7"),
)
_SCORE_RE = re.compile(r"-?\d+(?:\.\d+)?")


class JudgeError(ValueError):
    """The judge's reply held no usable score."""


@dataclass
class LLMJudge:
    """Asks `engine` to rate each action; a score ``s`` in ``[0, scale]`` becomes ``s / scale``.

    `template` may use {task}, {agent}, {completion}, {step_input} (the last message the agent
    was given), {index} and {n_steps}; `examples` are ``[user, assistant]`` pairs sent before the
    step (None: `DEFAULT_EXAMPLES`, [] for none). `agent` picks the adapter that judges (None: the base model). Over HTTP (`base_url`, or an
    `OpenAIEngineClient` as engine) `model` names the served base model (None: the first model
    the server lists). `on_unparsable` is the score for a reply without a number in range, or
    ``"error"`` to mark the episode unscored.
    """

    engine: Any = None
    base_url: str | None = None
    model: str | None = None
    agent: str | None = None
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    template: str = DEFAULT_TEMPLATE
    examples: list[list[str]] | None = None
    max_tokens: int = 4
    temperature: float = 0.0
    scale: float = 10.0
    on_unparsable: float | str = "error"
    max_chars: int = 2000

    def __post_init__(self) -> None:
        self.engine = judge_engine(self.engine, self.base_url, self.model, what="LLM judge")
        if self.on_unparsable != "error" and not isinstance(self.on_unparsable, int | float):
            raise ValueError(f"LLM judge: on_unparsable must be 'error' or a number, got {self.on_unparsable!r}")

    def options(self) -> dict[str, Any]:
        """The YAML form: everything but a live engine object (write `base_url` or an import path instead)."""
        if self.base_url is None:
            raise ValueError("an LLM judge built from an engine object cannot be written to YAML; "
                             "build it with base_url= to make it serialisable")
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "engine"}
        return out

    def score_steps(self, episode: Episode) -> list[float]:
        """One score in [0, 1] per action, asked in one batched `chat` call."""
        if not episode.actions:
            return []
        task = _task_text(episode)[: self.max_chars]
        requests = []
        for i, a in enumerate(episode.actions, start=1):
            given = action_list(a.get("messages"))
            step_input = str(given[-1].get("content", "")) if given and isinstance(given[-1], dict) else ""
            prompt = self.template.format(task=task, agent=a.get("agent"), index=i, n_steps=len(episode.actions),
                                          step_input=step_input[-self.max_chars:],
                                          completion=str(a.get("completion") or "")[: self.max_chars])
            messages = [{"role": "system", "content": self.system_prompt}]
            for user, assistant in (DEFAULT_EXAMPLES if self.examples is None else self.examples):
                messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
            messages.append({"role": "user", "content": prompt})
            requests.append(ChatRequest(messages=messages,
                                        agent=self.agent, max_tokens=self.max_tokens, temperature=self.temperature))
        replies = self.engine.chat(requests)
        if len(replies) != len(requests):
            raise JudgeError(f"LLM judge: engine answered {len(replies)} of {len(requests)} requests")
        return [self._parse(r.text, episode, a) for r, a in zip(replies, episode.actions, strict=True)]

    def _parse(self, text: str, episode: Episode, action: dict[str, Any]) -> float:
        m = _SCORE_RE.search(text or "")
        value = float(m.group()) if m else None
        if value is not None and 0.0 <= value <= self.scale:
            return value / self.scale
        if self.on_unparsable == "error":
            raise JudgeError(f"LLM judge gave no score in [0, {self.scale:g}] for action {action.get('order')} "
                             f"(span {action.get('span_id')}) of episode {episode.episode_id!r}: reply {text!r}; "
                             "set on_unparsable to a number to score such steps instead")
        return float(self.on_unparsable)


def judge_engine(engine: Any = None, base_url: str | None = None, model: str | None = None, *,
                 api_key: str | None = None, timeout_s: float | None = None, what: str = "LLM judge") -> Any:
    """The engine a judge asks: `engine` itself (a `Team`, anything with ``chat(list[ChatRequest])``), an import
    path to one (or to a factory of one), or an `OpenAIEngineClient` on `base_url` (`marft-lg serve`, vLLM, any
    OpenAI-compatible server) answering as `model` (None: the first model the server lists, its base model)."""
    if isinstance(engine, str):
        target = load_object(engine)
        engine = target() if callable(target) and not hasattr(target, "chat") else target
    if engine is None and base_url:
        from marft_lg.serving.http.client import DEFAULT_TIMEOUT_S, OpenAIEngineClient

        engine = OpenAIEngineClient(base_url, api_key=api_key, text_only=True,  # a judge reads text: any endpoint
                                    timeout=DEFAULT_TIMEOUT_S if timeout_s is None else float(timeout_s))
    if _is_http_client(engine):
        engine = ClientEngine(engine, model)
    if engine is None or not callable(getattr(engine, "chat", None)):
        raise ValueError(f"{what} needs an engine with chat(list[ChatRequest]) -> list[Completion]: "
                         "pass engine=<Team or client>, or base_url='http://127.0.0.1:PORT/v1' in YAML")
    return engine


class ClientEngine:
    """`chat(list[ChatRequest])` over an `OpenAIEngineClient`, whose `chat` takes one request and a model name.

    A judge needs the reply's text only: a server that answers without token ids or log-probs (an OpenAI-compatible
    endpoint other than vLLM and `marft-lg serve`) still gives its text."""

    def __init__(self, client: Any, model: str | None = None):
        self.client = client
        self.model = model

    def chat(self, requests: list[ChatRequest]) -> list[Completion]:
        if self.model is None:
            served = self.client.models()
            if not served:
                raise JudgeError(f"LLM judge: the server at {self.client.base_url} serves no model")
            self.model = served[0]
        return [self._one(r, r.agent if r.agent is not None else self.model) for r in requests]

    def _one(self, request: ChatRequest, model: str) -> Completion:
        from marft_lg.serving.http.client import MalformedResponseError

        try:
            return self.client.chat(request, model)
        except MalformedResponseError as exc:
            text = _reply_text(exc.body)
            if text is None:
                raise
            return Completion(text=text, prompt_token_ids=[], completion_token_ids=[], logprobs=[], model=model)


def _reply_text(body: Any) -> str | None:
    try:
        content = body["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        return None
    return content if isinstance(content, str) else None


def _is_http_client(engine: Any) -> bool:
    if engine is None or isinstance(engine, ClientEngine):
        return False
    try:
        from marft_lg.serving.http.client import OpenAIEngineClient
    except ImportError:
        return False
    return isinstance(engine, OpenAIEngineClient)


def _task_text(episode: Episode) -> str:
    if episode.scenario is not None and episode.scenario.get("inputs") is not None:
        inputs = episode.scenario["inputs"]
        return inputs if isinstance(inputs, str) else json.dumps(inputs, ensure_ascii=False)
    for a in episode.actions[:1]:
        for m in action_list(a.get("messages")):
            if isinstance(m, dict) and m.get("role") == "user":
                return str(m.get("content", ""))
    return ""
