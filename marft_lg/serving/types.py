"""Plain data types that cross the serving boundary: one chat request in, one completion out.

Every engine (embedded transformers+peft, vLLM) and every client speaks these, so the graph layer,
the tracer and the trainer never care which engine produced a completion.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

TokenListener = Callable[[list[int], list[float]], None]
"""Told each request's new completion token ids and their log-probs as they are decoded (streaming). An engine calls
it from its own thread: it must be quick and thread-safe (e.g. ``loop.call_soon_threadsafe``). Engines that take
``listeners=`` in `achat` / `agenerate` stream; the last call comes before the request's `Completion` is returned."""


@dataclass
class ChatRequest:
    """One chat completion asked of one agent's adapter.

    `agent` is the role whose adapter answers (None: the base model with adapters disabled).
    `version` pins an adapter version or alias (``"v3"``, ``"live"``); None uses the version the
    engine currently serves for that role. `tools` (OpenAI function tools) are handed to the chat
    template (``apply_chat_template(tools=...)``); only `marft-lg serve` sets them, for a model whose
    template renders tools. Everywhere else tools are already rendered into `messages` in the text
    format of `marft_lg.tool_calls`. `constraint` (`marft_lg.constraints`: a forced tool call or a JSON
    response format) restricts decoding to what its grammar allows; None leaves the completion free.
    """

    messages: list[dict[str, Any]]
    agent: str | None = None
    version: str | None = None
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] | None = None
    seed: int | None = None
    top_logprobs: int = 0
    ignore_eos: bool = False
    tools: list[dict[str, Any]] | None = None
    constraint: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Completion:
    """A completion with everything the trainer needs, as the engine produced it.

    `logprobs[k]` is the log-probability of `completion_token_ids[k]` under the unprocessed model
    distribution (temperature 1, no top-p), as vLLM returns by default; under a constraint, that
    distribution restricted to the tokens the grammar allowed (``extra["logprobs_masked"]``). Token ids
    are the engine's own, never re-tokenised.
    """

    text: str
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float]
    finish_reason: str = "stop"
    agent: str | None = None
    adapter_version: str | None = None
    model: str = ""
    latency_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def input_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_tokens(self) -> int:
        return len(self.completion_token_ids)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@runtime_checkable
class ChatEngine(Protocol):
    """What the graph layer, the evaluator and the trainer need from any serving engine."""

    model_name: str

    def chat(self, requests: list[ChatRequest]) -> list[Completion]:
        """Answer a batch of requests (possibly for different agents) in one go."""
        ...

    async def achat(self, requests: list[ChatRequest]) -> list[Completion]:
        """Async twin of `chat`; concurrent callers are batched together by the engine. Engines that stream also
        take ``listeners: list[TokenListener | None]`` (one per request); cancelling the call cancels its rows."""
        ...

    def agents(self) -> list[str]:
        """The roles this engine can answer for."""
        ...

    def versions(self) -> dict[str, str]:
        """The adapter version each role currently serves, e.g. ``{"planner": "v3"}``."""
        ...


@runtime_checkable
class ServedTeam(ChatEngine, Protocol):
    """What `Team` (one base model) and `MixedTeam` (several) both offer, so callers never probe with hasattr.

    `bases` maps each base model's name to the single-base `Team` serving it (``{model_name: team}`` for a
    `Team`); `base_of(role)` names a role's base, `team_of(role)` is its `Team` (for `engine`, `exclusive()`),
    `tokenizer_for(role)` its base's tokenizer. Unknown roles raise `UnknownAgentError`.
    """

    registry: Any
    follows: str | None
    shared_adapter: bool

    @property
    def bases(self) -> dict[str, Any]: ...

    def base_of(self, role: str) -> str: ...

    def team_of(self, role: str) -> Any: ...

    def tokenizer_for(self, role: str) -> Any: ...

    def slot(self, role: str) -> str: ...

    def slots(self) -> list[str]: ...

    def slot_versions(self) -> dict[str, str]: ...

    def adapter_name(self, role: str, version: str | None = None) -> str: ...

    def load_version(self, role: str, ref: str) -> str: ...

    def unload_version(self, role: str, ref: str) -> None: ...

    def save_version(self, role: str, *, parent: str | None = None, run_id: str | None = None,
                     metrics: dict[str, float] | None = None) -> str: ...

    def close(self) -> None: ...
