"""The MARFT PPO update, top to bottom (paper App. A `ppo_update`, CleanRL style).

1. `evaluate_critic`: frozen-base features and values for every record (adapters disabled).
2. `recompute_behaviour`: behaviour log-probs for actions whose trace had none (adapter the span names).
3. `compute_advantages`: GAE over each episode's ordered actions (or the group-relative baseline).
4. `ppo_update`: for each epoch and minibatch, per agent being trained: clipped surrogate + entropy
   (+ optional KL to the reference), gradient accumulation, approx-KL hard cut, clip, step; then
   the value head with a clipped Huber loss.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from marft_lg.serving.device import model_device
from marft_lg.training.buffer import ActionRecord, RolloutBuffer, collate
from marft_lg.training.config import MARFTConfig
from marft_lg.training.critic import ValueHead, critic_features, huber_value_loss
from marft_lg.training.gae import flat_gae, group_relative_advantages, token_gae
from marft_lg.training.policy import adapter_parameters, only_adapter_trainable, token_logprobs


@dataclass
class AgentStats:
    """What one agent's update did in one iteration (averaged over its minibatches)."""

    policy_loss: float = 0.0
    approx_kl: float = 0.0
    entropy: float = 0.0
    clip_fraction: float = 0.0
    kl_ref: float = 0.0
    grad_norm: float = 0.0
    steps: int = 0
    skipped_kl_cut: int = 0
    skipped_nonfinite: int = 0
    tokens: int = 0
    minibatches: int = 0


@dataclass
class UpdateStats:
    agents: dict[str, AgentStats] = field(default_factory=dict)
    value_loss: float = 0.0
    critic_grad_norm: float = 0.0
    explained_variance: float = float("nan")
    tokens: int = 0
    nonfinite: list[str] = field(default_factory=list)


def _batches(records: list[ActionRecord], size: int) -> list[list[ActionRecord]]:
    return [records[i:i + size] for i in range(0, len(records), max(1, size))]


def _length(r: ActionRecord) -> int:
    return len(r.prompt_ids) + r.n_tokens


def micro_batches(records: list[ActionRecord], max_tokens: int | None, *, groups: int = 1,
                  max_rows: int | None = None) -> list[list[ActionRecord]]:
    """Length-sorted micro-batches of `records`: at least `groups` of them, each at most `max_tokens`
    padded tokens (rows x longest row) and `max_rows` rows; an action longer than `max_tokens` is a
    micro-batch of its own.

    Sorting by length first puts rows of similar length together, so little padding is computed.
    The order is deterministic (stable sort by length).
    """
    ordered = sorted(records, key=_length)
    n_groups = max(1, min(groups, len(ordered)))
    bounds = [round(i * len(ordered) / n_groups) for i in range(n_groups + 1)]
    out: list[list[ActionRecord]] = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        cur: list[ActionRecord] = []
        for r in ordered[lo:hi]:
            too_wide = max_tokens is not None and bool(cur) and _length(r) * (len(cur) + 1) > max_tokens
            too_many = max_rows is not None and len(cur) >= max_rows
            if too_wide or too_many:
                out.append(cur)
                cur = []
            cur.append(r)
        if cur:
            out.append(cur)
    return out


def _inference_batches(records: list[ActionRecord], cfg: MARFTConfig, batch_size: int) -> list[list[ActionRecord]]:
    """Batches for the no-gradient passes: length-sorted, at most `batch_size` rows and
    `inference_batch_tokens` padded tokens."""
    return micro_batches(records, cfg.inference_batch_tokens, max_rows=batch_size)


def _scatter(mask: torch.Tensor, rows: list[Any]) -> torch.Tensor:
    """`[B, T]` float tensor holding row b's values, in order, at the positions where `mask[b]` is set."""
    flat = torch.cat([torch.as_tensor(v, dtype=torch.float32).reshape(-1) for v in rows]).to(mask.device)
    return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_scatter(mask, flat)


def evaluate_critic(model: torch.nn.Module, head: ValueHead | None, buffer: RolloutBuffer, cfg: MARFTConfig,
                    pad_id: int, batch_size: int = 8) -> None:
    """Fill `features` and `value`/`token_values` of every record (values 0 without a critic, no model pass)."""
    if head is None:
        for r in buffer.records:
            r.value, r.token_values = 0.0, torch.zeros(r.n_tokens)
        return
    for batch in _inference_batches(buffer.records, cfg, batch_size):
        t = collate(batch, pad_id, model_device(model))
        feats = critic_features(model, t["input_ids"], t["attention_mask"], t["prompt_lens"],
                                t["completion_mask"], cfg.granularity)
        with torch.no_grad():
            for r, f in zip(batch, feats, strict=True):
                r.features = f
                if cfg.granularity == "action":
                    r.value = float(head(f))
                else:
                    r.token_values = head(f)
                    r.value = float(r.token_values[0])


@torch.no_grad()
def recompute_behaviour(model: torch.nn.Module, buffer: RolloutBuffer, adapter_for: Any, cfg: MARFTConfig,
                        pad_id: int, batch_size: int = 8) -> None:
    """Behaviour log-probs for flagged records, with the adapter each span names (`adapter_for(record)`)."""
    todo = [r for r in buffer.records if r.behaviour_logprobs is None]
    by_adapter: dict[str, list[ActionRecord]] = defaultdict(list)
    for r in todo:
        by_adapter[adapter_for(r)].append(r)
    for adapter, recs in by_adapter.items():
        with only_adapter_trainable(model, adapter):
            _fill_logprobs(model, recs, "behaviour_logprobs", cfg, pad_id, batch_size)


def _fill_logprobs(model: torch.nn.Module, records: list[ActionRecord], field: str, cfg: MARFTConfig, pad_id: int,
                   batch_size: int) -> None:
    """Set `record.<field>` to its completion tokens' log-probs under the model as currently set."""
    for batch in _inference_batches(records, cfg, batch_size):
        t = collate(batch, pad_id, model_device(model))
        lp, _ = token_logprobs(model, t["input_ids"], t["attention_mask"], t["completion_mask"],
                               chunk_size=cfg.logprob_chunk)
        for b, r in enumerate(batch):
            setattr(r, field, lp[b][t["completion_mask"][b].bool()].tolist())


@torch.no_grad()
def reference_logprobs(model: torch.nn.Module, records: list[ActionRecord], cfg: MARFTConfig, pad_id: int,
                       batch_size: int = 8) -> None:
    """Fill `ref_logprobs` (base model, adapters disabled) of the records that lack them.

    The reference is frozen, so this runs once per update instead of once per epoch and minibatch.
    """
    todo = [r for r in records if r.ref_logprobs is None]
    if not todo:
        return
    with model.disable_adapter():
        _fill_logprobs(model, todo, "ref_logprobs", cfg, pad_id, batch_size)


def compute_advantages(buffer: RolloutBuffer, cfg: MARFTConfig) -> None:
    """Advantages and returns for every record, episode by episode (GAE or group-relative)."""
    episodes = buffer.episodes()
    if not cfg.use_critic:
        ids = list(episodes)
        totals = torch.tensor([sum(r.reward for r in episodes[e]) for e in ids])
        groups = [str(episodes[e][0].scenario_id or e) for e in ids]
        adv = group_relative_advantages(totals, groups)
        for e, a in zip(ids, adv.tolist(), strict=True):
            for r in episodes[e]:
                r.advantage, r.ret = a, a
                r.token_advantages = torch.full((r.n_tokens,), a)
                r.token_returns = r.token_advantages.clone()
        return
    for recs in episodes.values():
        if cfg.granularity == "action":
            rewards = torch.tensor([r.reward for r in recs])
            values = torch.tensor([r.value for r in recs])
            dones = torch.tensor([float(r.done) for r in recs])
            adv, ret = flat_gae(rewards, values, dones, cfg.gamma, cfg.gae_lambda)
            for r, a, g in zip(recs, adv.tolist(), ret.tolist(), strict=True):
                r.advantage, r.ret = a, g
        else:
            rewards, values, dones, ends = [], [], [], []
            for r in recs:
                n = r.n_tokens
                rw = torch.zeros(n)
                rw[-1] = r.reward
                rewards.append(rw)
                values.append(r.token_values)
                e = torch.zeros(n)
                e[-1] = 1.0
                ends.append(e)
                d = torch.zeros(n)
                d[-1] = float(r.done)
                dones.append(d)
            adv, ret = token_gae(torch.cat(rewards), torch.cat(values), torch.cat(dones), torch.cat(ends),
                                 cfg.gamma, cfg.gae_lambda, cfg.token_gamma)
            start = 0
            for r in recs:
                r.token_advantages, r.token_returns = adv[start:start + r.n_tokens], ret[start:start + r.n_tokens]
                r.advantage, r.ret = float(r.token_advantages[0]), float(r.token_returns[0])
                start += r.n_tokens


def normalize_advantages(records: list[ActionRecord], granularity: str) -> None:
    """Zero-mean, unit-std advantages over the records being trained."""
    if granularity == "action":
        a = torch.tensor([r.advantage for r in records])
        if a.numel() < 2:
            return
        a = (a - a.mean()) / (a.std(unbiased=False) + 1e-8)
        for r, v in zip(records, a.tolist(), strict=True):
            r.advantage = v
    else:
        flat = torch.cat([r.token_advantages for r in records])
        if flat.numel() < 2:
            return
        mean, std = flat.mean(), flat.std(unbiased=False) + 1e-8
        for r in records:
            r.token_advantages = (r.token_advantages - mean) / std


def _action_logp(token_lp: torch.Tensor, mask: torch.Tensor, words: torch.Tensor, norm: str) -> torch.Tensor:
    total = (token_lp * mask).sum(-1)
    if norm == "token":
        return total / mask.sum(-1).clamp(min=1)
    if norm == "word":
        return total / words
    return total


def _policy_loss(model: torch.nn.Module, mb: list[ActionRecord], cfg: MARFTConfig, pad_id: int, n_rows: int,
                 n_tok: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of one micro-batch of an agent's minibatch, scaled so the micro-batch losses sum to the
    minibatch loss (row means over `n_rows` rows, token means over `n_tok` tokens): the gradient
    does not depend on how the minibatch was split."""
    t = collate(mb, pad_id, model_device(model))
    sel = t["completion_mask"].bool()
    mask = sel.float()
    new_lp, entropy = token_logprobs(model, t["input_ids"], t["attention_mask"], t["completion_mask"],
                                     chunk_size=cfg.logprob_chunk)
    old_lp = _scatter(sel, [r.behaviour_logprobs for r in mb])
    lo, hi = 1 - cfg.clip_low, 1 + cfg.clip_high
    if cfg.granularity == "action":
        words = torch.tensor([float(r.words) for r in mb], device=new_lp.device)
        logratio = _action_logp(new_lp, mask, words, cfg.logprob_norm) - _action_logp(old_lp, mask, words, cfg.logprob_norm)
        adv = torch.tensor([r.advantage for r in mb], device=new_lp.device)
        ratio = logratio.exp()
        pg = -torch.min(ratio * adv, ratio.clamp(lo, hi) * adv).sum() / n_rows
        ent = ((entropy * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / n_rows
        with torch.no_grad():
            approx_kl = ((ratio - 1) - logratio).sum() / n_rows
            clipfrac = ((ratio - 1).abs() > cfg.clip_high).float().sum() / n_rows
    else:
        adv_tok = _scatter(sel, [r.token_advantages for r in mb])
        logratio = (new_lp - old_lp) * mask
        ratio = logratio.exp()
        per_tok = -torch.min(ratio * adv_tok, ratio.clamp(lo, hi) * adv_tok)
        pg = (per_tok * mask).sum() / n_tok
        ent = (entropy * mask).sum() / n_tok
        with torch.no_grad():
            approx_kl = (((ratio - 1) - logratio) * mask).sum() / n_tok
            clipfrac = (((ratio - 1).abs() > cfg.clip_high).float() * mask).sum() / n_tok
    loss = pg - cfg.entropy_coef * ent
    kl_ref = torch.zeros((), device=new_lp.device)
    if cfg.kl_ref_coef > 0:
        d = (_scatter(sel, [r.ref_logprobs for r in mb]) - new_lp) * mask
        kl_ref = ((d.exp() - d - 1) * mask).sum() / n_tok
        loss = loss + cfg.kl_ref_coef * kl_ref
    info = {"pg": pg.detach(), "approx_kl": approx_kl, "entropy": ent.detach(), "clipfrac": clipfrac,
            "kl_ref": kl_ref.detach(), "tokens": mask.sum()}
    return loss, info


def _policy_step(model: torch.nn.Module, recs: list[ActionRecord], cfg: MARFTConfig, pad_id: int, agent: str,
                 adapter: str, optimizer: torch.optim.Optimizer, stats: UpdateStats) -> None:
    """One optimizer step of one agent's adapter on its records of a minibatch.

    The records are processed in length-sorted micro-batches (`micro_batches`) with a backward
    after each, so at most one micro-batch's activations are alive, whatever the minibatch size.
    """
    st = stats.agents[agent]
    n_rows, n_tok = len(recs), max(1, sum(r.n_tokens for r in recs))
    optimizer.zero_grad(set_to_none=True)
    totals: dict[str, torch.Tensor] = {}
    finite = True
    with only_adapter_trainable(model, adapter):
        for mb in micro_batches(recs, cfg.micro_batch_tokens, groups=cfg.grad_accum_steps):
            loss, info = _policy_loss(model, mb, cfg, pad_id, n_rows, n_tok)
            if not torch.isfinite(loss):
                finite = False
                break
            loss.backward()
            del loss
            for k, v in info.items():
                totals[k] = totals[k] + v if k in totals else v
    mb_info = {k: float(v) for k, v in totals.items()}
    st.minibatches += 1
    tokens = int(mb_info.get("tokens", 0))
    st.tokens += tokens
    stats.tokens += tokens
    for key, attr in (("pg", "policy_loss"), ("approx_kl", "approx_kl"), ("entropy", "entropy"),
                      ("clipfrac", "clip_fraction"), ("kl_ref", "kl_ref")):
        setattr(st, attr, getattr(st, attr) + mb_info.get(key, 0.0))
    if not finite:
        st.skipped_nonfinite += 1
        stats.nonfinite.append(f"{agent}: non-finite policy loss")
    elif cfg.kl_cut is not None and mb_info.get("approx_kl", 0.0) > cfg.kl_cut:
        st.skipped_kl_cut += 1
    else:
        norm = torch.nn.utils.clip_grad_norm_(adapter_parameters(model, adapter), cfg.max_grad_norm)
        if not torch.isfinite(norm):
            st.skipped_nonfinite += 1
            stats.nonfinite.append(f"{agent}: non-finite gradient norm")
        else:
            optimizer.step()
            st.grad_norm += float(norm)
            st.steps += 1
    optimizer.zero_grad(set_to_none=True)  # no agent's gradients stay alive while the next one trains


def ppo_update(
    model: torch.nn.Module,
    head: ValueHead | None,
    buffer: RolloutBuffer,
    cfg: MARFTConfig,
    *,
    agents: list[str],
    adapter_names: dict[str, str],
    optimizers: dict[str, torch.optim.Optimizer],
    critic_optimizer: torch.optim.Optimizer | None,
    pad_id: int,
    generator: torch.Generator,
) -> UpdateStats:
    """One MARFT update over the buffer for the given agents (one agent in the sequential scheme).

    Per epoch and minibatch the agents are updated one after another, each on its own records
    against the rollout's behaviour log-probs (so the simultaneous scheme needs no joint graph);
    each agent's records go through bounded micro-batches (`MARFTConfig.micro_batch_tokens`).
    """
    stats = UpdateStats(agents={a: AgentStats() for a in agents})
    train_records = [r for r in buffer.records if r.agent in agents]
    if cfg.normalize_advantages:
        normalize_advantages(train_records, cfg.granularity)
    if cfg.kl_ref_coef > 0:
        reference_logprobs(model, train_records, cfg, pad_id)
    for _epoch in range(cfg.ppo_epochs):
        perm = torch.randperm(len(train_records), generator=generator).tolist()
        shuffled = [train_records[i] for i in perm]
        mb_size = max(1, -(-len(shuffled) // cfg.num_minibatches))
        for minibatch in _batches(shuffled, mb_size):
            # --- policy: one adapter at a time, only its tensors get gradients -----------------
            for agent in agents:
                recs = [r for r in minibatch if r.agent == agent]
                if recs:
                    _policy_step(model, recs, cfg, pad_id, agent, adapter_names[agent], optimizers[agent], stats)
            # --- critic: the value head on cached frozen-base features ---------------------------
            if head is not None and critic_optimizer is not None:
                _critic_step(head, critic_optimizer, minibatch, cfg, stats)
    for st in stats.agents.values():
        if st.minibatches:
            for attr in ("policy_loss", "approx_kl", "entropy", "clip_fraction", "kl_ref"):
                setattr(st, attr, getattr(st, attr) / st.minibatches)
        if st.steps:
            st.grad_norm /= st.steps
    if head is not None:
        stats.explained_variance = explained_variance(train_records, cfg.granularity)
    return stats


def _critic_step(head: ValueHead, opt: torch.optim.Optimizer, minibatch: list[ActionRecord], cfg: MARFTConfig,
                 stats: UpdateStats) -> None:
    opt.zero_grad(set_to_none=True)
    if cfg.granularity == "action":
        feats = torch.stack([r.features for r in minibatch])
        old = torch.tensor([r.value for r in minibatch])
        ret = torch.tensor([r.ret for r in minibatch])
    else:
        feats = torch.cat([r.features for r in minibatch])
        old = torch.cat([r.token_values for r in minibatch])
        ret = torch.cat([r.token_returns for r in minibatch])
    loss = cfg.value_coef * huber_value_loss(head(feats), old, ret, cfg.value_clip, cfg.huber_delta)
    if not torch.isfinite(loss):
        stats.nonfinite.append("critic: non-finite value loss")
        return
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.max_grad_norm)
    if not torch.isfinite(norm):
        stats.nonfinite.append("critic: non-finite gradient norm")
        opt.zero_grad(set_to_none=True)
        return
    opt.step()
    stats.value_loss = float(loss.detach())
    stats.critic_grad_norm = float(norm)


@torch.no_grad()
def post_update_check(model: torch.nn.Module, records: list[ActionRecord], adapter: str, cfg: MARFTConfig,
                      pad_id: int, batch_size: int = 8) -> tuple[float, float]:
    """(approx KL to the behaviour policy, mean token entropy) of the updated adapter on its records.

    This is what the collapse checks look at: the in-update KL of the first minibatch is ~0 by
    construction, the policy's distance after the step is not.
    """
    kls, ents, n = 0.0, 0.0, 0
    model.set_adapter(adapter)
    for batch in _inference_batches(records, cfg, batch_size):
        t = collate(batch, pad_id, model_device(model))
        mask = t["completion_mask"].bool()
        lp, ent = token_logprobs(model, t["input_ids"], t["attention_mask"], t["completion_mask"],
                                 chunk_size=cfg.logprob_chunk)
        old = torch.cat([torch.tensor(r.behaviour_logprobs, dtype=torch.float32) for r in batch]).to(lp.device)
        logratio = lp[mask] - old
        kls += float(((logratio.exp() - 1) - logratio).sum())
        ents += float(ent[mask].sum())
        n += int(mask.sum())
    return (kls / n, ents / n) if n else (0.0, 0.0)


def explained_variance(records: list[ActionRecord], granularity: str) -> float:
    """1 - Var(returns - values) / Var(returns) over the rollout values (CleanRL's diagnostic)."""
    if granularity == "action":
        v = torch.tensor([r.value for r in records])
        y = torch.tensor([r.ret for r in records])
    else:
        v = torch.cat([r.token_values for r in records])
        y = torch.cat([r.token_returns for r in records])
    var_y = y.var(unbiased=False)
    return float("nan") if var_y == 0 else float(1 - (y - v).var(unbiased=False) / var_y)
