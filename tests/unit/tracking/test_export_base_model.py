"""An exported adapter names its base model (``base_model_name_or_path``), so PEFT loads it with nothing but the
export folder: also for a role whose adapter peft added to an existing PeftModel (which leaves the field unset),
and for an old registry version that recorded none (then --base supplies it, or the export is refused)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def registry(tiny_model_dir, tmp_path_factory):
    """`actor` and `critic` v1 saved by a Team (the critic's adapter is the second one peft added)."""
    from marft_lg.serving.registry.store import AdapterRegistry
    from marft_lg.serving.team import Team

    reg = AdapterRegistry(tmp_path_factory.mktemp("export-base") / "registry")
    with Team(tiny_model_dir, ["actor", "critic"], registry=reg) as team:
        for role in ("actor", "critic"):
            team.save_version(role)
    return reg


def _base_of(folder: Path) -> str | None:
    return json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"]


def test_every_roles_export_names_its_base_and_peft_loads_it_from_that_alone(registry, tiny_model_dir, tmp_path):
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM

    from marft_lg.tracking.export import export_version

    for role in ("actor", "critic"):
        out = export_version(registry.root, f"{role}@v1", tmp_path / role)
        config = PeftConfig.from_pretrained(str(out))
        assert config.base_model_name_or_path == str(Path(tiny_model_dir).resolve()), role
        assert f"| base model path | {config.base_model_name_or_path} |" in (out / "README.md").read_text()
        base = AutoModelForCausalLM.from_pretrained(config.base_model_name_or_path, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, str(out))
        assert any("lora_A" in name for name, _ in model.named_parameters()), role


def test_a_version_that_recorded_no_base_takes_base_or_is_refused(registry, tiny_model_dir, tmp_path):
    from marft_lg.serving.engine.models import model_content_hash, model_fingerprint
    from marft_lg.tracking.export import ExportError, export_version

    old = tmp_path / "old"
    old.mkdir()
    src = registry.path("critic", "v1")
    config = json.loads((src / "adapter_config.json").read_text())
    (old / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": None}))
    (old / "adapter_model.safetensors").write_bytes((src / "adapter_model.safetensors").read_bytes())
    version = registry.save("writer", old, base_fingerprint=model_fingerprint(tiny_model_dir),
                            base_name=Path(tiny_model_dir).name, base_hash=model_content_hash(tiny_model_dir))
    with pytest.raises(ExportError, match="records no base model folder.*pass --base DIR"):
        export_version(registry.root, f"writer@{version}", tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    out = export_version(registry.root, f"writer@{version}", tmp_path / "given", base=tiny_model_dir)
    assert _base_of(out) == str(Path(tiny_model_dir).resolve())
