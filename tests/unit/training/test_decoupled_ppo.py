"""Decoupled PPO (``offline_anchor``): a record the current weights did not sample is clipped around the current
policy, weighted by its capped ratio to the policy that sampled it; on-policy records train exactly as before."""

from __future__ import annotations

import copy
import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from marft_lg.training.batch import BaseModel, build_batch
from marft_lg.training.buffer import build_buffer
from marft_lg.training.config import ConfigError, MARFTConfig
from marft_lg.training.policy import LocalPolicy, adapter_parameters
from marft_lg.training.ppo import ppo_update
from marft_lg.training.trainer import MARFTTrainer

ROLES = ["reasoner", "actor"]


def _cfg(**kw):
    base = {"learning_rate": 1.0, "kl_cut": None, "plots": False, "num_minibatches": 1, "ppo_epochs": 1,
            "entropy_coef": 0.0, "max_grad_norm": 1e9, "normalize_advantages": False}
    return MARFTConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    policy = LocalPolicy(tiny_model_dir, ROLES, seed=0, device="cpu")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for role in ROLES:
            for p in adapter_parameters(policy.model, policy.adapter_name(role)):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return policy


@pytest.fixture(scope="module")
def buffer(policy):
    from marft_lg.training.rollout import ChainCollector
    from marft_lg.trajectories.scenarios import Scenario

    def prompt(role, scenario, previous):
        msgs = [{"role": "system", "content": f"You are the {role}."}, {"role": "user", "content": scenario.inputs["q"]}]
        if previous:
            msgs.append({"role": "user", "content": "Reasoner: " + previous[0]["completion"]})
        return msgs

    ds = ChainCollector(policy, ROLES, prompt, max_new_tokens=6).collect(
        [Scenario(f"s{i}", {"q": f"question {i}"}) for i in range(3)], 2, 0, 0)
    rng = np.random.default_rng(0)
    buf = build_buffer(ds, {e: rng.normal(size=2) for e in ds.episode_ids}, policy.tokenizer, max_context=4096)
    # the behaviour log-probs: exactly the current weights' (recomputed), so a shift below is the only difference
    exact = _batch(policy, buf, _cfg(), on_policy=False).proximal
    buf.records = [replace(r, behaviour_logprobs=exact[i].tolist()) for i, r in enumerate(buf.records)]
    return buf


def _batch(policy, buf, cfg, *, on_policy: bool):
    return build_batch(buf, {"": BaseModel(policy.model, policy.tokenizer.pad_token_id)}, cfg, agents=ROLES,
                       adapter_for=lambda r: policy.adapter_name(r.agent), critic=None,
                       on_policy=lambda r: on_policy, current_adapter=lambda r: policy.adapter_name(r.agent))


def _shifted(buf, first_token: float):
    """The buffer with every record's first behaviour log-prob moved by `first_token` nats."""
    out = copy.copy(buf)
    out.records = [replace(r, behaviour_logprobs=[r.behaviour_logprobs[0] + first_token, *r.behaviour_logprobs[1:]])
                   for r in buf.records]
    return out


def _step(policy, batch, cfg):
    """One SGD (lr 1) update of both agents from a copy of the policy: (weight change per role, stats)."""
    model = copy.deepcopy(policy.model)
    names = {r: policy.adapter_name(r) for r in ROLES}
    start = {r: [p.detach().clone() for p in adapter_parameters(model, names[r])] for r in ROLES}
    opts = {r: torch.optim.SGD(adapter_parameters(model, names[r]), lr=cfg.learning_rate) for r in ROLES}
    stats = ppo_update(model, batch, cfg, agents=ROLES, adapter_names=names, optimizers=opts,
                       pad_id=policy.tokenizer.pad_token_id, generator=torch.Generator().manual_seed(0))
    delta = {r: torch.cat([(p.detach() - s).flatten() for p, s in zip(adapter_parameters(model, names[r]), start[r],
                                                                      strict=True)]) for r in ROLES}
    return delta, stats


def test_off_policy_records_are_clipped_around_the_current_policy(policy, buffer):
    stale = _shifted(buffer, -4.0)  # the data's sampler liked each first token e^4 times less than the policy does now
    batch = _batch(policy, stale, _cfg(), on_policy=False)
    assert batch.off_policy == len(batch.trained) == len(buffer.records)
    for i, r in enumerate(buffer.records):  # proximal: the current weights' log-probs, not the recorded ones
        assert torch.allclose(batch.proximal[i], torch.tensor(r.behaviour_logprobs), atol=1e-5)
        assert batch.behaviour[i][0] == pytest.approx(r.behaviour_logprobs[0] - 4.0)
    _, stats = _step(policy, batch, _cfg())
    for role in ROLES:
        st = stats.agents[role]
        assert st.approx_kl == pytest.approx(0.0, abs=1e-5) and st.clip_fraction == 0.0  # nothing moved yet
        assert st.behaviour_gap == pytest.approx(4.0, abs=1e-4) and st.capped_fraction == 1.0

    old = _batch(policy, stale, _cfg(offline_anchor="behaviour"), on_policy=False)
    assert old.off_policy == 0 and all(torch.equal(p, b) for p, b in zip(old.proximal, old.behaviour, strict=True))
    _, stats = _step(policy, old, _cfg(offline_anchor="behaviour"))
    for role in ROLES:  # against the stale log-probs every action's ratio is ~e^4: all clipped
        assert stats.agents[role].clip_fraction == 1.0 and stats.agents[role].approx_kl > 40


@pytest.mark.parametrize(("shift", "cap", "scale"), [(math.log(4), 1.0, 0.25), (-math.log(4), 1.0, 1.0),
                                                     (-math.log(4), 2.0, 2.0), (-1e-5, 1.0, 1.0)])
def test_the_capped_importance_weight_scales_the_gradient(policy, buffer, shift, cap, scale):
    """behaviour = current + `shift` on one token: each record's weight is min(cap, e^-shift) and the step is exactly
    that multiple of the on-policy step (no clipping, no normalisation, no gradient clip). A shift of kernel-noise
    size (a record the current weights sampled under an older version label) is not counted as capped."""
    cfg = _cfg(importance_cap=cap)
    reference, _ = _step(policy, _batch(policy, buffer, cfg, on_policy=True), cfg)
    delta, stats = _step(policy, _batch(policy, _shifted(buffer, shift), cfg, on_policy=False), cfg)
    for role in ROLES:
        assert reference[role].abs().max() > 0
        assert torch.allclose(delta[role], scale * reference[role], rtol=1e-3, atol=1e-7)
        assert stats.agents[role].capped_fraction == (1.0 if shift < -1e-3 else 0.0)


def test_on_policy_records_train_the_same_under_either_anchor(policy, buffer):
    for anchor in ("current", "behaviour"):
        cfg = _cfg(offline_anchor=anchor)
        batch = _batch(policy, buffer, cfg, on_policy=True)
        assert batch.off_policy == 0 and all(p is b for p, b in zip(batch.proximal, batch.behaviour, strict=True))
    a, _ = _step(policy, _batch(policy, buffer, _cfg(), on_policy=True), _cfg())
    b, _ = _step(policy, _batch(policy, buffer, _cfg(offline_anchor="behaviour"), on_policy=True),
                 _cfg(offline_anchor="behaviour"))
    assert all(torch.equal(a[r], b[r]) for r in ROLES)


def test_the_settings_are_checked():
    with pytest.raises(ConfigError, match="offline_anchor"):
        MARFTConfig(offline_anchor="trace")
    with pytest.raises(ConfigError, match="importance_cap"):
        MARFTConfig(importance_cap=0.5)


def _actor_reward(ep):
    a, b = ep.actions[0]["completion_token_ids"], ep.actions[1]["completion_token_ids"]
    return float(bool(a) and bool(b) and a[0] % 2 == b[0] % 2)


def test_offline_iterations_after_an_update_count_their_off_policy_actions(chain_dataset, two_agent_policy, tmp_path):
    """The first offline pass over traces the untuned adapters recorded is on-policy; once an update changed a role,
    its later iterations recompute the proximal log-probs of every action it trains (`off_policy_actions`)."""
    ds, scenarios = chain_dataset
    cfg = MARFTConfig(learning_rate=1e-3, kl_cut=None, plots=False, offline_episodes_per_iteration=3,
                      update_scheme="simultaneous", entropy_surge=1e9, kl_blowup=1e9)
    trainer = MARFTTrainer(two_agent_policy, _actor_reward, cfg, tmp_path / "run", progress=False)
    rows = trainer.fit_offline(ds, scenarios, iterations=2)
    assert rows[0]["updated_agents"] == ROLES
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["off_policy_actions"] == 0 < lines[1]["off_policy_actions"] == lines[1]["trained_actions"]
    assert all(lines[0]["agents"][r]["behaviour_gap"] == pytest.approx(0.0, abs=1e-5) for r in ROLES)
    assert all(lines[1]["agents"][r]["behaviour_gap"] > 0 for r in ROLES)
