"""Heterogeneous teams: roles on several base models (`team(mapping)` -> `MixedTeam`), the base recorded in each
adapter's manifest (`base_name`, `base_hash`) and checked on load, the server and the CLI over a mixed team."""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil

import pytest
import torch
from fastapi.testclient import TestClient

from marft_lg.serving.engine.models import build_tiny_model, model_content_hash, model_fingerprint
from marft_lg.serving.errors import AdapterMismatchError, UnknownAgentError
from marft_lg.serving.mixed_team import MixedTeam, unique_names
from marft_lg.serving.registry.lora import LoraSettings
from marft_lg.serving.registry.store import AdapterRegistry
from marft_lg.serving.team import Team
from marft_lg.serving.team_factory import team as build_team
from marft_lg.serving.types import ChatRequest, ServedTeam

MSG = [{"role": "user", "content": "Who goes first?"}]
LORA = LoraSettings(r=4, init=False)


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory) -> str:
    """A second base: 32 wide (the session's tiny model is 64 wide), seed 1."""
    return str(build_tiny_model(tmp_path_factory.mktemp("small") / "small-llama", hidden_size=32, num_layers=2,
                                num_heads=2, seed=1))


@pytest.fixture(scope="module")
def twin_dir(tmp_path_factory) -> str:
    """The small model's shapes with other weights (seed 0): same fingerprint, another content hash."""
    return str(build_tiny_model(tmp_path_factory.mktemp("twin") / "twin-llama", hidden_size=32, num_layers=2,
                                num_heads=2, seed=0))


@pytest.fixture(scope="module")
def mixed(tiny_model_dir, small_dir, tmp_path_factory):
    torch.set_num_threads(1)
    reg = AdapterRegistry(tmp_path_factory.mktemp("mixed-reg"))
    team = build_team({"planner": tiny_model_dir, "writer": small_dir}, registry=reg, versions=None, lora=LORA, seed=3)
    yield team
    team.close()


def _req(agent, **kw):
    return ChatRequest(MSG, agent=agent, max_tokens=kw.pop("max_tokens", 4), seed=kw.pop("seed", 7),
                       ignore_eos=True, **kw)


def test_a_mapping_on_one_base_is_a_plain_team(tiny_model_dir):
    with build_team({"planner": tiny_model_dir, "writer": tiny_model_dir}, lora=LORA, model_name="tiny") as team:
        assert type(team) is Team and team.agents() == ["planner", "writer"]
        assert team.bases == {"tiny": team} and team.base_of("writer") == "tiny" and team.team_of("planner") is team
        assert team.tokenizer_for("planner") is team.tokenizer
        assert isinstance(team, ServedTeam)
        with pytest.raises(UnknownAgentError, match="unknown agent 'critic'"):
            team.base_of("critic")
    with pytest.raises(ValueError, match=r"do not match the roles of the model mapping \['planner'\]"):
        Team({"planner": tiny_model_dir}, ["planner", "writer"])
    with pytest.raises(ValueError, match="at least one"):
        Team({})


def test_a_mapping_on_two_bases_is_a_mixed_team(mixed, tiny_model_dir, small_dir):
    assert isinstance(mixed, MixedTeam) and isinstance(mixed, ServedTeam)
    assert list(mixed.bases) == ["tiny-llama", "small-llama"]
    assert all(type(t) is Team for t in mixed.bases.values())
    assert mixed.bases["tiny-llama"].agents() == ["planner"] and mixed.bases["small-llama"].agents() == ["writer"]
    assert mixed.agents() == ["planner", "writer"] and mixed.slots() == ["planner", "writer"]
    assert mixed.base_of("writer") == "small-llama" and mixed.team_of("planner") is mixed.bases["tiny-llama"]
    assert mixed.model_name == "planner=tiny-llama,writer=small-llama"
    assert mixed.tokenizer_for("writer") is mixed.bases["small-llama"].tokenizer
    assert mixed.registry is mixed.bases["tiny-llama"].registry is mixed.bases["small-llama"].registry
    assert mixed.follows is None and mixed.versions() == {"planner": "init", "writer": "init"}
    assert mixed.adapter_name("writer") == "writer@init" and mixed.slot("writer") == "writer"
    with pytest.raises(RuntimeError, match=r"team_of\(role\)\.exclusive\(\)"):
        mixed.exclusive()
    with pytest.raises(AttributeError, match="tokenizer_for"):
        _ = mixed.tokenizer
    with pytest.raises(UnknownAgentError):
        mixed.base_of("critic")


def test_mapping_errors(tiny_model_dir, small_dir):
    spec = {"planner": tiny_model_dir, "writer": small_dir}
    with pytest.raises(ValueError, match="shared_adapter=True needs one base model"):
        build_team(spec, shared_adapter=True)
    with pytest.raises(ValueError, match=r"agents \['planner', 'critic'\] do not match"):
        build_team(spec, ["planner", "critic"])
    with pytest.raises(ValueError, match=r"puts the roles on 2 base models; a Team serves one base: use "
                                         r"marft_lg.team\(\.\.\.\)"):
        Team(spec)  # a Team is one base, always: the factory builds the MixedTeam


def test_a_mixed_batch_is_answered_by_each_role_s_base_in_request_order(mixed):
    reqs = [_req("writer"), _req("planner"), _req("writer", seed=8), _req("planner", version="init")]
    out = mixed.chat(reqs)
    assert [(c.agent, c.model, c.adapter_version) for c in out] == [
        ("writer", "small-llama", "init"), ("planner", "tiny-llama", "init"),
        ("writer", "small-llama", "init"), ("planner", "tiny-llama", "init")]
    for r, c in zip(reqs, out, strict=True):  # the same request straight to the role's base: the same answer
        alone = mixed.team_of(r.agent).chat([r])[0]
        assert alone.completion_token_ids == c.completion_token_ids
        assert alone.logprobs == pytest.approx(c.logprobs, abs=1e-5)
    again = asyncio.run(mixed.achat(reqs))
    assert [(c.agent, c.model) for c in again] == [(c.agent, c.model) for c in out]
    assert [c.completion_token_ids for c in again] == [c.completion_token_ids for c in out]
    assert mixed.chat([]) == [] and [c.model for c in mixed.chat([_req("writer")])] == ["small-llama"]
    with pytest.raises(UnknownAgentError, match="needs each request's agent"):
        mixed.chat([_req("writer"), ChatRequest(MSG)])
    with pytest.raises(UnknownAgentError, match="unknown agent 'critic'"):
        asyncio.run(mixed.achat([_req("critic")]))


def test_save_and_load_a_version_on_one_role_records_its_base(mixed, small_dir):
    reg = mixed.registry
    v = mixed.save_version("writer", run_id="r1")
    manifest = reg.manifest("writer", v)
    assert manifest["base_name"] == "small-llama"
    assert manifest["base_hash"] == model_content_hash(small_dir) and len(manifest["base_hash"]) == 16
    assert manifest["base_fingerprint"] == model_fingerprint(small_dir)
    assert mixed.load_version("writer", v) == v
    assert mixed.versions() == {"planner": "init", "writer": v} and mixed.slot_versions()["writer"] == v
    assert mixed.chat([_req("writer")])[0].adapter_version == v
    assert mixed.load_version("writer", "init") == "init"
    mixed.adapter_name("writer", v)  # pinned: loaded beside the current one
    mixed.unload_version("writer", v)


def test_an_adapter_of_another_base_is_refused(mixed, tiny_model_dir, small_dir, twin_dir, tmp_path):
    reg = mixed.registry
    planner_v = mixed.save_version("planner")
    writer_v = reg.versions("writer")[-1] if reg.versions("writer") else mixed.save_version("writer")
    # another hidden size: the fingerprints differ
    with pytest.raises(AdapterMismatchError, match="'tiny-llama'.*'small-llama'"):
        Team(small_dir, ["planner"], registry=reg, versions={"planner": planner_v}, lora=LORA)
    # the same shapes, other weights: equal fingerprints, different content hashes
    assert model_fingerprint(twin_dir) == model_fingerprint(small_dir)
    assert model_content_hash(twin_dir) != model_content_hash(small_dir)
    with pytest.raises(AdapterMismatchError, match=r"made for base model 'small-llama' with weights .* 'twin-llama'"):
        Team(twin_dir, ["writer"], registry=reg, versions={"writer": writer_v}, lora=LORA)
    # a manifest from before base_hash existed loads on the fingerprint alone
    old = AdapterRegistry(tmp_path / "old")
    shutil.copytree(reg.path("writer", writer_v), old.root / "writer" / "v1")
    path = old.root / "writer" / "v1" / "manifest.json"
    data = json.loads(path.read_text())
    del data["base_hash"], data["base_name"]
    path.write_text(json.dumps(data))
    with Team(twin_dir, ["writer"], registry=old, versions={"writer": "v1"}, lora=LORA) as team:
        assert team.versions() == {"writer": "v1"}


def test_bases_with_the_same_name_are_told_apart(small_dir, tmp_path):
    assert unique_names(["a", "b", "a", "a"]) == ["a", "b", "a#2", "a#3"]
    copy = tmp_path / "other" / "small-llama"
    shutil.copytree(small_dir, copy)
    with build_team({"x": small_dir, "y": str(copy)}, lora=LORA) as team:
        assert list(team.bases) == ["small-llama", "small-llama#2"]
        assert [c.model for c in team.chat([_req("y", max_tokens=1), _req("x", max_tokens=1)])] == [
            "small-llama#2", "small-llama"]


def test_content_hash_is_memoised_on_disk(small_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("MARFT_LG_CACHE", str(tmp_path / "cache"))
    h = model_content_hash(small_dir)
    memo = json.loads((tmp_path / "cache" / "model-hashes.json").read_text())
    assert list(memo.values()) == [h] and "model.safetensors" in next(iter(memo))
    calls = []
    real = hashlib.sha256
    monkeypatch.setattr(hashlib, "sha256", lambda *a: calls.append(a) or real(*a))
    assert model_content_hash(small_dir) == h and calls == []  # the second call hashes nothing


# --- the server over a mixed team ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def client(mixed):
    from marft_lg.serving.http.server import create_app

    with TestClient(create_app(mixed)) as c:
        yield c


def _chat(client, **body):
    return client.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 3, "seed": 5,
                                                      "ignore_eos": True, "return_token_ids": True, **body})


def test_server_lists_both_bases_and_every_role(client, mixed):
    data = client.get("/v1/models").json()["data"]
    by_id = {m["id"]: m for m in data}
    assert [m["id"] for m in data][:4] == ["tiny-llama", "small-llama", "planner", "writer"]
    assert by_id["tiny-llama"]["parent"] is None and by_id["small-llama"]["root"] == "small-llama"
    assert (by_id["planner"]["root"], by_id["planner"]["parent"]) == ("tiny-llama", "tiny-llama")
    assert (by_id["writer"]["root"], by_id["writer"]["parent"]) == ("small-llama", "small-llama")
    assert by_id["writer@init"]["parent"] == "small-llama"
    for name, base in mixed.bases.items():
        assert by_id[name]["max_model_len"] == base.engine.max_context()
    assert client.get("/v1/adapters").json()["versions"] == mixed.versions()


def test_server_answers_a_role_from_its_base_and_a_base_name_without_adapter(client, mixed):
    r = _chat(client, model="writer", logprobs=True)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["marft"] == {"agent": "writer", "adapter_version": mixed.versions()["writer"], "logprobs_masked": False}
    direct = mixed.team_of("writer").chat([ChatRequest(MSG, agent="writer", max_tokens=3, seed=5, ignore_eos=True)])[0]
    assert body["choices"][0]["token_ids"] == direct.completion_token_ids
    assert len(body["choices"][0]["logprobs"]["content"]) == 3
    r = _chat(client, model="small-llama")
    assert r.status_code == 200, r.text
    base = mixed.bases["small-llama"].chat([ChatRequest(MSG, max_tokens=3, seed=5, ignore_eos=True)])[0]
    assert r.json()["marft"]["adapter_version"] is None
    assert r.json()["choices"][0]["token_ids"] == base.completion_token_ids
    assert _chat(client, model="critic").status_code == 404


def test_server_swaps_a_role_s_adapter_on_its_base(client, mixed):
    reg = mixed.registry
    v = mixed.save_version("planner")
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "planner", "lora_path": str(reg.path("planner", v))})
    assert r.status_code == 200, r.text
    assert r.json()["versions"]["planner"] == v and mixed.team_of("planner").versions() == {"planner": v}
    assert _chat(client, model="planner").json()["marft"]["adapter_version"] == v
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "planner", "version": "init"})
    assert r.status_code == 200 and mixed.versions()["planner"] == "init"


# --- the serve CLI ----------------------------------------------------------------------------------------

def test_serve_parses_agents_with_models():
    from marft_lg.serving.commands import parse_agents

    assert parse_agents("a=X,b", "M") == {"a": "X", "b": "M"}
    assert parse_agents(" a , b = /m/y ", "M") == {"a": "M", "b": "/m/y"}
    assert parse_agents("planner", "embedded:m") == {"planner": "embedded:m"}
    for bad, message in (("a=", "not ROLE or ROLE=MODEL"), ("=X", "not ROLE"), ("a,a=X", "named twice"),
                         (",", "is empty")):
        with pytest.raises(ValueError, match=message):
            parse_agents(bad, "M")


def test_serve_refuses_shared_adapter_on_several_bases_in_one_line(tiny_model_dir, small_dir):
    import typer
    from typer.testing import CliRunner

    from marft_lg.serving.commands import serve

    app = typer.Typer()
    app.command("serve")(serve)
    app.command("noop")(lambda: None)
    r = CliRunner().invoke(app, ["serve", "--agents", f"planner={tiny_model_dir},writer={small_dir}",
                                 "--shared-adapter", "--port", "0"], env={})
    assert r.exit_code == 2
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert lines[-1].startswith("marft-lg serve: shared_adapter=True needs one base model"), r.output
