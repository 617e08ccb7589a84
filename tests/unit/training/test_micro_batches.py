"""The PPO update runs each agent's minibatch in bounded, length-sorted micro-batches, one agent after another.

What must hold: the update does not depend on how a minibatch is split (same gradient within float
tolerance), no forward of the policy holds more than `micro_batch_tokens` padded tokens and each is
followed by its backward, an agent's step touches only its own adapter, and the simultaneous
scheme gives every agent the same update it would get alone (no joint graph).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from marft_lg.training.batch import BaseModel, build_batch, micro_batches
from marft_lg.training.buffer import ActionRecord, build_buffer
from marft_lg.training.config import ConfigError, MARFTConfig
from marft_lg.training.policy import adapter_parameters, lm_parts
from marft_lg.training.ppo import ppo_update

ROLES = ["reasoner", "actor"]


def _record(i: int, prompt: int, completion: int, agent: str = "a", shared: int = 0) -> ActionRecord:
    """A record whose tokens are its own (`i` first), after a prefix of `shared` tokens common to all."""
    own = [1000 + i] + [1] * (prompt - 1)
    return ActionRecord(episode_id=f"e{i}", scenario_id="s", order=0, agent=agent, adapter_version=None,
                        prompt_ids=[7] * shared + own, completion_ids=[2] * completion,
                        behaviour_logprobs=[0.0] * completion, reward=0.0, done=True, words=1)


def test_micro_batches_are_sorted_bounded_and_cover_every_record_once():
    rng = np.random.default_rng(0)
    recs = [_record(i, int(rng.integers(5, 60)), int(rng.integers(1, 30))) for i in range(40)]
    recs.append(_record(40, 300, 10))  # longer than the budget: a micro-batch of its own
    out = micro_batches(recs, 200, groups=3)
    assert sorted(id(r) for mb in out for r in mb) == sorted(id(r) for r in recs)
    lengths = [len(r.prompt_ids) + r.n_tokens for mb in out for r in mb]
    assert lengths[-1] == 310 and [len(mb) for mb in out][-1] == 1
    for mb in out[:-1]:
        assert len(mb) * max(len(r.prompt_ids) + r.n_tokens for r in mb) <= 200
    assert len(out) >= 3
    # each of the `groups` accumulation chunks is sorted by length, so little padding is computed
    padded = sum(len(mb) * max(len(r.prompt_ids) + r.n_tokens for r in mb) for mb in out)
    assert padded < 1.15 * sum(lengths)
    assert [len(mb) for mb in micro_batches(recs[:7], None, groups=3)] == [2, 3, 2]
    assert [len(mb) for mb in micro_batches(recs[:5], None, max_rows=2)] == [2, 2, 1]


def test_a_shared_prompt_prefix_runs_once_and_is_not_counted_per_row():
    """Rows of one agent start with the same system prompt (few-shot turns, tool schemas), which the forward
    computes once: the budget bounds what the rows add beyond it, so a long shared prefix no longer leaves one
    row per micro-batch, and the update still computes every row."""
    rng = np.random.default_rng(1)
    recs = [_record(i, int(rng.integers(20, 60)), int(rng.integers(1, 30)), shared=1200) for i in range(16)]
    out = micro_batches(recs, 512)
    assert sorted(id(r) for mb in out for r in mb) == sorted(id(r) for r in recs)
    assert 2 <= len(out) <= 4  # padded counting (rows x longest > 1,200) would give 16 micro-batches of one row
    for mb in out:
        longest = max(len(r.prompt_ids) + r.n_tokens for r in mb)
        assert len(mb) * (longest - 1200) <= 512
    # rows sharing fewer than 16 leading tokens are counted whole, rows x longest (60 tokens each)
    assert [len(mb) for mb in micro_batches([_record(i, 40, 10, shared=10) for i in range(8)], 200)] == [3, 3, 2]


def test_config_validates_and_loads_micro_batch_fields(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("micro_batch_tokens: null\ninference_batch_tokens: 512\n")
    cfg = MARFTConfig.from_yaml(p)
    assert cfg.micro_batch_tokens is None and cfg.inference_batch_tokens == 512
    with pytest.raises(ConfigError, match="micro_batch_tokens"):
        MARFTConfig(micro_batch_tokens=0)


def _records(chain_dataset, policy, seed=0):
    ds, _ = chain_dataset
    rng = np.random.default_rng(seed)
    rewards = {e: rng.normal(size=2) for e in ds.episode_ids}
    buf = build_buffer(ds, rewards, policy.tokenizer, max_context=4096)
    # vary the lengths (so micro-batches differ) and move the behaviour policy away from the current one
    buf.records = [replace(r, prompt_ids=r.prompt_ids[: len(r.prompt_ids) - 3 * (k % 4)],
                           behaviour_logprobs=[v + float(rng.normal(0, 0.6)) for v in r.behaviour_logprobs])
                   for k, r in enumerate(buf.records)]
    return buf


def _buffer(chain_dataset, policy, cfg, seed=0, agents=ROLES):
    """The update's frozen batch (records of `agents` trained)."""
    return build_batch(_records(chain_dataset, policy, seed), {"": BaseModel(policy.model, policy.tokenizer.pad_token_id)},
                       cfg, agents=agents, adapter_for=lambda r: policy.adapter_name(r.agent), critic=None)


def _randomise_adapters(policy):
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for role in ROLES:
            for p in adapter_parameters(policy.model, policy.adapter_name(role)):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def _snapshot(policy, role):
    return [p.detach().clone() for p in adapter_parameters(policy.model, policy.adapter_name(role))]


def _sgd_update(policy, buf, cfg, agents):
    """One update with plain SGD (lr 1, no clipping): the weight change is minus the gradient."""
    start = {r: _snapshot(policy, r) for r in ROLES}
    opts = {r: torch.optim.SGD(adapter_parameters(policy.model, policy.adapter_name(r)), lr=1.0) for r in ROLES}
    stats = ppo_update(policy.model, buf, cfg, agents=agents, adapter_names={r: policy.adapter_name(r) for r in ROLES},
                       optimizers=opts, pad_id=policy.tokenizer.pad_token_id, generator=torch.Generator().manual_seed(0))
    delta = {r: [a - b for a, b in zip(_snapshot(policy, r), start[r], strict=True)] for r in ROLES}
    with torch.no_grad():  # put the weights back for the next variant
        for r in ROLES:
            for p, s in zip(adapter_parameters(policy.model, policy.adapter_name(r)), start[r], strict=True):
                p.copy_(s)
    return delta, stats


@pytest.mark.parametrize("kw", [{"granularity": "action", "logprob_norm": "token"},
                                {"granularity": "action", "logprob_norm": "sum", "kl_ref_coef": 0.1},
                                {"granularity": "token", "kl_ref_coef": 0.1}])
def test_micro_batched_update_equals_one_batch(chain_dataset, two_agent_policy, kw):
    _randomise_adapters(two_agent_policy)
    common = {"use_critic": False, "group_size": 2, "kl_cut": None, "max_grad_norm": 1e9, "entropy_coef": 0.05,
              "update_scheme": "simultaneous", **kw}
    whole = MARFTConfig(micro_batch_tokens=None, grad_accum_steps=1, **common)
    buf = _buffer(chain_dataset, two_agent_policy, whole)
    budget = 2 * max(len(r.prompt_ids) + r.n_tokens for r in buf.records)
    split = MARFTConfig(micro_batch_tokens=budget, grad_accum_steps=2, **common)
    assert len(micro_batches([r for r in buf.records if r.agent == "actor"], budget, groups=2)) >= 3
    d_whole, s_whole = _sgd_update(two_agent_policy, buf, whole, ROLES)
    d_split, s_split = _sgd_update(two_agent_policy, buf, split, ROLES)
    for role in ROLES:
        assert any(d.abs().sum() > 0 for d in d_whole[role])
        for a, b in zip(d_whole[role], d_split[role], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        for key in ("policy_loss", "approx_kl", "entropy", "clip_fraction", "kl_ref", "tokens"):
            assert getattr(s_split.agents[role], key) == pytest.approx(getattr(s_whole.agents[role], key), rel=1e-4,
                                                                      abs=1e-7), key
    assert s_whole.agents["actor"].clip_fraction > 0  # the clip is exercised, not only the unclipped branch


def test_every_forward_is_bounded_and_followed_by_its_backward(chain_dataset, two_agent_policy):
    cfg = MARFTConfig(use_critic=False, group_size=2, kl_cut=None, update_scheme="simultaneous", ppo_epochs=2,
                      kl_ref_coef=0.1)
    records = _records(chain_dataset, two_agent_policy)
    budget = 2 * max(len(r.prompt_ids) + r.n_tokens for r in records.records) + 5
    cfg.micro_batch_tokens = budget
    body, _ = lm_parts(two_agent_policy.model)
    events: list[tuple[str, int, bool]] = []

    def on_forward(module, args, kwargs, out):
        if kwargs.get("attention_mask") is None:  # a shared prompt prefix, run once for its micro-batch
            return
        events.append(("F", int(kwargs["input_ids"].numel()), torch.is_grad_enabled()))
        if out.last_hidden_state.requires_grad:
            out.last_hidden_state.register_hook(lambda g: events.append(("B", 0, True)))

    hook = body.register_forward_hook(on_forward, with_kwargs=True)
    try:
        buf = build_batch(records, {"": BaseModel(two_agent_policy.model, two_agent_policy.tokenizer.pad_token_id)}, cfg,
                          agents=ROLES, adapter_for=lambda r: two_agent_policy.adapter_name(r.agent), critic=None)
        _sgd_update(two_agent_policy, buf, cfg, ROLES)
    finally:
        hook.remove()
    grad_events = [e for e in events if e[2]]
    assert grad_events and all(n <= budget for kind, n, _ in grad_events if kind == "F")
    kinds = "".join(k for k, _, _ in grad_events)
    assert kinds == "FB" * (len(kinds) // 2)  # one micro-batch alive at a time
    expected = sum(len(micro_batches([x for x in buf.records if x.agent == r], budget)) for r in ROLES) * cfg.ppo_epochs
    assert len(kinds) // 2 == expected
    # the frozen reference runs once per iteration, as the batch is built (no-grad passes), not once per epoch
    no_grad = [e for e in events if not e[2]]
    assert len(no_grad) == len(micro_batches(list(buf.records), cfg.inference_batch_tokens, max_rows=8))
    assert all(ref is not None and len(ref) == r.n_tokens for r, ref in zip(buf.records, buf.reference, strict=True))


def test_agent_step_touches_only_its_adapter(chain_dataset, two_agent_policy):
    _randomise_adapters(two_agent_policy)
    cfg = MARFTConfig(use_critic=False, group_size=2, kl_cut=None, micro_batch_tokens=120)
    buf = _buffer(chain_dataset, two_agent_policy, cfg)
    base = {n: p.detach().clone() for n, p in two_agent_policy.model.named_parameters() if "lora_" not in n}
    delta, stats = _sgd_update(two_agent_policy, buf, cfg, ["reasoner"])
    assert stats.agents["reasoner"].steps == 1 and set(stats.agents) == {"reasoner"}
    assert any(d.abs().sum() > 0 for d in delta["reasoner"])
    assert all(torch.equal(d, torch.zeros_like(d)) for d in delta["actor"])
    assert all(torch.equal(p, base[n]) for n, p in two_agent_policy.model.named_parameters() if "lora_" not in n)
    assert all(p.grad is None for p in two_agent_policy.model.parameters())  # no gradients left behind


def test_simultaneous_update_equals_each_agent_alone(chain_dataset, two_agent_policy):
    """Agents share the rollout and its behaviour log-probs but not a graph: the joint update is the
    union of the single-agent updates (advantage normalisation off, one minibatch)."""
    _randomise_adapters(two_agent_policy)
    cfg = MARFTConfig(use_critic=False, group_size=2, kl_cut=None, max_grad_norm=1e9, normalize_advantages=False,
                      update_scheme="simultaneous", micro_batch_tokens=120)
    buf = _buffer(chain_dataset, two_agent_policy, cfg)
    joint, _ = _sgd_update(two_agent_policy, buf, cfg, ROLES)
    for role in ROLES:
        alone, _ = _sgd_update(two_agent_policy, buf, cfg, [role])
        for a, b in zip(joint[role], alone[role], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_a_non_finite_micro_batch_drops_its_agents_step_and_keeps_the_statistics_finite(chain_dataset,
                                                                                       two_agent_policy):
    """The finiteness of the loss is read once per step (after the pass, not per micro-batch): a NaN in one
    micro-batch of the actor still skips the actor's whole step, leaves its adapter as it was, keeps its
    statistics finite (that micro-batch left out) and lets the reasoner train."""
    import math

    _randomise_adapters(two_agent_policy)
    cfg = MARFTConfig(use_critic=False, group_size=2, kl_cut=None, max_grad_norm=1e9, micro_batch_tokens=120,
                      update_scheme="simultaneous")
    buf = _buffer(chain_dataset, two_agent_policy, cfg)
    actor = [i for i, r in enumerate(buf.records) if r.agent == "actor"]
    assert len(micro_batches([buf.records[i] for i in actor], 120)) >= 2
    adv = list(buf.advantages)
    adv[actor[0]] = torch.full_like(adv[actor[0]], float("nan"))
    buf = replace(buf, advantages=tuple(adv))
    delta, stats = _sgd_update(two_agent_policy, buf, cfg, ROLES)
    st = stats.agents["actor"]
    assert st.skipped_nonfinite == 1 and st.steps == 0 and stats.nonfinite == ["actor: non-finite policy loss"]
    assert all(torch.equal(d, torch.zeros_like(d)) for d in delta["actor"])
    assert all(math.isfinite(getattr(st, k)) for k in ("policy_loss", "approx_kl", "entropy", "clip_fraction"))
    assert 0 < st.tokens < sum(buf.records[i].n_tokens for i in actor)  # the bad micro-batch's tokens left out
    assert stats.agents["reasoner"].steps == 1 and any(d.abs().sum() > 0 for d in delta["reasoner"])
    assert all(p.grad is None for p in two_agent_policy.model.parameters())
