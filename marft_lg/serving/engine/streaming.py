"""Token streaming: which engines stream, and the text a stream may show before its completion is finished.

A streamed reply must add up to the reply a non-streaming call returns. `TextDeltas` releases decoded text only when
later tokens cannot change it: never a half UTF-8 character, never the start of a stop string (the engine cuts the
text there), and with tools never a ``<tool_call>`` block or what could begin one (the server returns those as
``tool_calls``, not as content). Whatever is held back comes with the last chunk.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from marft_lg.tool_calls import OPEN

_PARTIAL = "\ufffd"  # what a tokenizer decodes half a UTF-8 character to


@lru_cache(maxsize=64)
def _takes_listeners(fn: Callable[..., Any]) -> bool:
    try:
        return "listeners" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def streams(method: Callable[..., Any]) -> bool:
    """Whether an engine's ``achat`` / ``agenerate`` takes ``listeners=`` (tells tokens as they are decoded)."""
    return _takes_listeners(getattr(method, "__func__", method))


def _held_tail(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (it may still become the marker)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class TextDeltas:
    """The text of a growing completion, released in pieces that later tokens cannot change.

    `decode(ids)` turns token ids into text (the tokenizer's, skipping special tokens). `stop`: the request's stop
    strings. `tools`: the reply is parsed for tool calls, so text from the first ``<tool_call>`` on is held back
    and so is surrounding whitespace (the parsed content is stripped).
    """

    def __init__(self, decode: Callable[[list[int]], str], *, stop: list[str] | None = None, tools: bool = False):
        self._decode = decode
        self._stop = [s for s in stop or [] if s]
        self._tools = tools
        self.ids: list[int] = []
        self.sent = ""

    def push(self, ids: list[int]) -> str:
        """Add decoded token ids; returns the text that is now safe to show (may be empty)."""
        self.ids.extend(ids)
        text = self._decode(self.ids)
        end = len(text.rstrip(_PARTIAL))
        for s in self._stop:
            cut = text.find(s)
            end = min(end, cut if cut >= 0 else end - _held_tail(text[:end], s))
        if self._tools:
            cut = text.find(OPEN)
            end = min(end, cut if cut >= 0 else end - _held_tail(text[:end], OPEN))
            end = len(text[:end].rstrip())
        safe = text[:end].lstrip() if self._tools else text[:end]
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        delta, self.sent = safe[len(self.sent):], safe
        return delta

    def finish(self, final: str | None) -> str:
        """The rest of `final` (the finished reply's content) after what was released."""
        final = final or ""
        if final.startswith(self.sent):
            return final[len(self.sent):]
        stripped = final.lstrip()  # released text never starts with whitespace the finished content kept
        return stripped[len(self.sent):] if stripped.startswith(self.sent) else ""


def queue_listener(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, key: Any) -> Callable[[list[int], list[float]], None]:
    """A `TokenListener` that puts ``(key, ids, logprobs)`` on an asyncio queue from any thread."""
    def listen(ids: list[int], logprobs: list[float]) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, (key, list(ids), list(logprobs)))
    return listen


__all__ = ["TextDeltas", "queue_listener", "streams"]
