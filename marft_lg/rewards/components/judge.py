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
from marft_lg.serving.types import ChatRequest
from marft_lg.trajectories.dataset import Episode

DEFAULT_SYSTEM_PROMPT = (
    "You review one step of a team of AI agents working on a task. Rate how much the step helps "
    "solve the task, from 0 (useless, wrong or harmful) to 10 (exactly right and necessary). "
    "Reply with the number only."
)
DEFAULT_TEMPLATE = (
    "Task:\n{task}\n\nStep {index} of {n_steps}, by agent '{agent}'.\n"
    "What the agent was given last:\n{step_input}\n\nWhat the agent produced:\n{completion}\n\nScore (0-10):"
)
_SCORE_RE = re.compile(r"-?\d+(?:\.\d+)?")


class JudgeError(ValueError):
    """The judge's reply held no usable score."""


@dataclass
class LLMJudge:
    """Asks `engine` to rate each action; a score ``s`` in ``[0, scale]`` becomes ``s / scale``.

    `agent` picks the adapter that judges (None: the base model). `on_unparsable` is the score
    for a reply without a number in range, or ``"error"`` to mark the episode unscored.
    """

    engine: Any = None
    base_url: str | None = None
    agent: str | None = None
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    template: str = DEFAULT_TEMPLATE
    max_tokens: int = 8
    temperature: float = 0.0
    scale: float = 10.0
    on_unparsable: float | str = "error"
    max_chars: int = 2000

    def __post_init__(self) -> None:
        if isinstance(self.engine, str):
            target = load_object(self.engine)
            self.engine = target() if callable(target) and not hasattr(target, "chat") else target
        if self.engine is None and self.base_url:
            try:
                from marft_lg.serving.client import OpenAIEngineClient
            except ImportError as exc:
                raise ValueError(f"LLM judge: cannot create a client for {self.base_url}: {exc}") from exc
            self.engine = OpenAIEngineClient(self.base_url)
        if self.engine is None or not callable(getattr(self.engine, "chat", None)):
            raise ValueError("LLM judge needs an engine with chat(list[ChatRequest]) -> list[Completion]: "
                             "pass engine=<Team or client>, or base_url='http://127.0.0.1:PORT/v1' in YAML")
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
            messages = action_list(a.get("messages"))
            step_input = str(messages[-1].get("content", "")) if messages and isinstance(messages[-1], dict) else ""
            prompt = self.template.format(task=task, agent=a.get("agent"), index=i, n_steps=len(episode.actions),
                                          step_input=step_input[-self.max_chars:],
                                          completion=str(a.get("completion") or "")[: self.max_chars])
            requests.append(ChatRequest(messages=[{"role": "system", "content": self.system_prompt},
                                                  {"role": "user", "content": prompt}],
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


def _task_text(episode: Episode) -> str:
    if episode.scenario is not None and episode.scenario.get("inputs") is not None:
        inputs = episode.scenario["inputs"]
        return inputs if isinstance(inputs, str) else json.dumps(inputs, ensure_ascii=False)
    for a in episode.actions[:1]:
        for m in action_list(a.get("messages")):
            if isinstance(m, dict) and m.get("role") == "user":
                return str(m.get("content", ""))
    return ""
