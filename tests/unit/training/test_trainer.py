import json

import numpy as np
import pytest
import torch

from marft_lg.training.buffer import build_buffer
from marft_lg.training.config import MARFTConfig
from marft_lg.training.policy import LocalPolicy, adapter_parameters
from marft_lg.training.trainer import MARFTTrainer


def actor_reward(ep):
    """Synthetic: the actor's first token parity must match the reasoner's first token parity."""
    a, b = ep.actions[0]["completion_token_ids"], ep.actions[1]["completion_token_ids"]
    return float(bool(a) and bool(b) and a[0] % 2 == b[0] % 2)


def _weights(policy, adapter):
    return [p.detach().clone() for p in adapter_parameters(policy.model, adapter)]


def _cfg(**kw):
    base = {"learning_rate": 1e-3, "critic_learning_rate": 1e-3, "kl_cut": None, "plots": False,
            "offline_episodes_per_iteration": 3, "entropy_surge": 1e9, "kl_blowup": 1e9}
    base.update(kw)
    return MARFTConfig(**base)


def test_buffer_skips_long_prompts_and_flags_missing_logprobs(chain_dataset, two_agent_policy):
    ds, _ = chain_dataset
    ds.actions.loc[0, "completion_logprobs"] = None
    rewards = {e: np.array([0.0, 1.0]) for e in ds.episode_ids}
    buf = build_buffer(ds, rewards, two_agent_policy.tokenizer, max_context=4096)
    assert len(buf.records) == 12 and buf.n_recomputed == 1
    longest = max(len(p) for p in ds.actions["prompt_token_ids"])
    buf = build_buffer(ds, rewards, two_agent_policy.tokenizer, max_context=longest)
    assert buf.skipped["context"] > 0
    assert sum(r.reward for r in buf.records) == pytest.approx(6.0)  # no reward lost with the skipped actions
    with pytest.raises(ValueError, match="one entry per action"):
        build_buffer(ds, {e: np.array([1.0]) for e in ds.episode_ids}, two_agent_policy.tokenizer, max_context=4096)


def test_offline_sequential_trains_one_agent_per_iteration(chain_dataset, two_agent_policy, tmp_path):
    ds, scenarios = chain_dataset
    ds.actions["completion_logprobs"] = [None if i % 3 == 0 else v for i, v in enumerate(ds.actions["completion_logprobs"])]
    trainer = MARFTTrainer(two_agent_policy, actor_reward, _cfg(), tmp_path / "run", progress=False)
    r0, a0 = _weights(two_agent_policy, "reasoner@v0"), _weights(two_agent_policy, "actor@v0")
    rows = trainer.fit_offline(ds, scenarios, iterations=1)
    assert rows[0]["trained_agents"] == ["reasoner"] and rows[0]["recomputed_logprobs"] > 0
    changed = [not torch.equal(x, y) for x, y in zip(r0, _weights(two_agent_policy, "reasoner@v0"), strict=True)]
    assert any(changed)
    assert all(torch.equal(x, y) for x, y in zip(a0, _weights(two_agent_policy, "actor@v0"), strict=True))
    trainer.fit_offline(ds, scenarios, iterations=2)
    assert not all(torch.equal(x, y) for x, y in zip(a0, _weights(two_agent_policy, "actor@v0"), strict=True))
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in lines] == [0, 1]
    for key in ("reward_mean", "reward_std", "value_loss", "explained_variance", "tokens_per_s", "agents"):
        assert key in lines[-1]
    assert set(lines[-1]["agents"]["actor"]) >= {"policy_loss", "approx_kl", "entropy", "clip_fraction", "grad_norm"}


@pytest.mark.parametrize("kw", [{"granularity": "token", "update_scheme": "simultaneous"},
                                {"use_critic": False, "group_size": 2, "logprob_norm": "word", "kl_ref_coef": 0.1},
                                {"logprob_norm": "token", "grad_accum_steps": 2, "num_minibatches": 2, "ppo_epochs": 2}])
def test_variants_update_and_report_finite_numbers(chain_dataset, two_agent_policy, tmp_path, kw):
    ds, scenarios = chain_dataset
    trainer = MARFTTrainer(two_agent_policy, actor_reward, _cfg(**kw), tmp_path / "run", progress=False)
    before = _weights(two_agent_policy, "reasoner@v0")
    row = trainer.fit_offline(ds, scenarios, iterations=1)[0]
    st = row["agents"]["reasoner"]
    assert st["steps"] > 0 and np.isfinite(st["policy_loss"]) and np.isfinite(st["entropy"])
    assert not all(torch.equal(x, y) for x, y in zip(before, _weights(two_agent_policy, "reasoner@v0"), strict=True))


def test_kl_cut_skips_the_step(chain_dataset, two_agent_policy, tmp_path):
    ds, scenarios = chain_dataset
    ds.actions["completion_logprobs"] = [[v - 1.0 for v in lp] for lp in ds.actions["completion_logprobs"]]
    # log-probs shifted after the fact fail the data check (test_data_checks.py); here they stand for a drifted policy
    trainer = MARFTTrainer(two_agent_policy, actor_reward, _cfg(kl_cut=0.02, verify_logprobs="off"), tmp_path / "run",
                           progress=False)
    before = _weights(two_agent_policy, "reasoner@v0")
    row = trainer.fit_offline(ds, scenarios, iterations=1)[0]
    assert row["agents"]["reasoner"]["skipped_kl_cut"] == 1 and row["agents"]["reasoner"]["steps"] == 0
    assert all(torch.equal(x, y) for x, y in zip(before, _weights(two_agent_policy, "reasoner@v0"), strict=True))


def test_kl_blowup_restores_last_good_adapter(chain_dataset, two_agent_policy, tmp_path):
    ds, scenarios = chain_dataset
    trainer = MARFTTrainer(two_agent_policy, actor_reward, _cfg(learning_rate=1.0, kl_blowup=1e-9),
                           tmp_path / "run", progress=False)
    before = _weights(two_agent_policy, "reasoner@v0")
    row = trainer.fit_offline(ds, scenarios, iterations=1)[0]
    assert row["restored"] and "approx KL" in row["restored"][0]
    assert all(torch.equal(x, y) for x, y in zip(before, _weights(two_agent_policy, "reasoner@v0"), strict=True))


def test_resume_equals_uninterrupted(chain_dataset, tiny_model_dir, tmp_path):
    ds, scenarios = chain_dataset

    def run(run_dir, plan):
        policy = LocalPolicy(tiny_model_dir, ["reasoner", "actor"], seed=0)
        for iterations, resume in plan:
            trainer = MARFTTrainer(policy, actor_reward, _cfg(offline_episodes_per_iteration=2, offline_passes=2),
                                   run_dir, progress=False)
            trainer.fit_offline(ds, scenarios, iterations=iterations, resume=resume)
            policy = LocalPolicy(tiny_model_dir, ["reasoner", "actor"], seed=0)  # a fresh process would start here
        return trainer

    straight = run(tmp_path / "a", [(4, False)])
    resumed = run(tmp_path / "b", [(2, False), (4, True)])
    for role in ("reasoner", "actor"):
        for x, y in zip(adapter_parameters(straight.model, straight.adapter_names[role]),
                        adapter_parameters(resumed.model, resumed.adapter_names[role]), strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
    torch.testing.assert_close(straight.value_head.state_dict(), resumed.value_head.state_dict(), rtol=0, atol=0)
    a = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in b] == [0, 1, 2, 3]
    assert [r["agents"]["reasoner"]["policy_loss"] if "reasoner" in r["agents"] else None for r in a] == \
           [r["agents"]["reasoner"]["policy_loss"] if "reasoner" in r["agents"] else None for r in b]


def test_sequential_turn_goes_to_the_next_role_with_actions(chain_dataset, two_agent_policy, tmp_path):
    ds, scenarios = chain_dataset
    only_actor = type(ds)(episodes=ds.episodes, actions=ds.actions[ds.actions["agent"] == "actor"].copy())
    trainer = MARFTTrainer(two_agent_policy, lambda ep: 1.0, _cfg(), tmp_path / "run", progress=False)
    assert trainer.roles[0] == "reasoner"  # its turn first, but it did not act in these episodes
    rows = trainer.fit_offline(only_actor, scenarios, iterations=1)
    assert rows[0]["trained_agents"] == ["actor"]


