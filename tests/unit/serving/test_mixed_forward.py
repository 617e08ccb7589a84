"""A failed mixed-adapter forward must not leave peft's per-call hooks behind (they break every later call)."""

from __future__ import annotations

import pytest
import torch

from marft_lg.serving.engine.mixed_forward import drop_stale_adapter_hooks, mixed_adapter_forward


@pytest.fixture
def two_adapter_model(tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), cfg, adapter_name="first")
    model.add_adapter("second", cfg)
    return model.eval()


def _hooks(model) -> int:
    return sum(len(m._forward_pre_hooks) for m in model.modules())


def test_plain_peft_leaks_hooks_on_error_and_they_can_be_dropped(two_adapter_model):
    model, ids = two_adapter_model, torch.tensor([[5, 6, 7], [8, 9, 10]])
    clean = _hooks(model)
    with torch.no_grad(), pytest.raises(ValueError, match="adapter_names"):
        model(input_ids=ids, adapter_names=["first"])  # one name for two rows: peft raises inside the forward
    assert _hooks(model) > clean  # the failure peft leaves behind
    model.set_adapter("second")
    with torch.no_grad(), pytest.raises(ValueError, match="got 1 and 2"):
        model(input_ids=ids)  # a one-adapter call now runs with the stale list, and fails
    assert drop_stale_adapter_hooks(model) > 0
    assert _hooks(model) == clean


def test_mixed_adapter_forward_cleans_up_after_a_failure(two_adapter_model):
    model, ids = two_adapter_model, torch.tensor([[5, 6, 7], [8, 9, 10]])
    clean = _hooks(model)
    with torch.no_grad():
        with pytest.raises(ValueError, match="adapter_names"):
            mixed_adapter_forward(model, ["first"], input_ids=ids)
        assert _hooks(model) == clean
        mixed = mixed_adapter_forward(model, ["first", "second"], input_ids=ids).logits
        model.set_adapter("first")
        only_a = model(input_ids=ids[:1]).logits
        model.set_adapter("second")
        only_b = model(input_ids=ids[1:]).logits
    torch.testing.assert_close(mixed[0], only_a[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(mixed[1], only_b[0], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(only_a, model(input_ids=ids[:1]).logits)  # the two adapters differ
