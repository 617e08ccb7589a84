"""Property: after any sequence of promote, rollback, failed load and restart, what a running server
serves per role equals the registry's `live` alias (the initial adapter for a role `live` does not name).

Each example copies a registry (planner v1, v2 and a damaged v3; writer v1, v2) and starts a real
server app (a `Team` on the tiny model behind uvicorn, in a thread on 127.0.0.1) that follows `live`.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from served_registry import DAMAGED, ROLES, Server, live_view

from marft_lg.evaluation.promotion import PromotionError, promote, rollback
from marft_lg.serving.registry.lora import ADAPTER_WEIGHTS
from marft_lg.serving.registry.store import AdapterRegistry


def check_invariant(server: Server, registry: AdapterRegistry) -> None:
    assert server.serves() == live_view(registry)
    assert "@".join(DAMAGED) not in server.team.engine.loaded_adapters()  # never loaded, not even as a ghost


step = st.one_of(
    st.tuples(st.just("promote"), st.sampled_from(ROLES), st.sampled_from(["v1", "v2", "v3"])),
    st.tuples(st.just("promote_both"), st.sampled_from(["v1", "v2"]), st.sampled_from(["v1", "v2"])),
    st.just(("rollback",)),
    st.just(("failed_load",)),
    st.just(("restart",)),
)


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(steps=st.lists(step, min_size=1, max_size=6))
def test_the_server_serves_the_live_alias_after_every_step(tiny_model_dir, template, steps):
    work = Path(tempfile.mkdtemp(prefix="invariant-"))
    shutil.copytree(template, work / "registry")
    registry = AdapterRegistry(work / "registry")
    server = Server(tiny_model_dir, registry)
    try:
        check_invariant(server, registry)
        for action, *args in steps:
            if action == "promote":
                role, version = args
                expect_refusal = (role, version) == DAMAGED or (role == "writer" and version == "v3")
                with contextlib.nullcontext() if not expect_refusal else pytest.raises(PromotionError):
                    promote(registry, {role: version}, server_url=server.url)
            elif action == "promote_both":
                promote(registry, dict(zip(ROLES, args, strict=True)), server_url=server.url)
            elif action == "rollback":
                history = registry._read_aliases()["history"].get("live")
                with contextlib.nullcontext() if history else pytest.raises(PromotionError, match="no earlier state"):
                    rollback(registry, server_url=server.url)
            elif action == "failed_load":
                r = httpx.post(f"{server.url}/v1/load_lora_adapter", timeout=30, json={
                    "lora_name": DAMAGED[0], "lora_path": str(registry.root / DAMAGED[0] / DAMAGED[1])})
                assert r.status_code == 400 and ADAPTER_WEIGHTS in r.json()["error"]["message"]
            else:
                server.restart()
            check_invariant(server, registry)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
