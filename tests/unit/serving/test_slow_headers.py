"""Headers drip-fed one byte at a time are cut off at `--read-timeout` (408, then closed), under h11 and httptools,
and a normal request on the same server still succeeds."""

from __future__ import annotations

import selectors
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from marft_lg.serving.commands import uvicorn_config
from marft_lg.serving.http.transport import header_deadline_protocol

BASES = [pytest.param(H11Protocol, id="h11")]
try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    BASES.append(pytest.param(HttpToolsProtocol, id="httptools"))
except ImportError:  # httptools is optional for uvicorn
    pass


async def app(scope, receive, send):
    """A tiny ASGI app: 200 "ok" to every request (its body read first)."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


class Loopback:
    """uvicorn on 127.0.0.1 in a thread, stopped through its own exit flag."""

    def __init__(self, config: uvicorn.Config):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.server.started
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(20)
        self.sock.close()


def _drip_until_closed(port: int, n: int, every_s: float, limit_s: float) -> tuple[list[float], list[bytes]]:
    """`n` sockets each send one header byte per `every_s`; returns when the server closed each one (inf if not
    within `limit_s`) and what it answered."""
    request = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 200 + b"\r\n\r\n"
    socks = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(n)]
    sel = selectors.DefaultSelector()
    for i, s in enumerate(socks):
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, i)
    closed, answers, sent = [float("inf")] * n, [b""] * n, [0] * n
    t0 = time.monotonic()
    next_byte = t0
    try:
        while time.monotonic() - t0 < limit_s and any(c == float("inf") for c in closed):
            if time.monotonic() >= next_byte:
                for i, s in enumerate(socks):
                    if closed[i] == float("inf"):
                        try:
                            s.send(request[sent[i]:sent[i] + 1])
                            sent[i] += 1
                        except OSError:  # reset by the server
                            closed[i] = time.monotonic() - t0
                next_byte += every_s
            for key, _ in sel.select(timeout=0.05):
                i = key.data
                try:
                    chunk = socks[i].recv(4096)
                except OSError:
                    chunk = b""
                answers[i] += chunk
                if not chunk:
                    closed[i] = time.monotonic() - t0
                    sel.unregister(socks[i])
    finally:
        for s in socks:
            s.close()
    return closed, answers


@pytest.mark.parametrize("base", BASES)
def test_headers_dripped_one_byte_at_a_time_are_cut_off_at_the_read_timeout(base):
    config = uvicorn.Config(app, log_level="warning", http=header_deadline_protocol(1.0, base))
    with Loopback(config) as url:
        port = int(url.rsplit(":", 1)[1])
        closed, answers = _drip_until_closed(port, n=30, every_s=0.3, limit_s=4.0)
        assert max(closed) < 3.0, closed
        assert min(closed) >= 0.9  # not before the read timeout
        assert all(a.startswith(b"HTTP/1.1 408") and b"read timeout of 1 s" in a for a in answers), answers[:2]
        r = httpx.get(url, timeout=5)
        assert r.status_code == 200 and r.text == "ok"
        with httpx.Client(base_url=url, timeout=5) as client:  # keep-alive: a second request on one connection
            assert [client.get("/").text for _ in range(2)] == ["ok", "ok"]


def test_serve_runs_uvicorn_with_the_header_deadline():
    config = uvicorn_config(app, "127.0.0.1", 0, read_timeout_s=1.0)
    with Loopback(config) as url:
        closed, answers = _drip_until_closed(int(url.rsplit(":", 1)[1]), n=20, every_s=0.3, limit_s=4.0)
        assert max(closed) < 3.0 and all(a.startswith(b"HTTP/1.1 408") for a in answers), closed
        assert httpx.get(url, timeout=5).text == "ok"


def test_a_slow_body_after_complete_headers_is_left_to_the_body_guard():
    """The header deadline ends with the headers: a request whose body is still arriving is not cut by it."""
    config = uvicorn.Config(app, log_level="warning", http=header_deadline_protocol(0.5, H11Protocol))
    with Loopback(config) as url, socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), 5) as s:
        s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\nab")
        time.sleep(1.0)  # twice the deadline, within the body
        s.sendall(b"cd")
        s.settimeout(5)
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
