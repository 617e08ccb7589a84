"""W3C trace context and baggage on the HTTP calls an app makes inside a wrapped episode.

While an episode's LLM call (or node task) runs, every OpenAI-compatible completion request made in its context
over httpx (a LangChain `ChatOpenAI`, the raw `openai` client, streaming or not) carries ``traceparent`` naming the app's span as its
parent and ``baggage`` with the episode id, its adapter version pins, the call's seed and the app span again
(``marft.parent``: an app whose own OTel instrumentation already sent a ``traceparent`` keeps it). A server that
records what it sampled (`marft-lg serve`) makes its span a child of the app's, which is how mining joins the two,
also for a call the client raised on before it saw a response id. An
episode may also send its calls elsewhere (`Outbound.redirect`: the loopback server of an on-policy or
comparison run). `install()` hooks ``httpx.Client.send`` / ``AsyncClient.send`` once per process, as OTel's
httpx instrumentation does; outside an episode the hook does nothing, and it never raises into the app.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, unquote

TRACEPARENT = "traceparent"
BAGGAGE = "baggage"
EPISODE_KEY = "marft.episode_id"
VERSIONS_KEY = "marft.versions"  # "role=v2;writer=init": the episode's version pins
SEED_KEY = "marft.seed"  # the call's seed, used by the server when the request names none
PARENT_KEY = "marft.parent"  # the app's span (a traceparent), whatever traceparent the app's own OTel sent
_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$")
logger = logging.getLogger("marft_lg.tracing")


@dataclass(eq=False)
class Outbound:
    """What the HTTP calls made under one open span carry: its ids, the episode's baggage, how to seed a call
    and where to send it. `parent` is the enclosing span's, used once this span has ended."""

    trace_id: int
    span: Any  # a SpanRecord: open while its end_ns is 0
    parent: Outbound | None = None
    baggage: Mapping[str, str] = field(default_factory=dict)
    seed: Callable[[], int | None] | None = None
    redirect: Callable[[Any], None] | None = None


_CURRENT: contextvars.ContextVar[Outbound | None] = contextvars.ContextVar("marft_outbound", default=None)


def enter(outbound: Outbound | None) -> None:
    """Make `outbound` what HTTP calls in the current context carry (until a later `enter` or its span ends)."""
    _CURRENT.set(outbound)


def current() -> Outbound | None:
    """The innermost still-open span's outbound settings in this context, or None outside an episode."""
    out = _CURRENT.get()
    while out is not None and getattr(out.span, "end_ns", 0):
        out = out.parent
    return out


def traceparent(trace_id: int, span_id: int) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-01"


def parse_traceparent(value: str | None) -> tuple[int, int] | None:
    """``traceparent`` -> (trace id, parent span id); None when absent or malformed (all-zero ids included)."""
    match = _TRACEPARENT.match((value or "").strip().lower())
    if match is None:
        return None
    trace_id, span_id = int(match.group(1), 16), int(match.group(2), 16)
    return (trace_id, span_id) if trace_id and span_id else None


def encode_baggage(items: Mapping[str, str]) -> str:
    return ",".join(f"{key}={quote(str(value), safe='')}" for key, value in items.items())


def parse_baggage(value: str | None) -> dict[str, str]:
    """W3C ``baggage`` -> {key: value} (properties after ``;`` dropped; malformed members skipped)."""
    out: dict[str, str] = {}
    for member in (value or "").split(","):
        key, sep, rest = member.partition("=")
        if sep and key.strip():
            out[key.strip()] = unquote(rest.split(";", 1)[0].strip())
    return out


def encode_versions(versions: Mapping[str, str] | str) -> str:
    """Version pins as one baggage value: an alias as is, a map as ``role=ref;role=ref``."""
    if isinstance(versions, str):
        return versions
    return ";".join(f"{role}={ref}" for role, ref in versions.items())


def decode_versions(value: str | None) -> dict[str, str] | str | None:
    if not value:
        return None
    if "=" not in value:
        return value
    pairs = (item.partition("=") for item in value.split(";"))
    return {role.strip(): ref.strip() for role, sep, ref in pairs if sep and role.strip() and ref.strip()}


def outbound_headers(out: Outbound, existing: Mapping[str, str]) -> dict[str, str]:
    """The headers a request made under `out` gets: ``traceparent`` unless the app already sent one (its own OTel
    instrumentation), ``baggage`` with the episode's items added to any the request carries."""
    headers: dict[str, str] = {}
    if TRACEPARENT not in existing:
        headers[TRACEPARENT] = traceparent(out.trace_id, out.span.span_id)
    items = {**out.baggage, PARENT_KEY: traceparent(out.trace_id, out.span.span_id)}
    seed = out.seed() if out.seed is not None else None
    if seed is not None:
        items[SEED_KEY] = str(seed)
    ours = encode_baggage(items)
    theirs = existing.get(BAGGAGE)
    headers[BAGGAGE] = f"{theirs},{ours}" if theirs else ours
    return headers


CHAT_PATHS = ("/chat/completions", "/completions")  # the calls that get the episode's context: LLM calls only


def is_llm_call(request: Any) -> bool:
    """An OpenAI-compatible completion request (what a server may record); other HTTP calls a tool makes are left
    as they are, so an episode's ids and pins never reach unrelated services."""
    return request.method == "POST" and request.url.path.endswith(CHAT_PATHS)


def prepare(request: Any) -> None:
    """Add the current episode's headers to an LLM call (and send it where the episode asks); never raises."""
    out = current()
    if out is None:
        return
    try:
        if not is_llm_call(request):
            return
        if out.redirect is not None:
            out.redirect(request)
        request.headers.update(outbound_headers(out, request.headers))
    except Exception:  # noqa: BLE001 - propagation must never break the app's call
        logger.debug("marft_lg: could not add trace context to %s", getattr(request, "url", "?"), exc_info=True)


HTTP_CLIENT_MODULES = ("httpx", "httpx2")  # httpx, and its successor the `openai` client is built on
_installed: set[str] = set()
_install_lock = threading.Lock()


def install() -> None:
    """Hook ``Client.send`` and ``AsyncClient.send`` of every installed httpx-style client library (once per process)
    so that `prepare` sees every request."""
    import importlib

    with _install_lock:
        for name in HTTP_CLIENT_MODULES:
            if name in _installed:
                continue
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            _hook(module.Client, module.AsyncClient)
            _installed.add(name)


def _hook(client: type, async_client: type) -> None:
    sync_send, async_send = client.send, async_client.send

    @functools.wraps(sync_send)
    def send(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        prepare(request)
        return sync_send(self, request, *args, **kwargs)

    @functools.wraps(async_send)
    async def asend(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        prepare(request)
        return await async_send(self, request, *args, **kwargs)

    client.send, async_client.send = send, asend


def rewrite_origin(request: Any, base_url: str) -> None:
    """Send an OpenAI-compatible request to the server at `base_url` (``http://host:port/v1``) instead: the path's
    part from ``/chat/completions`` (or ``/completions``) on is kept, what comes before it is replaced."""
    target = type(request.url)(base_url.rstrip("/"))
    path = request.url.path
    at = path.rfind("/chat/completions")
    if at < 0:
        at = path.rfind("/completions")
    tail = path[at:] if at >= 0 else path
    request.url = request.url.copy_with(scheme=target.scheme, host=target.host, port=target.port,
                                        path=target.path.rstrip("/") + tail)
    request.headers["host"] = target.netloc.decode("ascii")
