"""Lineage and export on real parts (tiny random base model): the MLflow model registry follows the adapter
registry's `live` through promotion and rollback; an exported adapter loaded by PEFT, and the merged model loaded by
transformers alone, answer the same greedy tokens as the marft_lg engine; a damaged version is refused."""

from __future__ import annotations

import json

import pytest
import torch

torch.set_num_threads(1)

PROMPT = [{"role": "user", "content": "What is 12 + 30?"}]
NEW_TOKENS = 8


def _adapter(model_dir: str, out, seed: int):
    """A LoRA adapter on `model_dir` whose B matrices are random (so it changes the base's answers)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from marft_lg.serving.registry.lora import LoraSettings

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraSettings().to_peft())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def registry(tiny_model_dir, tmp_path_factory):
    """Two published versions of `actor` (lineage logged to an MLflow store), v1 promoted by a gate decision."""
    from pathlib import Path

    from marft_lg.evaluation.gate import GateCheck, GateDecision
    from marft_lg.evaluation.promotion import promote
    from marft_lg.serving.engine.models import model_content_hash, model_fingerprint
    from marft_lg.serving.registry.store import AdapterRegistry
    from marft_lg.tracking.base import open_tracker
    from marft_lg.tracking.lineage import record_published

    root = tmp_path_factory.mktemp("lineage")
    reg = AdapterRegistry(root / "registry")
    tracker = open_tracker(["mlflow"], root / "run", name="train r1")
    tracker.context["data_window"] = {"episodes": 6, "start": "2026-01-01T00:00:00+00:00"}
    for seed in (1, 2):
        v = reg.save("actor", _adapter(tiny_model_dir, root / f"a{seed}", seed), run_id="r1",
                     base_fingerprint=model_fingerprint(tiny_model_dir), base_name=Path(tiny_model_dir).name,
                     base_hash=model_content_hash(tiny_model_dir), metrics={"reward_mean": 0.5 * seed},
                     parent=None if seed == 1 else "v1")
        record_published(tracker, reg, "actor", v, iteration=seed)
    tracker.finish()
    decision = GateDecision(promote=True, reasons=[], gate={"min_pairs": 4},
                            checks=[GateCheck("team_reward_ci_low", True, 0.1, 0.0, "ok")],
                            context={"run_dir": str(root / "compare")})
    promote(reg, {"actor": "v1"}, decision=decision, reason="gate passed")
    return reg, f"sqlite:///{root / 'run' / 'mlflow.db'}"


def _greedy(model, prompt_ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="module")
def engine_answer(registry, tiny_model_dir):
    """(prompt ids, greedy completion ids) of `actor@v1` from marft_lg's own engine."""
    from marft_lg.serving.team import Team
    from marft_lg.serving.types import ChatRequest

    reg, _ = registry
    with Team(tiny_model_dir, ["actor"], registry=reg, versions={"actor": "v1"}) as team:
        done = team.chat([ChatRequest(PROMPT, agent="actor", max_tokens=NEW_TOKENS, temperature=0.0,
                                      ignore_eos=True)])[0]
    return list(done.prompt_token_ids), list(done.completion_token_ids)


def test_mlflow_model_registry_follows_live_through_promote_and_rollback(registry):
    from mlflow import MlflowClient

    from marft_lg.evaluation.promotion import promote, rollback

    reg, uri = registry
    client = MlflowClient(uri, registry_uri=uri)
    live = client.get_model_version_by_alias("marft-actor", "live")
    assert live.tags["registry_version"] == "v1" and live.tags["gate_decision"] == "promote"
    assert live.tags["training_run"] == "r1" and live.source.endswith("adapters/actor/v1")
    promote(reg, {"actor": "v2"}, reason="manual")
    assert client.get_model_version_by_alias("marft-actor", "live").tags["registry_version"] == "v2"
    rollback(reg)
    assert reg.alias("live") == {"actor": "v1"}
    assert client.get_model_version_by_alias("marft-actor", "live").tags["registry_version"] == "v1"
    events = [json.loads(x)["event"] for x in (reg.root / "lineage.jsonl").read_text().splitlines()]
    assert events == ["published", "published", "promote", "promote", "rollback"]


def test_exported_adapter_loads_in_peft_and_answers_as_the_engine(registry, engine_answer, tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from marft_lg.tracking.export import export_version

    reg, _ = registry
    out = export_version(reg.root, "actor@live", tmp_path / "actor")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    card = (out / "README.md").read_text()
    for fact in (reg.manifest("actor", "v1")["base_hash"], "| training run | r1 |", "| iteration | 1 |",
                 "Gate decision: **promote**", '"episodes": 6', "reward_mean: 0.5", "library_name: peft"):
        assert fact in card, fact
    prompt, answer = engine_answer
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert _greedy(base, prompt) != answer, "the adapter must change the answer for this test to mean anything"
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                                      str(out)).eval()
    assert _greedy(model, prompt) == answer


def test_merged_model_loads_in_transformers_alone_and_answers_the_same(registry, engine_answer, tiny_model_dir,
                                                                      tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from marft_lg.tracking.export import export_version

    reg, _ = registry
    with pytest.raises(ValueError, match="pass --base DIR"):
        export_version(reg.root, "actor@v1", tmp_path / "no-base", merged=True)
    out = export_version(reg.root, "actor@v1", tmp_path / "merged", merged=True, base=tiny_model_dir)
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert "library_name: transformers" in (out / "README.md").read_text()
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    prompt, answer = engine_answer
    assert AutoTokenizer.from_pretrained(str(out)).decode(prompt).startswith("<|im_start|>")
    assert _greedy(model, prompt) == answer


def test_a_damaged_version_is_refused_in_one_line(registry, tmp_path):
    from typer.testing import CliRunner

    from marft_lg.cli import app

    reg, _ = registry
    weights = reg.path("actor", "v2") / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    result = CliRunner().invoke(app, ["export", "actor@v2", "--registry", str(reg.root), "--out", str(tmp_path / "x")])
    assert result.exit_code == 1
    lines = [x for x in result.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: refusing to export damaged version actor@v2")
    assert not (tmp_path / "x").exists()
