"""Team: roles -> adapters, registry versions, shared adapter, hot swap under concurrent load."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from marft_lg.serving.errors import AdapterMismatchError, RegistryError, UnknownAgentError
from marft_lg.serving.registry.lora import LoraSettings
from marft_lg.serving.registry.store import AdapterRegistry
from marft_lg.serving.team import Team
from marft_lg.serving.types import ChatRequest

MSG = [{"role": "user", "content": "Who goes first?"}]
LORA = LoraSettings(r=4, init=False)


@pytest.fixture(scope="module")
def registry(tiny_model_dir, tmp_path_factory):
    """planner v1 (random LoRA) and v2 (v1 with its B matrices perturbed inside exclusive())."""
    torch.set_num_threads(1)
    reg = AdapterRegistry(tmp_path_factory.mktemp("registry"))
    with Team(tiny_model_dir, ["planner", "writer"], lora=LORA, seed=1, registry=reg, versions=None) as team:
        assert team.save_version("planner", run_id="r1", metrics={"reward": 0.1}) == "v1"
        before = team.chat([ChatRequest(MSG, agent="planner", max_tokens=3, temperature=0, ignore_eos=True)])[0]
        with team.exclusive() as model:
            g = torch.Generator().manual_seed(0)
            for name, p in model.named_parameters():
                if "lora_B" in name and "planner@init" in name:
                    p.data += (torch.randn(p.shape, generator=g) * 0.5).to(p.device)
        after = team.chat([ChatRequest(MSG, agent="planner", max_tokens=3, temperature=0, ignore_eos=True)])[0]
        assert after.logprobs != before.logprobs  # in-process updates are served at once
        assert team.save_version("planner", parent="v1") == "v2"
    return reg


def test_unknown_role_lists_the_known_ones(tiny_model_dir):
    with Team(tiny_model_dir, ["planner", "writer"]) as team:
        with pytest.raises(UnknownAgentError, match="unknown agent 'critic'; known: planner, writer"):
            team.chat([ChatRequest(MSG, agent="critic")])
        assert team.versions() == {"planner": "init", "writer": "init"}
        assert sorted(team.engine.loaded_adapters()) == ["planner@init", "writer@init"]
        out = team.chat([ChatRequest(MSG, agent="writer", max_tokens=2), ChatRequest(MSG, max_tokens=2)])
        assert (out[0].agent, out[0].adapter_version, out[1].agent, out[1].adapter_version) == ("writer", "init", None, None)
    with pytest.raises(ValueError, match="at least one agent"):
        Team(tiny_model_dir, [])


def test_live_alias_and_pinned_versions(tiny_model_dir, registry):
    registry.promote({"planner": "v1"})
    try:
        with Team(tiny_model_dir, ["planner", "writer"], registry=registry) as team:
            assert team.versions() == {"planner": "v1", "writer": "init"}
            req = dict(messages=MSG, agent="planner", max_tokens=6, seed=5, ignore_eos=True)
            v1, v2 = team.chat([ChatRequest(**req), ChatRequest(**req, version="v2")])
            assert (v1.adapter_version, v2.adapter_version) == ("v1", "v2")
            assert v1.logprobs != v2.logprobs
            assert "planner@v2" in team.engine.loaded_adapters()
            team.unload_version("planner", "v2")
            assert "planner@v2" not in team.engine.loaded_adapters()
            with pytest.raises(RegistryError, match="serves now"):
                team.unload_version("planner", "v1")
            with pytest.raises(RegistryError, match="no version 'v9'"):
                team.chat([ChatRequest(**{**req, "version": "v9"})])
            assert registry.manifest("planner", "v2")["parent"] == "v1"
    finally:
        registry.rollback("live")


def test_adapter_for_another_base_model_is_refused(tiny_model_dir, registry, tmp_path):
    other = AdapterRegistry(tmp_path)
    other.save("planner", registry.path("planner", "v1"), base_fingerprint="0123456789abcdef")
    with pytest.raises(AdapterMismatchError, match="made for base model 0123456789abcdef"):
        Team(tiny_model_dir, ["planner"], registry=other, versions={"planner": "v1"})


def test_shared_adapter_serves_every_role(tiny_model_dir, tmp_path):
    with Team(tiny_model_dir, ["planner", "writer"], shared_adapter=True, lora=LORA, registry=tmp_path) as team:
        assert team.engine.loaded_adapters() == ["shared@init"]
        assert team.save_version("writer") == "v1"
        assert AdapterRegistry(tmp_path).versions("shared") == ["v1"]
        team.load_version("planner", "v1")
        assert team.versions() == {"planner": "v1", "writer": "v1"}
        assert team.engine.loaded_adapters() == ["shared@v1"]
        req = dict(messages=MSG, max_tokens=4, seed=1, ignore_eos=True)
        p, w = team.chat([ChatRequest(agent="planner", **req), ChatRequest(agent="writer", **req)])
        assert p.completion_token_ids == w.completion_token_ids


def test_hot_swap_under_8_concurrent_requests_loses_none(tiny_model_dir, registry):
    gen = dict(messages=MSG, agent="planner", max_tokens=24, temperature=0, ignore_eos=True)
    # token-exact comparison across different batch compositions, which change float summation order (~1e-6):
    # greedy decoding, no shared-prefix prefill, and every reference step's top-1 ahead of its runner-up by far more
    # than that, so a request served by the right version cannot pick another token
    with Team(tiny_model_dir, ["planner"], registry=registry, versions={"planner": "v1"}) as ref:
        ref.engine.min_shared_prefix = 10**9
        expected = {}
        for c in ref.chat([ChatRequest(**gen, top_logprobs=2, version=v) for v in ("v1", "v2")]):
            margins = [sorted(top.values())[-1] - sorted(top.values())[-2] for top in c.extra["top_logprobs"]]
            assert min(margins) > 1e-4, f"{c.adapter_version}: a near-tie at step {margins.index(min(margins))}"
            expected[c.adapter_version] = c.completion_token_ids
    assert expected["v1"] != expected["v2"]

    with Team(tiny_model_dir, ["planner"], registry=registry, versions={"planner": "v1"}) as team:
        team.engine.min_shared_prefix = 10**9
        results: dict[tuple[str, int], object] = {}
        errors: list[BaseException] = []

        def call(tag, seed):
            try:
                results[(tag, seed)] = team.chat([ChatRequest(**gen, seed=seed)])[0]
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        before = [threading.Thread(target=call, args=("before", i)) for i in range(8)]
        for t in before:
            t.start()
        deadline = time.monotonic() + 30
        while team._inflight["planner@v1"] < 8 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert team._inflight["planner@v1"] == 8
        assert team.load_version("planner", "v2") == "v2"
        assert "planner@v1" in team.engine.loaded_adapters()  # still serving the in-flight requests
        after = [threading.Thread(target=call, args=("after", i)) for i in range(8)]
        for t in after:
            t.start()
        for t in before + after:
            t.join(120)
        assert not errors
        assert len(results) == 16
        for (tag, _), c in results.items():
            version = "v1" if tag == "before" else "v2"
            assert c.adapter_version == version
            assert c.completion_token_ids == expected[version]
        assert team.versions() == {"planner": "v2"}
        assert team.engine.loaded_adapters() == ["planner@v2"]  # the old one went once unused


def test_1200_requests_from_12_clients_during_8_hot_swaps_all_served_by_a_live_version(tiny_model_dir, registry):
    """The server (`marft-lg serve`'s app, on loopback) answers 12 clients x 100 requests while the role is swapped
    8 times (v1 <-> v2 through /v1/load_lora_adapter): none fails, and every answer says a version that was live
    while it was in flight and carries exactly that version's tokens (greedy; seeded reference answers)."""
    import httpx

    from marft_lg.serving.http.local_server import LocalServer
    from marft_lg.tracing.sink import RecordSink

    gen = dict(messages=MSG, agent="planner", max_tokens=2, temperature=0, ignore_eos=True)
    with Team(tiny_model_dir, ["planner"], registry=registry, versions={"planner": "v1"}) as ref:
        ref.engine.min_shared_prefix = 10**9
        want = {v: ref.chat([ChatRequest(**gen, version=v)])[0].completion_token_ids for v in ("v1", "v2")}
    assert want["v1"] != want["v2"]
    with Team(tiny_model_dir, ["planner"], registry=registry, versions={"planner": "v1"}) as team:
        team.engine.min_shared_prefix = 10**9
        server = LocalServer(team, RecordSink(schedule_delay_s=None))
        url = server.base_url
        live = [(time.monotonic(), "v1")]  # (from when, version): the history of what the role served
        answers, errors = [], []

        def client(k: int) -> None:
            with httpx.Client(timeout=120) as http:
                for _ in range(100):
                    t0 = time.monotonic()
                    r = http.post(f"{url}/chat/completions", json={
                        "model": "planner", "messages": MSG, "max_tokens": 2, "temperature": 0, "ignore_eos": True,
                        "return_token_ids": True})
                    if r.status_code != 200:
                        errors.append(r.text)
                        continue
                    body = r.json()
                    answers.append((t0, time.monotonic(), body["marft"]["adapter_version"],
                                    body["choices"][0]["token_ids"]))

        clients = [threading.Thread(target=client, args=(k,)) for k in range(12)]
        for t in clients:
            t.start()
        with httpx.Client(timeout=120) as http:
            for n in range(8):
                while len(answers) < (n + 1) * 120 and any(t.is_alive() for t in clients):
                    time.sleep(0.01)  # a swap every ~120 answers, whatever the pace
                version = "v2" if n % 2 == 0 else "v1"
                r = http.post(f"{url}/load_lora_adapter", json={
                    "lora_name": "planner", "lora_path": str(registry.root / "planner" / version)})
                assert r.status_code == 200, r.text
                live.append((time.monotonic(), version))
        for t in clients:
            t.join(300)
        server.close()
    assert not errors and len(answers) == 1200 and len(live) == 9

    def live_during(t0: float, t1: float) -> set[str]:
        before = [v for at, v in live if at <= t0][-1:]  # what served when it was sent, and every swap after
        return set(before) | {v for at, v in live if t0 < at <= t1 + 1.0}  # (a swap's reply may come back late)

    wrong = [(v, live_during(a, b)) for a, b, v, _ in answers if v not in live_during(a, b)]
    assert not wrong, wrong[:5]
    assert all(ids == want[v] for _, _, v, ids in answers)  # the weights of the version the answer names
    assert {v for _, _, v, _ in answers} == {"v1", "v2"}
