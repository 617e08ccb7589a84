"""A real HTTP server for tests: uvicorn on 127.0.0.1 in a thread, stopped through its own flag."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import uvicorn


@contextlib.contextmanager
def uvicorn_thread(app):
    """A real HTTP server on 127.0.0.1 (an OS-chosen port) in a thread; stopped through its own flag."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
