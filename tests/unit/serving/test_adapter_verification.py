"""Never serve wrong weights: a damaged registry version is caught before any engine touches it.

The "ghost adapter" probe: a truncated `adapter_model.safetensors` loaded through
`POST /v1/load_lora_adapter` used to leave a zero-weight adapter registered under the version's name
(peft registers an adapter before reading its weights), so `planner@v2` answered with the base
model's log-probs. Each test here damages a copy of a real (tiny-model) registry.
"""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch
import typer
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from marft_lg.serving.errors import AdapterIntegrityError
from marft_lg.serving.registry.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoraSettings
from marft_lg.serving.registry.store import MANIFEST, AdapterRegistry
from marft_lg.serving.team import Team
from marft_lg.serving.types import ChatRequest

LORA = LoraSettings(r=4, init=False)
MSG = [{"role": "user", "content": "Who goes first?"}]


@pytest.fixture(scope="module")
def template(tiny_model_dir, tmp_path_factory):
    """planner v1, v2 (v1's B matrices perturbed) and writer v1, all with integrity records."""
    torch.set_num_threads(1)
    reg = AdapterRegistry(tmp_path_factory.mktemp("template") / "registry")
    with Team(tiny_model_dir, ["planner", "writer"], lora=LORA, registry=reg, versions=None, model_name="tiny") as team:
        team.save_version("planner")
        with team.exclusive() as model:
            for name, p in model.named_parameters():
                if "lora_B" in name and "planner@init" in name:
                    p.data.mul_(3.0)
        team.save_version("planner")
        team.save_version("writer")
    return reg.root


@pytest.fixture()
def reg(template, tmp_path):
    shutil.copytree(template, tmp_path / "registry")
    return AdapterRegistry(tmp_path / "registry")


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def flip_last_byte(path):
    """Change one byte of tensor data: the header still parses, only the content hash can tell."""
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x55
    path.write_bytes(bytes(data))


def weights(reg, role, version):
    return reg.path(role, version) / ADAPTER_WEIGHTS


def test_save_records_the_content_hash_and_the_lora_shape(reg):
    record = reg.manifest("planner", "v1")["integrity"]
    w = weights(reg, "planner", "v1")
    assert record["files"][ADAPTER_WEIGHTS] == {"sha256": hashlib.sha256(w.read_bytes()).hexdigest(),
                                                "bytes": w.stat().st_size}
    assert ADAPTER_CONFIG in record["files"]
    lora = record["lora"]
    assert lora["r"] == 4 and sorted(lora["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    shapes = {k: s for k, (_, s) in lora["tensors"].items()}
    assert shapes["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"] == [4, 64]
    assert shapes["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"] == [64, 4]
    check = reg.verify("planner", "v1")
    assert (check.hash, check.status) == ("ok", "ok")


def test_truncated_weights_are_caught_by_the_header_naming_the_file(reg):
    truncate(weights(reg, "planner", "v2"))
    with pytest.raises(AdapterIntegrityError, match="truncated") as info:
        reg.verify("planner", "v2")
    assert info.value.file == str(weights(reg, "planner", "v2"))
    assert str(weights(reg, "planner", "v2")) in str(info.value)


def test_changed_bytes_are_caught_by_the_recorded_hash(reg):
    flip_last_byte(weights(reg, "planner", "v1"))
    with pytest.raises(AdapterIntegrityError, match="differs from sha256:.*recorded at save time"):
        reg.verify("planner", "v1")


def test_a_version_saved_before_records_is_verified_and_reported_unrecorded(reg):
    for version in ("v1", "v2"):
        p = reg.path("planner", version) / MANIFEST
        manifest = json.loads(p.read_text())
        del manifest["integrity"]
        p.write_text(json.dumps(manifest))
    check = reg.verify("planner", "v1")
    assert (check.hash, check.status) == ("unrecorded", "ok (hash unrecorded)")
    truncate(weights(reg, "planner", "v2"))  # what can be verified still is
    with pytest.raises(AdapterIntegrityError, match="truncated"):
        reg.verify("planner", "v2")


def _lora_dir(path, shapes: dict[str, list[int]], r: int = 4):
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    (path / ADAPTER_CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": 8,
                                                   "target_modules": ["q_proj", "v_proj"]}))
    save_file({k: torch.zeros(s) for k, s in shapes.items()}, str(path / ADAPTER_WEIGHTS))
    return path


def _key(layer, module, which):
    return f"base_model.model.model.layers.{layer}.self_attn.{module}.lora_{which}.weight"


def test_shapes_rank_and_coverage_are_checked_against_the_base_model(reg, tiny_model_dir, tmp_path):
    fp = reg.manifest("planner", "v1")["base_fingerprint"]
    full = {_key(layer, m, w): ([4, 64] if w == "A" else [64, 4]) for layer in (0, 1) for m in ("q_proj", "v_proj")
            for w in "AB"}
    wide = {k: ([4, 128] if k.endswith("lora_A.weight") else [128, 4]) for k in full}  # made for a wider model
    partial = {k: s for k, s in full.items() if ".layers.1." not in k}  # layer 1's weights missing
    assert reg.save("writer", _lora_dir(tmp_path / "wide", wide), base_fingerprint=fp) == "v2"
    assert reg.save("writer", _lora_dir(tmp_path / "partial", partial), base_fingerprint=fp) == "v3"
    with pytest.raises(AdapterIntegrityError, match=r"r=8") as info:  # rank contradicts the config: refused at save
        reg.save("writer", _lora_dir(tmp_path / "rank", full, r=8), base_fingerprint=fp)
    assert info.value.file == str(tmp_path / "rank" / ADAPTER_WEIGHTS)
    with Team(tiny_model_dir, ["writer"], lora=LORA, registry=reg, versions=None) as team:
        with pytest.raises(AdapterIntegrityError, match="do not fit the base layer"):
            team.load_version("writer", "v2")
        with pytest.raises(AdapterIntegrityError, match="no LoRA weights for 2 of the 4 layers"):
            team.load_version("writer", "v3")
        assert team.engine.loaded_adapters() == ["writer@init"]
        assert team.load_version("writer", "v1") == "v1"


def test_a_failed_load_leaves_the_team_exactly_as_it_was(reg, tiny_model_dir):
    with Team(tiny_model_dir, ["planner", "writer"], lora=LORA, registry=reg, versions={"planner": "v1"}) as team:
        req = ChatRequest(MSG, agent="planner", max_tokens=4, seed=3, ignore_eos=True)
        before = team.chat([req])[0]
        loaded = team.engine.loaded_adapters()
        truncate(weights(reg, "planner", "v2"))
        with pytest.raises(AdapterIntegrityError, match="truncated"):
            team.load_version("planner", "v2")
        with pytest.raises(AdapterIntegrityError):  # a pinned request does not load it either
            team.chat([ChatRequest(MSG, agent="planner", version="v2", max_tokens=2)])
        assert team.engine.loaded_adapters() == loaded and team.versions()["planner"] == "v1"
        after = team.chat([req])[0]
        assert (after.adapter_version, after.logprobs) == ("v1", before.logprobs)


def test_the_engine_undoes_a_peft_failure_that_slipped_past_verification(reg, tiny_model_dir, monkeypatch):
    """Defence in depth: if the file changes between verification and peft's read, nothing stays registered."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    import marft_lg.serving.engine.hf as hf

    truncate(weights(reg, "planner", "v2"))
    monkeypatch.setattr(hf, "verify_adapter", lambda *a, **k: None)
    engine = hf.HFEngine(tiny_model_dir)
    try:
        ids = torch.tensor([[1, 2, 3, 4]])
        with torch.inference_mode():
            base = engine.model(input_ids=ids).logits
        with pytest.raises(Exception, match="(?i)header|metadata|deserializ"):  # first adapter: the plain model
            engine.load_adapter("planner@v2", reg.path("planner", "v2"))
        assert not engine.is_peft and engine.loaded_adapters() == []
        assert not any(isinstance(m, BaseTunerLayer) for m in engine.model.modules())
        with torch.inference_mode():
            assert torch.equal(engine.model(input_ids=ids).logits, base)
        engine.load_adapter("planner@v1", reg.path("planner", "v1"))
        with pytest.raises(Exception, match="(?i)header|metadata|deserializ"):  # a further adapter of a PeftModel
            engine.load_adapter("planner@v2", reg.path("planner", "v2"))
        assert engine.loaded_adapters() == ["planner@v1"]
    finally:
        engine.close()


def test_server_answers_400_naming_the_file_and_keeps_serving_the_previous_version(reg, tiny_model_dir):
    """The ghost-adapter probe, through the HTTP API."""
    from marft_lg.serving.http.server import create_app

    with Team(tiny_model_dir, ["planner", "writer"], lora=LORA, registry=reg, versions={"planner": "v1"},
              model_name="tiny") as team:
        client = TestClient(create_app(team))
        truncate(weights(reg, "planner", "v2"))
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "planner", "lora_path": str(reg.path("planner", "v2"))})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == "lora_path"
        assert str(weights(reg, "planner", "v2")) in err["message"] and "truncated" in err["message"]
        ids = {m["id"] for m in client.get("/v1/models").json()["data"]}
        assert "planner@v2" not in ids and "planner@v2" not in team.engine.loaded_adapters()
        r = client.post("/v1/chat/completions", json={"model": "planner@v2", "messages": MSG, "max_tokens": 2})
        assert r.status_code == 400 and "truncated" in r.json()["error"]["message"]  # no base-model answer
        r = client.post("/v1/chat/completions", json={"model": "planner", "messages": MSG, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["marft"]["adapter_version"] == "v1"
        assert client.get("/v1/adapters").json()["adapters"] == {"planner": "v1", "writer": "init"}


def _cli(command, name):
    app = typer.Typer()
    app.command(name)(command)
    app.command("noop")(lambda: None)  # keeps typer in multi-command mode, as in marft_lg/cli.py
    return app


def test_adapters_command_marks_damaged_versions(reg):
    from marft_lg.serving.commands import adapters

    truncate(weights(reg, "planner", "v2"))
    runner, app = CliRunner(), _cli(adapters, "adapters")
    r = runner.invoke(app, ["adapters", "--registry", str(reg.root), "--json"])
    assert r.exit_code == 0, r.output
    rows = {(v["role"], v["version"]): v["integrity"] for v in json.loads(r.stdout)["versions"]}
    assert rows[("planner", "v1")]["status"] == "ok"
    assert rows[("planner", "v2")] == {"status": "damaged", "file": str(weights(reg, "planner", "v2")),
                                       "reason": rows[("planner", "v2")]["reason"]}
    assert "truncated" in rows[("planner", "v2")]["reason"]
    r = runner.invoke(app, ["adapters", "--registry", str(reg.root)])
    assert r.exit_code == 0 and "DAMAGED" in r.output
    assert f"planner/v2 is DAMAGED: {weights(reg, 'planner', 'v2')}" in r.output
    r = runner.invoke(app, ["adapters", "--registry", str(reg.root), "--promote", "planner=v2"])
    assert r.exit_code == 1 and str(weights(reg, "planner", "v2")) in r.output and "Traceback" not in r.output
    assert reg.alias("live") == {}


def test_serve_with_a_damaged_starting_version_exits_2_with_one_line(reg, tiny_model_dir):
    from marft_lg.serving.commands import serve

    reg.promote({"planner": "v2"})
    truncate(weights(reg, "planner", "v2"))
    r = CliRunner().invoke(_cli(serve, "serve"), ["serve", "--model", tiny_model_dir, "--agents", "planner,writer",
                                                  "--registry", str(reg.root), "--port", "0"])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("marft-lg serve: damaged adapter file "), r.output
    assert str(weights(reg, "planner", "v2")) in lines[0] and "Traceback" not in r.output
