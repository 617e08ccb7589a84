"""The interface every serving engine implements (embedded `HFEngine`, `VLLMEngine`).

`Team` drives an engine only through this protocol: it maps roles to adapter names (``"role@vK"``)
and counts in-flight requests per adapter, so hot swaps work the same on every engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from marft_lg.serving.types import ChatRequest, Completion


@runtime_checkable
class Engine(Protocol):
    """One base model plus named LoRA adapters, answering batches of chat requests."""

    model_name: str

    def generate(self, requests: list[ChatRequest], adapter_names: list[str | None]) -> list[Completion]:
        """Answer `requests[i]` with adapter `adapter_names[i]` (None: the base model, adapters off).

        Completions carry the engine's own prompt/completion token ids and the log-prob of each
        sampled token under the unprocessed model distribution; finish_reason is "stop" or "length".
        """
        ...

    async def agenerate(self, requests: list[ChatRequest], adapter_names: list[str | None]) -> list[Completion]:
        """Async twin of `generate`; concurrent callers are batched together."""
        ...

    def load_adapter(self, name: str, path: Path) -> None:
        """Load a PEFT adapter directory (safetensors only) under `name`; loading a loaded name is a no-op."""
        ...

    def unload_adapter(self, name: str) -> None:
        """Free an adapter; the caller makes sure no request still uses it."""
        ...

    def loaded_adapters(self) -> list[str]:
        """Names of the adapters this engine can answer with."""
        ...

    def max_context(self) -> int:
        """Maximum prompt + completion tokens."""
        ...

    def close(self) -> None:
        """Stop background work and free the model; idempotent."""
        ...


@runtime_checkable
class InProcessEngine(Engine, Protocol):
    """An engine whose model lives in this process (`HFEngine`): a trainer or a drift measure may pause serving
    and use that very model (`exclusive()`), and prompts are rendered here (`encode`)."""

    def exclusive(self) -> Any:
        """A context manager pausing serving; it yields the model."""
        ...

    def encode(self, req: ChatRequest) -> list[int]:
        """The prompt token ids of a request."""
        ...
