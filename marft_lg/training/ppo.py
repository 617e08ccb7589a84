"""The MARFT PPO update over one frozen `TrainBatch` (paper App. A `ppo_update`, CleanRL style).

`batch.build_batch` builds the batch once per iteration; `ppo_update` only reads it: for each epoch and
minibatch, per agent being trained, the clipped surrogate (one loss path for both granularities: the
config's `Unit` is a token at token level, a whole action at action level, whose ratio is the sequence
ratio, clipped around the proximal policy and weighted by its capped ratio to the behaviour policy: decoupled
PPO), entropy, optional KL to the reference, gradient accumulation over micro-batches, approx-KL hard
cut, clip, step. `value_update` trains a value head on the batch's cached features with a clipped Huber loss.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from marft_lg.serving.engine.device import model_device
from marft_lg.training.batch import TrainBatch, index_batches, inference_batches, scatter
from marft_lg.training.buffer import collate
from marft_lg.training.config import MARFTConfig
from marft_lg.training.critic import ValueHead, huber_value_loss
from marft_lg.training.policy import adapter_parameters, only_adapter_trainable, token_logprobs
from marft_lg.training.units import Unit, unit_for

_NOISE_NATS = 1e-3
"""A unit whose proximal log-prob exceeds its behaviour one by less than this (kernel noise: records sampled by the
current weights under an older version label) is not counted as capped."""


@dataclass
class AgentStats:
    """What one agent's update did in one iteration (averaged over its minibatches)."""

    policy_loss: float = 0.0
    approx_kl: float = 0.0
    entropy: float = 0.0
    clip_fraction: float = 0.0
    kl_ref: float = 0.0
    behaviour_gap: float = 0.0
    """Mean |log pi_proximal / pi_behaviour| per unit: how far the policy has moved from the one that sampled the
    records (0 on-policy)."""
    capped_fraction: float = 0.0
    """Share of the units whose importance weight hit `importance_cap`."""
    grad_norm: float = 0.0
    steps: int = 0
    skipped_kl_cut: int = 0
    skipped_nonfinite: int = 0
    tokens: int = 0
    minibatches: int = 0


@dataclass
class UpdateStats:
    """What one update did: each agent's stats, the critic's last loss and gradient norm, tokens, non-finite events."""

    agents: dict[str, AgentStats] = field(default_factory=dict)
    value_loss: float = 0.0
    critic_grad_norm: float = 0.0
    explained_variance: float = float("nan")
    tokens: int = 0
    nonfinite: list[str] = field(default_factory=list)


def _policy_loss(model: torch.nn.Module, batch: TrainBatch, idx: list[int], cfg: MARFTConfig, unit: Unit,
                 pad_id: int, n_rows: int, n_tok: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of one micro-batch of an agent's minibatch, scaled so the micro-batch losses sum to the
    minibatch loss (units weighted 1/`n_rows` per action or 1/`n_tok` per token): the gradient does
    not depend on how the minibatch was split."""
    recs = [batch.records[i] for i in idx]
    t = collate(recs, pad_id, model_device(model))
    sel = t["completion_mask"].bool()
    mask = sel.float()
    new_lp, entropy = token_logprobs(model, t["input_ids"], t["attention_mask"], t["completion_mask"],
                                     chunk_size=cfg.logprob_chunk, allowed_bits=batch.mask_bits(idx, t["input_ids"].device))
    old_lp = scatter(sel, [batch.proximal[i] for i in idx])
    beh_lp = scatter(sel, [batch.behaviour[i] for i in idx])
    adv_tok = scatter(sel, [batch.advantages[i] for i in idx])
    words = torch.tensor([float(r.words) for r in recs], device=new_lp.device)
    # one unit per token, or one per action (its ratio is the sequence ratio of its tokens)
    old = unit.reduce(old_lp, mask, words, cfg.logprob_norm)
    logratio = unit.reduce(new_lp, mask, words, cfg.logprob_norm) - old
    # decoupled PPO: clipped around the proximal policy, weighted by its capped ratio to the one that sampled the data
    stale = old - unit.reduce(beh_lp, mask, words, cfg.logprob_norm)
    importance = stale.exp().clamp(max=cfg.importance_cap)
    weight = unit.weights(mask, n_rows, n_tok, new_lp.device)
    adv = unit.advantages(adv_tok, mask)
    ent = (unit.reduce(entropy, mask, norm="token") * weight).sum()
    ratio = logratio.exp()
    lo, hi = 1 - cfg.clip_low, 1 + cfg.clip_high
    pg = (-torch.min(ratio * adv, ratio.clamp(lo, hi) * adv) * importance * weight).sum()
    with torch.no_grad():
        approx_kl = (((ratio - 1) - logratio) * weight).sum()
        clipfrac = (((ratio - 1).abs() > cfg.clip_high).float() * weight).sum()
        behaviour_gap = (stale.abs() * weight).sum()
        capped = ((stale > math.log(cfg.importance_cap) + _NOISE_NATS).float() * weight).sum()
    loss = pg - cfg.entropy_coef * ent
    kl_ref = torch.zeros((), device=new_lp.device)
    if cfg.kl_ref_coef > 0:
        d = (scatter(sel, [batch.reference[i] for i in idx]) - new_lp) * mask
        kl_ref = ((d.exp() - d - 1) * mask).sum() / n_tok
        loss = loss + cfg.kl_ref_coef * kl_ref
    info = {"pg": pg.detach(), "approx_kl": approx_kl, "entropy": ent.detach(), "clipfrac": clipfrac,
            "kl_ref": kl_ref.detach(), "behaviour_gap": behaviour_gap, "capped": capped, "tokens": mask.sum()}
    return loss, info


def _policy_step(model: torch.nn.Module, batch: TrainBatch, idx: list[int], cfg: MARFTConfig, unit: Unit,
                 pad_id: int, agent: str, adapter: str, optimizer: torch.optim.Optimizer, stats: UpdateStats) -> None:
    """One optimizer step of one agent's adapter on its records of a minibatch.

    The records are processed in length-sorted micro-batches with a backward after each, so at most
    one micro-batch's activations are alive, whatever the minibatch size.
    """
    st = stats.agents[agent]
    n_rows, n_tok = len(idx), max(1, sum(batch.records[i].n_tokens for i in idx))
    optimizer.zero_grad(set_to_none=True)
    totals: dict[str, torch.Tensor] = {}
    finite_parts: list[torch.Tensor] = []
    with only_adapter_trainable(model, adapter):
        for mb in index_batches(batch.records, idx, cfg.micro_batch_tokens, groups=cfg.grad_accum_steps):
            loss, info = _policy_loss(model, batch, mb, cfg, unit, pad_id, n_rows, n_tok)
            ok = torch.isfinite(loss.detach())
            finite_parts.append(ok)
            # a non-finite loss is seen after the pass (one host sync per step, not per micro-batch): its
            # gradients are then dropped with the step, and its statistics left out of the totals
            loss.backward()
            del loss
            for k, v in info.items():
                v = torch.where(ok, v, torch.zeros_like(v))
                totals[k] = totals[k] + v if k in totals else v
    keys = list(totals)
    values = torch.stack([*(totals[k].float() for k in keys), torch.stack(finite_parts).all().float()]).tolist()
    mb_info = dict(zip(keys, values[:-1], strict=True))
    finite = bool(values[-1])
    st.minibatches += 1
    tokens = int(mb_info.get("tokens", 0))
    st.tokens += tokens
    stats.tokens += tokens
    st.policy_loss += mb_info.get("pg", 0.0)
    st.approx_kl += mb_info.get("approx_kl", 0.0)
    st.entropy += mb_info.get("entropy", 0.0)
    st.clip_fraction += mb_info.get("clipfrac", 0.0)
    st.kl_ref += mb_info.get("kl_ref", 0.0)
    st.behaviour_gap += mb_info.get("behaviour_gap", 0.0)
    st.capped_fraction += mb_info.get("capped", 0.0)
    if not finite:
        st.skipped_nonfinite += 1
        stats.nonfinite.append(f"{agent}: non-finite policy loss")
    elif cfg.kl_cut is not None and mb_info.get("approx_kl", 0.0) > cfg.kl_cut:
        st.skipped_kl_cut += 1
    else:
        norm = float(torch.nn.utils.clip_grad_norm_(adapter_parameters(model, adapter), cfg.max_grad_norm))
        if not math.isfinite(norm):
            st.skipped_nonfinite += 1
            stats.nonfinite.append(f"{agent}: non-finite gradient norm")
        else:
            optimizer.step()
            st.grad_norm += norm
            st.steps += 1
    optimizer.zero_grad(set_to_none=True)  # no agent's gradients stay alive while the next one trains


def _minibatches(idx: list[int], cfg: MARFTConfig, generator: torch.Generator) -> list[list[int]]:
    perm = torch.randperm(len(idx), generator=generator).tolist()
    shuffled = [idx[i] for i in perm]
    size = max(1, -(-len(shuffled) // cfg.num_minibatches))
    return [shuffled[i:i + size] for i in range(0, len(shuffled), size)]


def ppo_update(model: torch.nn.Module, batch: TrainBatch, cfg: MARFTConfig, *, agents: list[str],
               adapter_names: Mapping[str, str], optimizers: Mapping[str, torch.optim.Optimizer], pad_id: int,
               generator: torch.Generator) -> UpdateStats:
    """The policy update of the given agents (all on `model`'s base; one agent in the sequential scheme).

    Per epoch and minibatch the agents are updated one after another, each on its own records
    against the batch's proximal log-probs (so the simultaneous scheme needs no joint graph);
    each agent's records go through bounded micro-batches (`MARFTConfig.micro_batch_tokens`).
    """
    stats = UpdateStats(agents={a: AgentStats() for a in agents})
    unit = unit_for(cfg)
    idx = batch.indices(agents)
    for _epoch in range(cfg.ppo_epochs):
        for minibatch in _minibatches(idx, cfg, generator):
            for agent in agents:
                mine = [i for i in minibatch if batch.records[i].agent == agent]
                if mine:
                    _policy_step(model, batch, mine, cfg, unit, pad_id, agent, adapter_names[agent],
                                 optimizers[agent], stats)
    for st in stats.agents.values():
        if st.minibatches:
            st.policy_loss /= st.minibatches
            st.approx_kl /= st.minibatches
            st.entropy /= st.minibatches
            st.clip_fraction /= st.minibatches
            st.kl_ref /= st.minibatches
            st.behaviour_gap /= st.minibatches
            st.capped_fraction /= st.minibatches
        if st.steps:
            st.grad_norm /= st.steps
    return stats


def value_update(head: ValueHead, optimizer: torch.optim.Optimizer, batch: TrainBatch, idx: list[int],
                 cfg: MARFTConfig, generator: torch.Generator, stats: UpdateStats) -> None:
    """The value head's epochs over the records at `idx` (cached frozen-base features, clipped Huber loss)."""
    unit = unit_for(cfg)
    for _epoch in range(cfg.ppo_epochs):
        for minibatch in _minibatches(idx, cfg, generator):
            optimizer.zero_grad(set_to_none=True)
            x = unit.value_inputs([batch.features[i] for i in minibatch])
            old = torch.cat([batch.values[i] for i in minibatch])
            ret = torch.cat([batch.returns[i] for i in minibatch])
            loss = cfg.value_coef * huber_value_loss(head(x), old, ret, cfg.value_clip, cfg.huber_delta)
            if not torch.isfinite(loss):
                stats.nonfinite.append("critic: non-finite value loss")
                continue
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.max_grad_norm)
            if not torch.isfinite(norm):
                stats.nonfinite.append("critic: non-finite gradient norm")
                optimizer.zero_grad(set_to_none=True)
                continue
            optimizer.step()
            stats.value_loss = float(loss.detach())
            stats.critic_grad_norm = float(norm)


@torch.no_grad()
def post_update_check(model: torch.nn.Module, batch: TrainBatch, idx: list[int], adapter: str, cfg: MARFTConfig,
                      pad_id: int, batch_size: int = 8) -> tuple[float, float]:
    """(approx KL to the proximal policy, mean token entropy) of the updated adapter on the records at `idx`.

    This is what the collapse checks look at: the in-update KL of the first minibatch is ~0 by
    construction, the policy's distance after the step is not.
    """
    kls, ents, n = 0.0, 0.0, 0
    model.set_adapter(adapter)
    for part in inference_batches(batch.records, idx, cfg, batch_size):
        t = collate([batch.records[i] for i in part], pad_id, model_device(model))
        mask = t["completion_mask"].bool()
        lp, ent = token_logprobs(model, t["input_ids"], t["attention_mask"], t["completion_mask"],
                                 chunk_size=cfg.logprob_chunk, allowed_bits=batch.mask_bits(part, t["input_ids"].device))
        old = torch.cat([batch.proximal[i] for i in part]).to(lp.device)
        logratio = lp[mask] - old
        kls += float(((logratio.exp() - 1) - logratio).sum())
        ents += float(ent[mask].sum())
        n += int(mask.sum())
    return (kls / n, ents / n) if n else (0.0, 0.0)


def explained_variance(batch: TrainBatch, idx: Sequence[int]) -> float:
    """1 - Var(returns - values) / Var(returns) over the rollout values (CleanRL's diagnostic)."""
    if not idx:
        return float("nan")
    v = torch.cat([batch.values[i] for i in idx])
    y = torch.cat([batch.returns[i] for i in idx])
    var_y = y.var(unbiased=False)
    return float("nan") if var_y == 0 else float(1 - (y - v).var(unbiased=False) / var_y)
