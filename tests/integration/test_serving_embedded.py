"""The embedded engine on the real SmolLM2-135M-Instruct: log-probs, adapters, hot swap, `marft-lg serve`."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from marft_lg.serving.registry.store import AdapterRegistry
from marft_lg.serving.team import Team
from marft_lg.serving.types import ChatRequest

pytestmark = pytest.mark.integration
MSG = [{"role": "user", "content": "Name one planet of the solar system."}]


def _perturb(team: Team, role: str, scale: float, seed: int) -> None:
    name = team.adapter_name(role)
    g = torch.Generator().manual_seed(seed)
    with team.exclusive() as model:
        for pname, p in model.named_parameters():
            if "lora_B" in pname and f".{name}." in pname:
                p.data += torch.randn(p.shape, generator=g) * scale


@pytest.fixture(scope="module")
def team(embedded_model_dir):
    torch.set_num_threads(1)  # on a busy 2-core machine one thread is several times faster
    with Team(embedded_model_dir, ["planner", "writer"], seed=0) as t:
        yield t


def test_logprobs_match_a_recomputation(team):
    _perturb(team, "writer", 0.02, seed=1)
    reqs = [ChatRequest(MSG, agent="planner", max_tokens=8, seed=1),
            ChatRequest(MSG + [{"role": "assistant", "content": "Mars."}, {"role": "user", "content": "Another?"}],
                        agent="writer", max_tokens=8, seed=2, temperature=0.8, top_p=0.95),
            ChatRequest(MSG, max_tokens=8, temperature=0)]
    outs = team.chat(reqs)
    for c, adapter in zip(outs, ["planner@init", team.adapter_name("writer"), "__base__"], strict=True):
        assert c.completion_token_ids, c
        ids = torch.tensor([c.prompt_token_ids + c.completion_token_ids])
        with torch.inference_mode():
            logits = team.engine.model(input_ids=ids, adapter_names=[adapter]).logits[0]
        logp = torch.log_softmax(logits[len(c.prompt_token_ids) - 1:-1].float(), dim=-1)
        expected = logp.gather(1, torch.tensor(c.completion_token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(c.logprobs), expected, atol=1e-3), (c.logprobs, expected.tolist())
    assert outs[0].text.strip()  # a real instruct model answers with words


def test_two_adapters_differ_after_one_is_changed(team):
    req = dict(messages=MSG, max_tokens=6, temperature=0, ignore_eos=True)
    before_p, before_base = team.chat([ChatRequest(agent="planner", **req), ChatRequest(**req)])
    assert before_p.logprobs == pytest.approx(before_base.logprobs, abs=1e-4)  # fresh LoRA: B = 0
    _perturb(team, "planner", 0.05, seed=3)
    after_p, after_w, after_base = team.chat([ChatRequest(agent="planner", **req), ChatRequest(agent="writer", **req),
                                              ChatRequest(**req)])
    assert after_base.completion_token_ids == before_base.completion_token_ids
    assert after_p.logprobs[0] != pytest.approx(after_base.logprobs[0], abs=1e-3)
    assert after_p.logprobs[0] != pytest.approx(after_w.logprobs[0], abs=1e-3)


def test_hot_swap_under_8_concurrent_requests_loses_none(team, tmp_path):
    reg = AdapterRegistry(tmp_path)
    team.registry = reg
    v1 = team.save_version("planner")
    _perturb(team, "planner", 0.05, seed=4)
    v2 = team.save_version("planner")
    team.load_version("planner", v1)
    gen = dict(messages=MSG, agent="planner", max_tokens=12, ignore_eos=True)
    results, errors = {}, []

    def call(tag, i):
        try:
            results[(tag, i)] = team.chat([ChatRequest(**gen, seed=i)])[0]
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=call, args=("before", i)) for i in range(8)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while team._inflight[f"planner@{v1}"] < 8 and time.monotonic() < deadline:
        time.sleep(0.005)
    team.load_version("planner", v2)
    late = [threading.Thread(target=call, args=("after", i)) for i in range(8)]
    for t in late:
        t.start()
    for t in threads + late:
        t.join(180)
    assert not errors and len(results) == 16
    assert {c.adapter_version for (tag, _), c in results.items() if tag == "before"} == {v1}
    assert {c.adapter_version for (tag, _), c in results.items() if tag == "after"} == {v2}
    assert all(len(c.completion_token_ids) == 12 for c in results.values())
    assert f"planner@{v1}" not in team.engine.loaded_adapters()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_marft_lg_serve_answers_through_two_adapters(tmp_path):
    import httpx

    port = _free_port()
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "marft_lg.cli", "serve", "--agents", "planner,writer", "--port", str(port),
         "--threads", "1"], stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 150
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not come up:\n" + (tmp_path / "serve.log").read_text()
            time.sleep(0.5)
        ids = [m["id"] for m in httpx.get(f"{base}/v1/models").json()["data"]]
        assert {"planner", "writer", "planner@init", "writer@init"} <= set(ids)
        for role in ("planner", "writer"):
            r = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
                "model": role, "messages": MSG, "max_tokens": 8, "logprobs": True, "return_token_ids": True, "seed": 0})
            assert r.status_code == 200, r.text
            body = r.json()
            choice = body["choices"][0]
            assert choice["message"]["content"].strip()
            assert body["marft"]["agent"] == role
            assert len(choice["token_ids"]) == len(choice["logprobs"]["content"]) >= 1
            assert body["prompt_token_ids"]
        assert httpx.post(f"{base}/v1/chat/completions", json={"model": "critic", "messages": MSG}).status_code == 404
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()
