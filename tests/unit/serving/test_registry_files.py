"""Registry files and serving configs: a missing registry is not created, a damaged alias file or a value
of the wrong type is one clear error naming the file, LoRA settings YAML errors name ``file:line: key``,
and every registry write goes through the one crash-safe helper (temp file, fsync, rename, fsync dir)."""

from __future__ import annotations

import json
import os
import threading

import pytest
import typer
from typer.testing import CliRunner

from marft_lg import _durable as atomic
from marft_lg.serving.errors import RegistryError
from marft_lg.serving.registry.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoraSettings
from marft_lg.serving.registry.store import ALIASES, AdapterRegistry


def _fake_adapter(d):
    import torch
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    (d / ADAPTER_CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": 2}))
    save_file({"w": torch.zeros(3)}, str(d / ADAPTER_WEIGHTS))
    return d


def _adapters_cli():
    from marft_lg.serving.commands import adapters

    app = typer.Typer()
    app.command("adapters")(adapters)
    app.command("noop")(lambda: None)
    return app


def test_adapters_on_a_missing_registry_fails_and_creates_nothing(tmp_path):
    missing = tmp_path / "nonexistent" / "reg"
    r = CliRunner().invoke(_adapters_cli(), ["adapters", "--registry", str(missing)])
    assert r.exit_code == 1 and f"adapter registry {missing} does not exist" in r.output, r.output
    assert not missing.parent.exists()
    with pytest.raises(RegistryError, match="does not exist"):
        AdapterRegistry(missing, create=False)
    (tmp_path / "file").write_text("")
    with pytest.raises(RegistryError, match="is not a directory"):
        AdapterRegistry(tmp_path / "file")
    assert AdapterRegistry(missing).root == missing.resolve()  # the library default still creates one


@pytest.mark.parametrize("content, detail", [
    ('{"aliases": {"live": {"planner": "v', "corrupt alias file"),
    ('{"aliases": {"live": 5}}', "aliases.live must map roles to versions"),
    ('{"aliases": 5}', "'aliases' must be an object"),
    ('{"aliases": {"live": {"planner": 3}}}', "aliases.live maps 'planner' to 3"),
    ('{"aliases": {}, "history": {"live": {"planner": "v1"}}}', "history.live must be a list"),
    ('{"aliases": {}, "history": {"live": [5]}}', "history.live[0] must map roles to versions"),
    ('{"aliases": {}, "log": {}}', "'log' must be a list"),
    ('[1, 2]', "expected a JSON object"),
    ('{"aliasses": {}}', "unknown keys ['aliasses']"),
])
def test_a_damaged_alias_file_is_one_clear_error_naming_it(tmp_path, content, detail):
    reg = AdapterRegistry(tmp_path / "reg")
    reg.save("planner", _fake_adapter(tmp_path / "src"), base_fingerprint="fp")
    (reg.root / ALIASES).write_text(content)
    with pytest.raises(RegistryError, match="corrupt alias file") as info:
        reg.alias("live")
    assert str(reg.root / ALIASES) in str(info.value) and detail in str(info.value)
    for args in ([], ["--promote", "planner=v1"], ["--rollback"]):
        r = CliRunner().invoke(_adapters_cli(), ["adapters", "--registry", str(reg.root), *args])
        assert r.exit_code == 1 and "Traceback" not in r.output, r.output
        lines = [ln for ln in r.output.splitlines() if ln.strip()]
        assert len(lines) == 1 and str(reg.root / ALIASES) in lines[0] and detail in lines[0], r.output
    assert (reg.root / ALIASES).read_text() == content  # never overwritten


def test_team_versions_of_the_wrong_type_are_refused(tiny_model_dir):
    from marft_lg.serving.team import Team

    for bad in (5, ["live"], {"planner": 3}, ""):
        with pytest.raises(ValueError, match="versions must be an alias name"):
            Team(tiny_model_dir, ["planner"], versions=bad)


def test_lora_settings_yaml_errors_name_file_line_and_key(tmp_path):
    good = tmp_path / "lora.yaml"
    good.write_text("r: 4\nalpha: 8\ntarget_modules: [q_proj, v_proj]\n")
    assert LoraSettings.from_yaml(good) == LoraSettings(r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    good.write_text("target_modules: all-linear\n")  # a string stays a string (peft's regex / all-linear)
    assert LoraSettings.from_yaml(good).target_modules == "all-linear"
    nested = tmp_path / "serve.yaml"
    nested.write_text("model: x\nlora:\n  r: 16\n  dropout: 1.5\n")
    with pytest.raises(ValueError, match=rf"^{nested}:4: lora.dropout: must be >= 0 and < 1, got 1.5$"):
        LoraSettings.from_yaml(nested, section="lora")
    cases = {
        "r: 0\n": ":1: r: must be >= 1, got 0",
        "alpha: 16\nr: eight\n": ":2: r: expected an integer, got str 'eight'",
        "r: true\n": ":1: r: expected an integer, got bool True",
        "alpha: 0\n": ":1: alpha: must be > 0, got 0",
        "target_modules: 5\n": ":1: target_modules: expected a non-empty list of layer names",
        "target_modules: []\n": ":1: target_modules: expected a non-empty list of layer names",
        "bias: some\n": ":1: bias: expected one of ['none', 'all', 'lora_only'], got 'some'",
        "init: 3\n": ":1: init: expected true or false or text, got int 3",
        "r: 4\nrank: 8\n": ":2: rank: unknown LoRA key",
        "- r\n": ": expected a mapping of LoRA settings",
        "r: [4\n": ":2:1: not valid YAML",
    }
    for text, message in cases.items():
        good.write_text(text)
        with pytest.raises(ValueError) as info:
            LoraSettings.from_yaml(good)
        assert str(info.value).startswith(f"{good}{message}"), (text, str(info.value))
    with pytest.raises(ValueError, match="r: must be >= 1"):
        LoraSettings(r=0)
    with pytest.raises(ValueError, match="<dict>: dropout: expected a number"):
        LoraSettings.from_dict({"dropout": "high"})


def test_every_registry_write_goes_through_the_durable_helper(tmp_path, monkeypatch):
    calls: list[tuple[str, object]] = []
    real_fsync = os.fsync

    def fsync(fd):
        calls.append(("fsync", "dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "file"))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    target = tmp_path / "x.json"
    atomic.write_atomic(target, "one")
    assert target.read_text() == "one" and calls == [("fsync", "file"), ("fsync", "dir")]
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]  # no temporary file left
    monkeypatch.setattr(os, "fsync", real_fsync)

    import marft_lg.serving.registry.store as registry_module
    from marft_lg.evaluation.promotion import promote, rollback

    written, appended = [], []
    real_write, real_append = atomic.write_atomic, atomic.append_durable
    monkeypatch.setattr(registry_module, "write_atomic",
                        lambda p, data, **k: written.append(p.name) or real_write(p, data, **k))
    monkeypatch.setattr(atomic, "append_durable", lambda p, text: appended.append(p.name) or real_append(p, text))
    monkeypatch.setattr(atomic, "write_atomic", lambda p, data, **k: written.append(p.name) or real_write(p, data, **k))
    reg = AdapterRegistry(tmp_path / "reg")
    reg.save("planner", _fake_adapter(tmp_path / "src"), base_fingerprint="fp")
    promote(reg, {"planner": "v1"}, run_dir=tmp_path / "run")
    rollback(reg)
    assert written == ["manifest.json", ALIASES, "promote.json", ALIASES]
    assert appended == ["promotions.jsonl", "lineage.jsonl"] * 2  # the adapters' lineage (tracking) too


def test_concurrent_atomic_writes_never_collide(tmp_path):
    target = tmp_path / "aliases.json"
    errors = []

    def writer(k):
        try:
            for i in range(30):
                atomic.write_atomic(target, json.dumps({"writer": k, "i": i}))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and json.loads(target.read_text())["i"] == 29
    assert [p.name for p in tmp_path.iterdir()] == ["aliases.json"]
