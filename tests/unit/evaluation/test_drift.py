import math

import pytest
import torch
from eval_factory import make_dataset

from marft_lg.evaluation.drift import mean_token_kl, policy_drift
from marft_lg.serving.engine.device import model_device
from marft_lg.serving.engine.mixed_forward import mixed_adapter_forward


@pytest.fixture(scope="module")
def team_and_registry(tiny_model_dir, tmp_path_factory):
    from marft_lg.serving.engine.models import model_fingerprint
    from marft_lg.serving.registry.lora import LoraSettings, write_fresh_adapter
    from marft_lg.serving.registry.store import AdapterRegistry
    from marft_lg.serving.team import Team

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("drift")
    reg = AdapterRegistry(root / "registry")
    fp = model_fingerprint(tiny_model_dir)
    fresh = write_fresh_adapter(tiny_model_dir, LoraSettings(), root / "fresh", seed=1)
    moved = write_fresh_adapter(tiny_model_dir, LoraSettings(init=False), root / "moved", seed=2)
    for role in ("planner", "writer"):
        reg.save(role, fresh, base_fingerprint=fp)  # v1
    reg.save("planner", fresh, base_fingerprint=fp)  # v2: same weights
    reg.save("writer", moved, base_fingerprint=fp)  # v2: different weights
    reg.promote({"planner": "v1", "writer": "v1"})
    team = Team(tiny_model_dir, agents=["planner", "writer"], registry=reg)
    yield team, reg
    team.close()


def _dataset():
    eps = [{"episode_id": f"e{i}", "scenario_id": f"s{i}", "actions": [
        {"agent": "planner", "completion": f"plan number {i}", "messages": [{"role": "user", "content": f"task {i}"}]},
        {"agent": "writer", "completion": f"ANSWER: {i}", "messages": [{"role": "user", "content": f"write {i}"}]},
    ]} for i in range(3)]
    return make_dataset(eps)


def test_drift_flags_only_the_agent_whose_adapter_changed(team_and_registry):
    team, _ = team_and_registry
    drift = policy_drift(team, {"planner": "v1", "writer": "v1"}, {"planner": "v2", "writer": "v2"}, _dataset())
    assert drift["planner"]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert drift["writer"]["kl"] > 1e-4
    assert drift["writer"]["n_prompts"] == 3 and drift["writer"]["n_tokens"] >= 3
    assert drift["writer"]["baseline"] == "v1" and drift["writer"]["candidate"] == "v2"
    assert team.versions() == {"planner": "v1", "writer": "v1"}  # serving untouched


def test_mean_token_kl_matches_a_direct_computation(team_and_registry):
    team, _ = team_and_registry
    a, b = team.adapter_name("writer", "v1"), team.adapter_name("writer", "v2")
    tok = team.tokenizer
    prompt = tok.encode("hello there", add_special_tokens=False)
    completion = tok.encode(" general", add_special_tokens=False)
    with team.exclusive() as model:
        kl, n = mean_token_kl(model, [(prompt, completion)], a, b)
        same, _ = mean_token_kl(model, [(prompt, completion)], b, b)
        base_vs_fresh, _ = mean_token_kl(model, [(prompt, completion)], None, a)
        ids = torch.tensor([prompt + completion], device=model_device(model))
        with torch.no_grad():
            la = torch.log_softmax(mixed_adapter_forward(model, [a], input_ids=ids).logits[0], -1)
            lb = torch.log_softmax(mixed_adapter_forward(model, [b], input_ids=ids).logits[0], -1)
    s = len(prompt) - 1
    expected = float((la[s:s + len(completion)].exp() * (la - lb)[s:s + len(completion)]).sum(-1).mean())
    assert n == len(completion)
    assert kl == pytest.approx(expected, rel=1e-4)
    assert same == pytest.approx(0.0, abs=1e-6) and base_vs_fresh == pytest.approx(0.0, abs=1e-6)


def test_empty_samples_give_nan(team_and_registry):
    team, _ = team_and_registry
    with team.exclusive() as model:
        kl, n = mean_token_kl(model, [([1, 2], [])], None, None)
    assert n == 0 and math.isnan(kl)


@pytest.mark.parametrize("shared_text", ["You are a careful planner. Think step by step.", ""])
def test_mean_token_kl_over_several_samples_matches_per_sample_computation(team_and_registry, shared_text):
    # samples sharing a prompt prefix (run once, cache cut back per sample) and samples sharing none
    team, _ = team_and_registry
    a, b = team.adapter_name("writer", "v1"), team.adapter_name("writer", "v2")
    tok = team.tokenizer
    samples = [(tok.encode(shared_text + q, add_special_tokens=False), tok.encode(c, add_special_tokens=False))
               for q, c in ((" plan a trip", " pack bags"), (" write a poem about rain", " drops"), ("Go", " now then"))]
    with team.exclusive() as model:
        kl, n = mean_token_kl(model, samples, a, b)
        total, count = 0.0, 0
        for prompt, completion in samples:
            ids = torch.tensor([prompt + completion], device=model_device(model))
            with torch.no_grad():
                la = torch.log_softmax(mixed_adapter_forward(model, [a], input_ids=ids).logits[0], -1)
                lb = torch.log_softmax(mixed_adapter_forward(model, [b], input_ids=ids).logits[0], -1)
            s = len(prompt) - 1
            per_token = (la[s:s + len(completion)].exp() * (la - lb)[s:s + len(completion)]).sum(-1)
            total, count = total + float(per_token.sum()), count + len(completion)
    assert n == count
    assert kl == pytest.approx(total / count, rel=1e-4)
