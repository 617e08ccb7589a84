"""Promotion and rollback keep registry and server in agreement, or fail saying which side holds what:
damaged versions and versions outside the registry are refused before anything is written, alias flips
are compare-and-swap, and rolling back to ``live = {}`` puts the server back on its initial adapters."""

from __future__ import annotations

import json
import os
import shutil

import httpx
import pytest
import typer
from served_registry import DAMAGED, Server, live_view
from typer.testing import CliRunner

from marft_lg.evaluation.promotion import PromotionError, _Server, promote, read_records
from marft_lg.serving.errors import AliasConflictError
from marft_lg.serving.registry.lora import ADAPTER_WEIGHTS
from marft_lg.serving.registry.store import ALIASES, AdapterRegistry


def _cli():
    from marft_lg.evaluation.commands import promote as promote_cmd
    from marft_lg.evaluation.commands import rollback as rollback_cmd

    app = typer.Typer()
    app.command("promote")(promote_cmd)
    app.command("rollback")(rollback_cmd)
    return app


def test_rollback_to_an_empty_live_puts_the_server_back_on_its_initial_adapters(registry, tiny_model_dir):
    """The probe: after the first promotion ({} -> v2), rollback printed "swapped {}" and the server kept v2."""
    def logprobs(server):
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "model": "planner", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "seed": 1,
            "logprobs": True, "ignore_eos": True})
        return [t["logprob"] for t in r.json()["choices"][0]["logprobs"]["content"]]

    with Server(tiny_model_dir, registry) as server:
        assert server.serves() == {"planner": "init", "writer": "init"}
        initial = logprobs(server)
        rec = promote(registry, {"planner": "v2"}, server_url=server.url)
        assert logprobs(server) != initial
        assert rec.swapped == {"planner": "v2"} and server.serves() == {"planner": "v2", "writer": "init"}
        r = CliRunner().invoke(_cli(), ["rollback", "--registry", str(registry.root), "--server", server.url])
        assert r.exit_code == 0, r.output
        assert "live: {'planner': 'v2'} -> {}" in r.output and "swapped {'planner': 'init'}" in r.output
        assert registry.alias("live") == {}
        assert server.serves() == {"planner": "init", "writer": "init"} == live_view(registry)
        assert logprobs(server) == pytest.approx(initial, abs=1e-6)  # the same initial weights again
        server.restart()  # a restarted server agrees too
        assert server.serves() == live_view(registry)


def test_promote_refuses_a_damaged_version_naming_the_file_and_the_reason(registry, tiny_model_dir):
    damaged = registry.root / DAMAGED[0] / DAMAGED[1] / ADAPTER_WEIGHTS
    with Server(tiny_model_dir, registry) as server:
        promote(registry, {"planner": "v1"}, server_url=server.url)
        before = (registry.root / ALIASES).read_bytes()
        r = CliRunner().invoke(_cli(), ["promote", "--registry", str(registry.root), "--versions", "planner=v3",
                                        "--server", server.url])
        assert r.exit_code == 1 and "not promoted: refusing to promote planner@v3" in r.output, r.output
        assert str(damaged) in r.output and "truncated" in r.output and "swapped" not in r.output
        assert "Traceback" not in r.output
        assert (registry.root / ALIASES).read_bytes() == before
        assert server.serves() == {"planner": "v1", "writer": "init"}
    with pytest.raises(PromotionError, match="refusing to promote planner@v3.*truncated"):
        promote(registry, {"planner": "v3"})  # without a server too
    assert [r["action"] for r in read_records(registry)] == ["promote"]


def test_a_version_directory_linked_out_of_the_registry_is_refused_before_writing(registry, tiny_model_dir, tmp_path):
    outside = tmp_path / "elsewhere" / "v9"
    shutil.copytree(registry.path("planner", "v1"), outside)
    os.symlink(outside, registry.root / "planner" / "v4")
    assert "v4" in registry.versions("planner")
    before = (registry.root / ALIASES).read_bytes() if (registry.root / ALIASES).exists() else None
    r = CliRunner().invoke(_cli(), ["promote", "--registry", str(registry.root), "--versions", "planner=v4"])
    assert r.exit_code == 1 and "escapes registry root" in r.output and "Traceback" not in r.output, r.output
    after = (registry.root / ALIASES).read_bytes() if (registry.root / ALIASES).exists() else None
    assert after == before and registry.alias("live") == {}
    with Server(tiny_model_dir, registry) as server:  # the registry still serves
        assert server.serves() == live_view(registry)


def test_alias_flips_are_compare_and_swap(registry, tiny_model_dir, monkeypatch):
    stale = registry.alias_revision()
    registry.promote({"writer": "v1"})
    with pytest.raises(AliasConflictError, match="changed since it was read"):
        registry.promote({"planner": "v1"}, expect_revision=stale)
    assert registry.alias("live") == {"writer": "v1"}
    # Another writer flips `live` while a promotion is swapping the server: the promotion writes nothing
    # and puts the server on what the alias says now.
    other = AdapterRegistry(registry.root)
    real_load = _Server.load

    def load_while_someone_else_promotes(self, reg, slot, version):
        real_load(self, reg, slot, version)
        if slot == "planner" and version == "v2":
            other.promote({"writer": "v2"}, reason="a concurrent promotion")

    with Server(tiny_model_dir, registry) as server:
        monkeypatch.setattr(_Server, "load", load_while_someone_else_promotes)
        with pytest.raises(PromotionError, match="changed since it was read.*swapped back"):
            promote(registry, {"planner": "v2"}, server_url=server.url)
        assert registry.alias("live") == {"writer": "v2"}
        assert server.serves() == live_view(registry) == {"planner": "init", "writer": "v2"}


def test_a_server_that_follows_another_alias_is_not_swapped(registry, tiny_model_dir):
    registry.set_alias("candidate", {"planner": "v2"})
    with Server(tiny_model_dir, registry, versions="candidate") as server:
        with pytest.raises(PromotionError, match="follows alias 'candidate', not 'live'"):
            promote(registry, {"planner": "v1"}, server_url=server.url)
        assert registry.alias("live") == {} and server.serves() == {"planner": "v2", "writer": "init"}


def test_a_refused_swap_changes_nothing(registry, tiny_model_dir, monkeypatch):
    with Server(tiny_model_dir, registry) as server:
        promote(registry, {"planner": "v1", "writer": "v1"}, server_url=server.url)
        registry.save("critic", registry.path("writer", "v1"),
                      base_fingerprint=registry.manifest("writer", "v1")["base_fingerprint"])
        with pytest.raises(PromotionError, match=r"does not serve \['critic'\].*nothing changed"):
            promote(registry, {"writer": "v2", "critic": "v1"}, server_url=server.url)
        real_load = _Server.load

        def refuse_writer(self, reg, slot, version):  # the server refuses the second role (out of memory, say)
            if (slot, version) == ("writer", "v2"):
                raise PromotionError(f"{self.url} refused to load writer@v2 (HTTP 500): out of memory")
            real_load(self, reg, slot, version)

        monkeypatch.setattr(_Server, "load", refuse_writer)
        with pytest.raises(PromotionError, match="refused to load writer@v2.*nothing changed"):
            promote(registry, {"planner": "v2", "writer": "v2"}, server_url=server.url)
        assert registry.alias("live") == {"planner": "v1", "writer": "v1"}
        assert server.serves() == live_view(registry)  # planner, swapped to v2 first, was swapped back


def test_truncated_alias_file_and_missing_registry_are_one_clear_message(registry, tmp_path):
    runner, app = CliRunner(), _cli()
    missing = tmp_path / "nonexistent" / "reg"
    for cmd in (["promote", "--versions", "planner=v1"], ["rollback"]):
        r = runner.invoke(app, [cmd[0], "--registry", str(missing), *cmd[1:]])
        assert r.exit_code == 1 and f"adapter registry {missing} does not exist" in r.output, r.output
        assert not missing.exists() and not missing.parent.exists()
    registry.promote({"planner": "v1"})
    aliases = registry.root / ALIASES
    aliases.write_bytes(aliases.read_bytes()[:25])
    for cmd in (["promote", "--versions", "planner=v2"], ["rollback"]):
        r = runner.invoke(app, [cmd[0], "--registry", str(registry.root), *cmd[1:]])
        assert r.exit_code == 1 and f"corrupt alias file {aliases}" in r.output and "Traceback" not in r.output, r.output
        assert len([ln for ln in r.output.splitlines() if ln.strip()]) == 1
    aliases.write_text(json.dumps({"aliases": {"live": 5}}))
    r = runner.invoke(app, ["rollback", "--registry", str(registry.root)])
    assert r.exit_code == 1 and f"corrupt alias file {aliases}: aliases.live must map roles to versions" in r.output
