import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from marft_lg.evaluation.gate import GateDecision
from marft_lg.evaluation.promotion import PromotionError, promote, read_records, rollback


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir, tmp_path_factory):
    from marft_lg.serving.registry.lora import LoraSettings, write_fresh_adapter

    root = tmp_path_factory.mktemp("adapters")
    return [write_fresh_adapter(tiny_model_dir, LoraSettings(r=2, init=False), root / f"a{seed}", seed=seed)
            for seed in (1, 2, 3)]


@pytest.fixture()
def registry(tiny_model_dir, adapter_dirs, tmp_path):
    from marft_lg.serving.engine.models import model_fingerprint
    from marft_lg.serving.registry.store import AdapterRegistry

    reg = AdapterRegistry(tmp_path / "registry")
    fp = model_fingerprint(tiny_model_dir)
    for d in adapter_dirs:
        for role in ("planner", "writer"):
            reg.save(role, d, base_fingerprint=fp)
    reg.promote({"planner": "v1", "writer": "v1"}, reason="first deploy")
    reg.set_alias("candidate", {"planner": "v1", "writer": "v2"})
    return reg


def _rejected():
    return GateDecision(promote=False, reasons=["team reward delta -0.2 (need >= +0)"], checks=[], gate={})


def test_promote_then_rollback_restores_exactly_the_previous_versions(registry, tmp_path):
    rec = promote(registry, "candidate", reason="gate passed", run_dir=tmp_path / "run")
    assert rec.before == {"planner": "v1", "writer": "v1"} and rec.after == {"planner": "v1", "writer": "v2"}
    assert registry.alias("live") == {"planner": "v1", "writer": "v2"}
    promote(registry, {"planner": "v3", "writer": "latest"})
    assert registry.alias("live") == {"planner": "v3", "writer": "v3"}
    assert rollback(registry).after == {"planner": "v1", "writer": "v2"}
    assert rollback(registry).after == {"planner": "v1", "writer": "v1"}
    assert registry.alias("live") == {"planner": "v1", "writer": "v1"}
    assert [r["action"] for r in read_records(registry)] == ["promote", "promote", "rollback", "rollback"]
    assert json.loads((tmp_path / "run" / "promote.json").read_text())["reason"] == "gate passed"


def test_rejected_decision_refuses_unless_forced(registry):
    with pytest.raises(PromotionError, match="(?s)gate rejected.*team reward delta -0.2.*--force"):
        promote(registry, "candidate", decision=_rejected())
    assert registry.alias("live") == {"planner": "v1", "writer": "v1"}
    rec = promote(registry, "candidate", decision=_rejected(), force=True)
    assert rec.reason.startswith("FORCED") and rec.decision["decision"] == "reject"


def test_rollback_without_history_and_unknown_alias_are_errors(tmp_path, registry):
    from marft_lg.serving.registry.store import AdapterRegistry

    with pytest.raises(PromotionError, match="cannot roll back 'live'"):
        rollback(AdapterRegistry(tmp_path / "empty"))
    with pytest.raises(PromotionError, match="maps no versions"):
        promote(registry, "nightly")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def server(tiny_model_dir, registry):
    port = _free_port()
    cmd = [sys.executable, "-m", "marft_lg.cli", "serve", "--model", tiny_model_dir, "--agents", "planner,writer",
           "--registry", str(registry.root), "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"server exited: {proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        else:
            pytest.fail("server did not start in 120 s")
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _served(url: str) -> set[str]:
    ids = {m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}
    return {i for i in ids if "@" in i}


def test_promote_and_rollback_hot_swap_a_running_server(registry, server):
    assert _served(server) == {"planner@v1", "writer@v1"}
    rec = promote(registry, "candidate", server_url=server)
    assert rec.swapped == {"writer": "v2"}
    assert _served(server) == {"planner@v1", "writer@v2"}
    rollback(registry, server_url=server)
    assert _served(server) == {"planner@v1", "writer@v1"}
    # a server that refuses (role it does not serve) leaves alias and server as they were
    registry.save("critic", registry.path("writer", "v1"), base_fingerprint=registry.manifest("writer", "v1")["base_fingerprint"])
    with pytest.raises(PromotionError, match="nothing changed"):
        promote(registry, {"writer": "v3", "critic": "v1"}, server_url=server)
    assert registry.alias("live") == {"planner": "v1", "writer": "v1"}
    assert _served(server) == {"planner@v1", "writer@v1"}
