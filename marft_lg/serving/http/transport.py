"""The HTTP layer of `marft-lg serve` that knows nothing of chat: request ids, the API key, the body-size
limit, strict JSON, and the error shape (vLLM's / OpenAI's ``{"error": {"message", "type", "param", "code"}}``).

Bad input never takes the server down: bodies over `max_body_bytes` get 413 before they are read (or as soon as a
chunked body passes the limit), JSON is parsed strictly (orjson: no lone surrogates, no invalid UTF-8) and refused
past `MAX_JSON_DEPTH` levels, and any unexpected exception is a JSON 500 carrying a request id (also the
``x-request-id`` header of every response) whose traceback is in the log.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import uuid
from typing import Any

import orjson
from fastapi.responses import JSONResponse

_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 408: "RequestTimeoutError",
                413: "PayloadTooLargeError", 499: "ClientClosedRequest", 500: "InternalServerError",
                504: "GatewayTimeoutError"}
DEFAULT_MAX_BODY_BYTES = 8 * 2**20
MAX_JSON_DEPTH = 64
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
OPEN_PATHS = frozenset({"/health"})
"""The only paths answered without the API key when the server has one (/docs, /redoc and /openapi.json describe
the adapter routes and need it too)."""
log = logging.getLogger("marft_lg.serving.http.server")  # the server's log, whichever part writes it


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "Error"), "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content=error_body(status, message, param))


class _BodyTooLarge(Exception):
    """Raised from `receive` when a (chunked) body passes the limit."""


class _BodyTooSlow(Exception):
    """Raised from `receive` when the body has not arrived within the read timeout."""


class RequestGuard:
    """Pure ASGI middleware around the whole app: request ids, the API key (every path but /health), the body-size
    limit, and the last-resort handler that turns any unexpected exception into a logged JSON 500.

    Bodies are checked before anything reads them: a Content-Length over the limit is answered 413
    at once (the body is never read), and a chunked body is counted as it streams in and cut off with
    413 when it passes the limit, so an oversized request costs no memory.
    """

    def __init__(self, app: Any, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, api_key: str | None = None,
                 read_timeout_s: float = 30.0):
        self.app = app
        self.max_body_bytes = int(max_body_bytes)
        self.api_key = api_key
        self.read_timeout_s = float(read_timeout_s)

    async def _send_json(self, send: Any, status: int, body: dict[str, Any], rid: str) -> None:
        payload = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
            (b"x-request-id", rid.encode())] + ([(b"connection", b"close")] if status == 413 else [])})
        await send({"type": "http.response.body", "body": payload})

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        given = headers.get("x-request-id", "")
        rid = given if _REQUEST_ID.match(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        if self.api_key and scope.get("path", "") not in OPEN_PATHS:
            given = headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                await self._send_json(send, 401, error_body(
                    401, "missing or wrong API key: send 'Authorization: Bearer <key>'"), rid)
                return
        limit = self.max_body_bytes
        too_large = error_body(413, f"request body larger than the server's limit of {limit} bytes "
                                     f"({limit / 2**20:.3g} MB; marft-lg serve --max-body-mb)")
        length = headers.get("content-length")
        if length is not None:
            if not length.strip().isdigit():
                await self._send_json(send, 400, error_body(400, f"invalid Content-Length {length[:40]!r}"), rid)
                return
            if int(length) > limit:
                await self._send_json(send, 413, too_large, rid)
                return
        started = body_done = False
        received = 0
        deadline = asyncio.get_running_loop().time() + self.read_timeout_s

        async def guarded_receive() -> Any:
            nonlocal received, body_done
            if body_done:  # only the disconnect is left to hear: no deadline
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - asyncio.get_running_loop().time()))
            except TimeoutError:
                raise _BodyTooSlow from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if received > limit:
                    raise _BodyTooLarge
            return message

        async def tagged_send(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
                await send(message)
                return
            try:  # a client that stops reading a stream is dropped instead of holding its rows forever
                await asyncio.wait_for(send(message), self.read_timeout_s)
            except TimeoutError:
                raise _BodyTooSlow from None

        try:
            await self.app(scope, guarded_receive, tagged_send)
        except (KeyboardInterrupt, SystemExit, asyncio.CancelledError):
            raise
        except BaseException as e:  # noqa: BLE001 - the last resort: logged with its traceback, answered as JSON
            if _only(e, _BodyTooLarge):
                if not started:
                    await self._send_json(send, 413, too_large, rid)
                return
            if _only(e, _BodyTooSlow):
                log.info("request %s: the client was too slow (--read-timeout %g s); dropped", rid, self.read_timeout_s)
                if not started:
                    await self._send_json(send, 408, error_body(408, "the request did not arrive within the server's "
                                                                     f"read timeout of {self.read_timeout_s:g} s"), rid)
                return
            log.error("request %s %s %s failed", rid, scope.get("method"), scope.get("path"), exc_info=e)
            if not started:
                body = error_body(500, f"internal server error ({type(e).__name__}); request id {rid}, whose "
                                        "traceback is in the server log")
                body["request_id"] = rid
                await self._send_json(send, 500, body, rid)


def _only(e: BaseException, kind: type[BaseException]) -> bool:
    """Whether `e` is a `kind`, or a group (a task group below re-raises ours wrapped) holding only those."""
    return isinstance(e, kind) or (isinstance(e, BaseExceptionGroup) and e.split(kind)[1] is None)


def _json_depth_exceeds(obj: Any, limit: int) -> bool:
    """True if `obj` nests objects/arrays deeper than `limit` (iterative: no recursion on hostile input)."""
    stack = [(obj, 1)]
    while stack:
        o, depth = stack.pop()
        if isinstance(o, dict):
            items = o.values()
        elif isinstance(o, list):
            items = o
        else:
            continue
        if depth > limit:
            return True
        stack.extend((v, depth + 1) for v in items)
    return False


def parse_json_body(raw: bytes) -> Any:
    """Strict JSON (orjson: invalid UTF-8 and lone surrogates are errors) nested at most `MAX_JSON_DEPTH` deep."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None
    if _json_depth_exceeds(body, MAX_JSON_DEPTH):
        raise BadRequest(f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels")
    return body


def header_deadline_protocol(read_timeout_s: float, base: type[asyncio.Protocol] | None = None) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (`base`, default its auto choice) with a deadline on the request line and headers: a
    client that has not sent them within `read_timeout_s` of starting a request (or of connecting) gets 408 and is
    disconnected, so drip-fed headers cannot hold connections open (the body's deadline is `RequestGuard`'s)."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol as base  # httptools when installed, else h11
    answer = orjson.dumps(error_body(408, "the request headers did not arrive within the server's read timeout of "
                                          f"{read_timeout_s:g} s"))
    raw_408 = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
               b"content-length: %d\r\n\r\n%s" % (len(answer), answer))

    class HeaderDeadline(base):  # type: ignore[misc, valid-type]
        _deadline: asyncio.TimerHandle | None = None
        _seen_cycle: Any = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self.cycle is None or self.cycle.response_complete:  # bytes of a new request's line or headers
                self._arm()
            super().data_received(data)
            if self.cycle is not self._seen_cycle:  # its headers are complete: the app has the request now
                self._seen_cycle = self.cycle
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._deadline is None:
                self._deadline = self.loop.call_later(read_timeout_s, self._too_slow)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _too_slow(self) -> None:
            self._deadline = None
            if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
                return
            log.info("a client did not send its request headers within --read-timeout %g s; disconnected",
                     read_timeout_s)
            self.transport.write(raw_408)
            self.transport.close()

    HeaderDeadline.__name__ = HeaderDeadline.__qualname__ = f"HeaderDeadline{base.__name__}"
    return HeaderDeadline


class BadRequest(Exception):
    """A request the server refuses with 400 (`param`: the field at fault, as OpenAI names it)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


