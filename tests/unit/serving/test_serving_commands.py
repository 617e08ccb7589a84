"""`marft-lg adapters`: list, promote, rollback (through typer's runner, on a registry of copied adapters)."""

from __future__ import annotations

import json

import typer
from typer.testing import CliRunner

from marft_lg.serving.commands import adapters
from marft_lg.serving.registry.store import AdapterRegistry


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command("adapters")(adapters)
    app.command("noop")(lambda: None)  # keeps typer in multi-command mode, as in marft_lg/cli.py
    return app


def test_adapters_list_promote_rollback(tmp_path):
    import torch
    from safetensors.torch import save_file

    src = tmp_path / "src"
    src.mkdir()
    (src / "adapter_config.json").write_text("{}")
    save_file({"w": torch.zeros(2)}, str(src / "adapter_model.safetensors"))
    reg = AdapterRegistry(tmp_path / "reg")
    reg.save("planner", src, base_fingerprint="fp", metrics={"reward": 0.25})
    reg.save("planner", src, base_fingerprint="fp", parent="v1")
    runner, app = CliRunner(), _app()

    r = runner.invoke(app, ["adapters", "--registry", str(reg.root), "--promote", "planner=v2", "--json"])
    assert r.exit_code == 0, r.output
    listing = json.loads(r.stdout)
    assert listing["aliases"] == {"live": {"planner": "v2"}}
    assert [(v["version"], v["aliases"], v["parent"]) for v in listing["versions"]] == [("v1", [], None), ("v2", ["live"], "v1")]

    r = runner.invoke(app, ["adapters", "--registry", str(reg.root), "--rollback"])
    assert r.exit_code == 0, r.output
    assert reg.alias("live") == {}
    r = runner.invoke(app, ["adapters", "--registry", str(reg.root), "--rollback"])
    assert r.exit_code == 1 and "no earlier state" in r.output
    r = runner.invoke(app, ["adapters", "--registry", str(reg.root), "--promote", "planner=v7"])
    assert r.exit_code == 1 and "no version 'v7'" in r.output
    r = runner.invoke(app, ["adapters", "--registry", str(reg.root)])
    assert r.exit_code == 0 and "reward=0.25" in r.output
