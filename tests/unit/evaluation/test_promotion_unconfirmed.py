"""A server that takes the swap and dies before the follow-up check: the alias moved, so the record is written and
the command says the alias moved, with its own exit code (4), for promote and rollback alike."""

from __future__ import annotations

import json

import pytest
import typer
from served_registry import Server, live_view
from typer.testing import CliRunner

from marft_lg.evaluation.commands import EXIT_SERVER_NOT_CONFIRMED
from marft_lg.evaluation.promotion import RECORDS, ServerNotConfirmed, promote
from marft_lg.serving.registry.store import AdapterRegistry


def _cli() -> typer.Typer:
    from marft_lg.evaluation.commands import promote as promote_cmd
    from marft_lg.evaluation.commands import rollback as rollback_cmd

    app = typer.Typer()
    app.command("promote")(promote_cmd)
    app.command("rollback")(rollback_cmd)
    return app


def _die_after_alias_write(monkeypatch, method: str, server: Server) -> None:
    """The server stops right after the alias file is written, before `promote` asks it again."""
    real = getattr(AdapterRegistry, method)

    def write_then_die(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        server.stop()
        return out

    monkeypatch.setattr(AdapterRegistry, method, write_then_die)


def _records(registry: AdapterRegistry) -> list[dict]:
    path = registry.root / RECORDS
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_promote_whose_server_dies_before_the_check_is_recorded_and_says_the_alias_moved(
        registry, tiny_model_dir, monkeypatch):
    server = Server(tiny_model_dir, registry)
    try:
        _die_after_alias_write(monkeypatch, "promote", server)
        r = CliRunner().invoke(_cli(), ["promote", "--registry", str(registry.root), "--versions", "planner=v2",
                                        "--server", server.url])
        text = " ".join((r.output + (r.stderr if r.stderr_bytes is not None else "")).split())
        assert r.exit_code == EXIT_SERVER_NOT_CONFIRMED == 4, text
        assert "alias 'live' moved: it now maps {'planner': 'v2'}" in text and "not promoted" not in text
        assert "swapped to {'planner': 'v2', 'writer': 'init'}" in text
        assert registry.alias("live") == {"planner": "v2"}
        (rec,) = _records(registry)
        assert rec["action"] == "promote" and rec["after"] == {"planner": "v2"}
        assert rec["swapped"] == {"planner": "v2"} and "could not be asked" in rec["server_check"]
        server.start()  # restarted, it serves the alias that moved
        assert server.serves() == live_view(registry) == {"planner": "v2", "writer": "init"}
    finally:
        server.stop()


def test_rollback_whose_server_dies_before_the_check_is_recorded_and_says_the_alias_moved(
        registry, tiny_model_dir, monkeypatch):
    server = Server(tiny_model_dir, registry)
    try:
        promote(registry, {"planner": "v1"}, server_url=server.url)
        _die_after_alias_write(monkeypatch, "rollback", server)
        r = CliRunner().invoke(_cli(), ["rollback", "--registry", str(registry.root), "--server", server.url])
        text = " ".join((r.output + (r.stderr if r.stderr_bytes is not None else "")).split())
        assert r.exit_code == EXIT_SERVER_NOT_CONFIRMED, text
        assert "alias 'live' moved: it now maps {}" in text and "not rolled back" not in text
        assert registry.alias("live") == {}
        records = _records(registry)
        assert [x["action"] for x in records] == ["promote", "rollback"]
        assert records[-1]["after"] == {} and records[-1]["server_check"]
        server.start()
        assert server.serves() == live_view(registry) == {"planner": "init", "writer": "init"}
    finally:
        server.stop()


def test_the_library_raises_server_not_confirmed_with_the_record(registry, tiny_model_dir, monkeypatch):
    server = Server(tiny_model_dir, registry)
    try:
        _die_after_alias_write(monkeypatch, "promote", server)
        with pytest.raises(ServerNotConfirmed, match="alias 'live' moved") as info:
            promote(registry, {"writer": "v1"}, server_url=server.url)
        assert info.value.record.after == {"writer": "v1"} == _records(registry)[0]["after"]
    finally:
        server.stop()
