"""A registry of tiny-model adapters and an in-process server that follows its `live` alias, for the
promotion tests (imported like eval_factory)."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import httpx
import torch
import uvicorn

from marft_lg.serving.registry.lora import ADAPTER_WEIGHTS, LoraSettings
from marft_lg.serving.registry.store import AdapterRegistry

ROLES = ["planner", "writer"]
LORA = LoraSettings(r=2, init=False)
DAMAGED = ("planner", "v3")


def build_registry(model_dir: str, root: Path) -> AdapterRegistry:
    """planner v1, v2 and v3 (v3 truncated after it was saved: damaged); writer v1, v2. Nothing promoted."""
    from marft_lg.serving.engine.models import model_fingerprint
    from marft_lg.serving.registry.lora import write_fresh_adapter

    torch.set_num_threads(1)
    reg = AdapterRegistry(root / "registry")
    fp = model_fingerprint(model_dir)
    for role, n in (("planner", 3), ("writer", 2)):
        for k in range(n):
            src = write_fresh_adapter(model_dir, LORA, root / "sources" / f"{role}{k}", seed=10 * k + len(role))
            reg.save(role, src, base_fingerprint=fp)
    w = reg.path(*DAMAGED) / ADAPTER_WEIGHTS
    w.write_bytes(w.read_bytes()[:-100])
    return reg


class Server:
    """`marft-lg serve --registry R --agents planner,writer [--versions V]` in-process: a Team behind uvicorn,
    on 127.0.0.1 in a thread, stopped through uvicorn's own exit flag."""

    def __init__(self, model_dir: str, registry: AdapterRegistry, versions: str = "live"):
        self.model_dir, self.registry, self.versions = model_dir, registry, versions
        self.start()

    def start(self) -> None:
        from marft_lg.serving.http.server import create_app
        from marft_lg.serving.team import Team

        self.team = Team(self.model_dir, ROLES, lora=LORA, registry=self.registry, versions=self.versions,
                         model_name="tiny")
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.server = uvicorn.Server(uvicorn.Config(create_app(self.team), log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.005)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()
        self.team.close()

    def restart(self) -> None:
        self.stop()
        self.start()

    def serves(self) -> dict[str, str]:
        return httpx.get(f"{self.url}/v1/adapters", timeout=30).json()["adapters"]

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def live_view(registry: AdapterRegistry) -> dict[str, str]:
    """What a server following `live` must serve: the alias, initial adapters where it names none."""
    live = registry.alias("live")
    return {role: live.get(role, "init") for role in ROLES}
