"""A chat model's view of a streaming engine: a request's text in pieces as its tokens are decoded, then its
`Completion`.

An engine streams when its ``achat`` takes ``listeners=`` (`marft_lg.serving.engine.streaming.streams`) and the text can be
decoded here (it has ``tokenizer_for``: an in-process `Team` or `MixedTeam`); any other engine answers whole, and its
text comes at once with the completion. The pieces add up to the completion's text (`TextDeltas`).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

from marft_lg.serving.engine.streaming import TextDeltas, queue_listener, streams
from marft_lg.serving.types import ChatRequest, Completion

_END = object()


def _deltas(engine: Any, request: ChatRequest) -> TextDeltas | None:
    """The text decoder of `request`'s tokens, or None when `engine` cannot stream it."""
    tokenizer_for = getattr(engine, "tokenizer_for", None)
    if not streams(engine.achat) or tokenizer_for is None:
        return None
    tok = tokenizer_for(request.agent)
    return TextDeltas(lambda ids: tok.decode(ids, skip_special_tokens=True), stop=request.stop)


async def astream_text(engine: Any, request: ChatRequest) -> AsyncIterator[str | Completion]:
    """Text pieces as `engine` decodes `request`, then its `Completion` (cancelling the iteration cancels it)."""
    texts = _deltas(engine, request)
    if texts is None:
        yield (await engine.achat([request]))[0]
        return
    loop = asyncio.get_running_loop()
    tokens: asyncio.Queue = asyncio.Queue()
    task = asyncio.ensure_future(engine.achat([request], [queue_listener(loop, tokens, 0)]))
    try:
        while True:
            while not tokens.empty():
                if piece := texts.push(tokens.get_nowait()[1]):
                    yield piece
            if task.done():
                break
            nxt = asyncio.ensure_future(tokens.get())
            done, _ = await asyncio.wait({task, nxt}, return_when=asyncio.FIRST_COMPLETED)
            if nxt not in done:
                nxt.cancel()
            elif piece := texts.push(nxt.result()[1]):
                yield piece
        completion = task.result()[0]
        if rest := texts.finish(completion.text):
            yield rest
        yield completion
    finally:
        if not task.done():
            task.cancel()


def stream_text(engine: Any, request: ChatRequest) -> Iterator[str | Completion]:
    """Sync `astream_text`: the engine runs on a helper thread with its own event loop; closing the iterator early
    (a consumer that breaks off) cancels the request there, as cancelling `astream_text` does."""
    texts = _deltas(engine, request)
    if texts is None:
        yield engine.chat([request])[0]
        return
    heard: queue.Queue = queue.Queue()
    loop = asyncio.new_event_loop()
    task = loop.create_task(engine.achat([request], [lambda ids, lps: heard.put(ids)]))

    def run() -> None:
        try:
            result: Any = loop.run_until_complete(task)[0]
        except BaseException as e:  # noqa: BLE001 - handed to the reader, raised there
            result = e
        finally:
            loop.close()
        heard.put(_END)
        heard.put(result)

    threading.Thread(target=run, name="marft-stream", daemon=True).start()
    finished = False
    try:
        while (ids := heard.get()) is not _END:
            if piece := texts.push(ids):
                yield piece
        finished = True
    finally:
        if not finished and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed in between: the request had ended anyway
                loop.call_soon_threadsafe(task.cancel)
    completion = heard.get()
    if isinstance(completion, BaseException):
        raise completion
    if rest := texts.finish(completion.text):
        yield rest
    yield completion


__all__ = ["astream_text", "stream_text"]
