"""AdapterRegistry: versions, manifests, aliases and rollback, crash safety, refusals."""

from __future__ import annotations

import json
import os

import pytest

from marft_lg.serving.errors import AdapterMismatchError, RegistryError
from marft_lg.serving.registry.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from marft_lg.serving.registry.store import AdapterRegistry


def _fake_adapter(d, payload: bytes = b"x"):
    """A directory shaped like a PEFT adapter (the registry copies files; it does not parse weights)."""
    import torch
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    (d / ADAPTER_CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": 2}))
    save_file({"w": torch.tensor(list(payload), dtype=torch.float32)}, str(d / ADAPTER_WEIGHTS))
    return d


def test_save_numbers_versions_and_writes_manifest(tmp_path):
    reg = AdapterRegistry(tmp_path / "reg")
    src = _fake_adapter(tmp_path / "a")
    assert reg.save("planner", src, base_fingerprint="fp1", run_id="run-7", metrics={"reward": 0.5}) == "v1"
    assert reg.save("planner", src, base_fingerprint="fp1", parent="v1") == "v2"
    assert reg.save("writer", src, base_fingerprint="fp1") == "v1"
    assert reg.versions("planner") == ["v1", "v2"]
    assert reg.roles() == ["planner", "writer"]
    m = reg.manifest("planner", "v1")
    assert (m["base_fingerprint"], m["run_id"], m["metrics"], m["parent"]) == ("fp1", "run-7", {"reward": 0.5}, None)
    assert reg.manifest("planner", "latest")["parent"] == "v1"
    assert reg.resolve("planner", "2") == "v2"
    assert (reg.path("planner", "v2") / ADAPTER_WEIGHTS).read_bytes() == (src / ADAPTER_WEIGHTS).read_bytes()


def test_save_from_multi_adapter_peft_model(tmp_path, tiny_model_dir):
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from marft_lg.serving.registry.lora import LoraSettings

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    pm = get_peft_model(base, LoraSettings(r=2, init=False).to_peft(), adapter_name="planner@init")
    pm.add_adapter("writer@init", LoraSettings(r=4, init=False).to_peft())
    reg = AdapterRegistry(tmp_path)
    with pytest.raises(RegistryError, match="adapter_name"):
        reg.save("writer", pm, base_fingerprint="fp")
    v = reg.save("writer", pm, adapter_name="writer@init", base_fingerprint="fp")
    cfg = json.loads((reg.path("writer", v) / ADAPTER_CONFIG).read_text())
    assert cfg["r"] == 4 and sorted(cfg["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    from safetensors.torch import load_file

    saved = load_file(str(reg.path("writer", v) / ADAPTER_WEIGHTS))
    key = next(k for k in saved if "layers.0.self_attn.q_proj.lora_B" in k)
    live = dict(pm.named_parameters())["base_model.model.model.layers.0.self_attn.q_proj.lora_B.writer@init.weight"]
    assert torch.equal(saved[key], live.detach())


def test_aliases_promote_and_rollback_history(tmp_path):
    reg = AdapterRegistry(tmp_path)
    src = _fake_adapter(tmp_path / "src")
    for _ in range(3):
        reg.save("planner", src, base_fingerprint="fp")
    reg.save("writer", src, base_fingerprint="fp")
    assert reg.alias("live") == {}
    reg.promote({"planner": "v1", "writer": "v1"}, reason="first")
    reg.promote({"planner": "v2"}, reason="better")
    assert reg.alias("live") == {"planner": "v2", "writer": "v1"}
    reg.promote({"planner": "latest"})
    assert reg.resolve("planner", "live") == "v3"
    reg.set_alias("candidate", {"planner": "v1"})
    assert reg.rollback("live") == {"planner": "v2", "writer": "v1"}
    assert reg.rollback("live") == {"planner": "v1", "writer": "v1"}
    assert reg.alias("candidate") == {"planner": "v1"}
    assert reg.rollback("live") == {}
    with pytest.raises(RegistryError, match="no earlier state"):
        reg.rollback("live")
    assert [e["reason"] for e in reg.log()][:2] == ["first", "better"]
    with pytest.raises(RegistryError, match="no version 'v9'"):
        reg.promote({"planner": "v9"})
    with pytest.raises(RegistryError, match="shadow"):
        reg.set_alias("v2", {"planner": "v1"})


def test_crash_during_save_leaves_no_version(tmp_path, monkeypatch):
    reg = AdapterRegistry(tmp_path / "reg")
    src = _fake_adapter(tmp_path / "src")
    reg.save("planner", src, base_fingerprint="fp")
    real_rename = os.rename

    def crash(a, b):
        raise OSError("simulated crash before the rename")

    monkeypatch.setattr(os, "rename", crash)
    with pytest.raises(OSError, match="simulated"):
        reg.save("planner", src, base_fingerprint="fp")
    monkeypatch.setattr(os, "rename", real_rename)
    assert reg.versions("planner") == ["v1"]
    assert [p.name for p in (reg.root / "planner").iterdir()] == ["v1"]
    # A half-written directory left by a killed process (no manifest) is never taken for a version.
    (reg.root / "planner" / ".tmp-999-1").mkdir()
    (reg.root / "planner" / "v7").mkdir()
    assert reg.versions("planner") == ["v1"]
    assert reg.save("planner", src, base_fingerprint="fp") == "v2"


def test_crash_during_alias_write_keeps_old_aliases(tmp_path, monkeypatch):
    reg = AdapterRegistry(tmp_path)
    reg.save("planner", _fake_adapter(tmp_path / "src"), base_fingerprint="fp")
    reg.promote({"planner": "v1"})
    before = (reg.root / "aliases.json").read_text()
    monkeypatch.setattr(os, "replace", lambda src, dst: (_ for _ in ()).throw(OSError("crash")))  # the rename
    with pytest.raises(OSError):
        reg.rollback("live")
    assert (reg.root / "aliases.json").read_text() == before
    assert reg.alias("live") == {"planner": "v1"}


def test_base_fingerprint_mismatch_is_refused(tmp_path):
    reg = AdapterRegistry(tmp_path)
    reg.save("planner", _fake_adapter(tmp_path / "src"), base_fingerprint="aaaa")
    assert reg.check_base("planner", "v1", "aaaa") == reg.path("planner", "v1")
    with pytest.raises(AdapterMismatchError, match="made for base model aaaa.*served base model is bbbb"):
        reg.check_base("planner", "v1", "bbbb")


def test_traversal_and_unsafe_names_are_refused(tmp_path):
    reg = AdapterRegistry(tmp_path / "reg")
    reg.save("planner", _fake_adapter(tmp_path / "src"), base_fingerprint="fp")
    outside = _fake_adapter(tmp_path / "outside" / "v1")
    (outside / "manifest.json").write_text("{}")
    for bad in ("../outside", "a/b", "..", ".hidden", "x.y", ""):
        with pytest.raises(RegistryError):
            reg.versions(bad)
    with pytest.raises(RegistryError, match="outside the registry root"):
        reg.locate(reg.root / "planner" / ".." / ".." / "outside" / "v1")
    with pytest.raises(RegistryError, match="outside the registry root"):
        reg.locate(outside)
    (reg.root / "evil").mkdir()
    os.symlink(outside, reg.root / "evil" / "v1")
    with pytest.raises(RegistryError, match="outside the registry root"):
        reg.locate(reg.root / "evil" / "v1")
    assert reg.locate(reg.root / "planner" / "v1") == ("planner", "v1")
    assert reg.locate("planner/v1") == ("planner", "v1")
    with pytest.raises(RegistryError, match="not a registry version"):
        reg.locate(reg.root / "planner")


def test_pickled_weights_are_refused(tmp_path):
    reg = AdapterRegistry(tmp_path / "reg")
    d = tmp_path / "pickled"
    d.mkdir()
    (d / ADAPTER_CONFIG).write_text("{}")
    (d / "adapter_model.bin").write_bytes(b"\x80\x04not really")
    with pytest.raises(AdapterMismatchError, match="never unpickled"):
        reg.save("planner", d, base_fingerprint="fp")
    assert reg.versions("planner") == []


def test_corrupt_alias_file_gives_actionable_error(tmp_path):
    reg = AdapterRegistry(tmp_path)
    (reg.root / "aliases.json").write_text("{not json")
    with pytest.raises(RegistryError, match="corrupt alias file"):
        reg.alias("live")
