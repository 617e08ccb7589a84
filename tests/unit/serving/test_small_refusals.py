"""Small refusals that name their cause: a NUL in `lora_path` (400 with its `param`), `serve --agents` roles the
registry would refuse, `export --out` inside the registry."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from typer.testing import CliRunner

from marft_lg.cli import app
from marft_lg.serving.http.server import _handle, _load
from marft_lg.serving.http.transport import BadRequest
from marft_lg.serving.registry.store import AdapterRegistry


class _Team:
    """What `_load` asks of a served team, over a real (empty) registry."""

    shared_adapter = False

    def __init__(self, root: Path):
        self.registry = AdapterRegistry(root)

    def agents(self) -> list[str]:
        return ["planner"]

    def slot(self, role: str) -> str:
        return role


@pytest.mark.parametrize("path", ["/tmp/reg/planner/v1\x00.txt", "\x00"])
def test_a_nul_in_lora_path_is_a_400_naming_lora_path(tmp_path, path):
    with pytest.raises(BadRequest) as info:
        asyncio.run(_load(_Team(tmp_path / "registry"), {"lora_name": "planner", "lora_path": path}))
    resp = _handle(info.value, adapter_param="lora_path")
    assert resp.status_code == 400 and info.value.param == "lora_path" and b'"param":"lora_path"' in resp.body


def test_a_lora_path_outside_the_registry_names_lora_path(tmp_path):
    with pytest.raises(BadRequest, match="outside the registry root") as info:
        asyncio.run(_load(_Team(tmp_path / "registry"), {"lora_name": "planner", "lora_path": str(tmp_path)}))
    assert info.value.param == "lora_path"


@pytest.mark.parametrize("role", ["plan+ner", "ünïcode", "-dash", "a" * 129, "x:y"])
def test_serve_refuses_agent_roles_the_registry_would_refuse(role):
    from marft_lg.serving.commands import parse_agents

    with pytest.raises(ValueError, match="invalid agent role"):
        parse_agents(f"writer,{role}", "embedded:x")
    assert parse_agents("writer,plan_ner-2", "embedded:x") == {"writer": "embedded:x", "plan_ner-2": "embedded:x"}
    r = CliRunner().invoke(app, ["serve", "--agents", f"writer,{role}", "--port", "0"])
    assert r.exit_code == 2 and "invalid agent role" in r.output


def test_export_refuses_an_out_folder_inside_the_registry(tmp_path):
    reg = tmp_path / "registry"
    AdapterRegistry(reg)
    for out in (reg / "exports" / "planner", reg, tmp_path):
        r = CliRunner().invoke(app, ["export", "planner@live", "--registry", str(reg), "--out", str(out)])
        assert r.exit_code == 1 and "is inside the registry" in r.output, r.output
    assert not (reg / "exports").exists()


def test_a_max_tokens_beyond_the_context_says_so_without_a_negative_count():
    from marft_lg.serving.errors import ContextLengthError

    for prompt in (None, 12):
        msg = str(ContextLengthError(prompt, 1_000_000_000, 8192, "writer", prompt_chars=40, chars_per_token=16))
        assert "max_tokens=1000000000, which leaves no room for a prompt; lower max_tokens below 8192" in msg
        assert "-" not in msg.replace("max_tokens", "")


def test_a_store_holding_only_the_schedulers_table_is_a_job_store(tmp_path):
    import sqlite3

    from marft_lg.jobs.store import JobStore

    with sqlite3.connect(tmp_path / "jobs.sqlite") as db:  # what `marft-lg schedule` leaves before any run
        db.execute("CREATE TABLE scheduler_entries (id TEXT PRIMARY KEY, next_run_time REAL, entry TEXT NOT NULL)")
    JobStore(tmp_path / "jobs.sqlite", foreign_ok=False)  # not refused as another program's file
