"""The MARFT PPO update over one frozen batch (paper App. A `ppo_update`, CleanRL style).

Each iteration, `build_batch` turns the buffer's records into one `TrainBatch`, once:

1. behaviour log-probs: the trace's, or recomputed with the adapter the span names;
2. critic values: frozen-base features -> value head (a head per base, or one on a chosen base);
3. advantages: GAE over each episode's joint ordered actions, whatever base each agent runs on
   (or the group-relative baseline without a critic), normalised over the records being trained;
4. reference log-probs, when the KL-to-reference penalty is on.

`ppo_update` reads only the batch: for each epoch and minibatch, per agent being trained, the clipped
surrogate (one loss path for both granularities: a token is one unit at token level, a whole action
one unit at action level, whose ratio is the sequence ratio), entropy, optional KL to the reference,
gradient accumulation over micro-batches, approx-KL hard cut, clip, step. `value_update` trains a
value head on the batch's cached features with a clipped Huber loss.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

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


@dataclass(frozen=True)
class BaseModel:
    """One base model of the team as the batch builder sees it: the PeftModel holding its adapters."""

    model: torch.nn.Module
    pad_id: int


@dataclass(frozen=True)
class TrainBatch:
    """One iteration's training data, built once by `build_batch` and only read afterwards.

    Every tuple is aligned with `records`. Per record: `behaviour` and `advantages` hold one value per
    completion token (at action level the action's advantage on each of its tokens); `values`,
    `returns` hold the critic's rollout values and targets (one per action, or per token);
    `features` the critic's input; `reference` the reference log-probs (KL penalty on, trained
    records only). `trained` indexes the records of the agents this update trains.
    """

    records: tuple[ActionRecord, ...]
    behaviour: tuple[torch.Tensor, ...]
    advantages: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    returns: tuple[torch.Tensor, ...]
    features: tuple[torch.Tensor | None, ...]
    reference: tuple[torch.Tensor | None, ...]
    trained: tuple[int, ...]

    def indices(self, agents: Sequence[str] | None = None, base: str | None = None) -> list[int]:
        """Indices of the trained records of `agents` (all trained ones when None), on `base` if given."""
        keep = None if agents is None else set(agents)
        return [i for i in self.trained if (keep is None or self.records[i].agent in keep)
                and (base is None or self.records[i].base == base)]


# ---- batching helpers ---------------------------------------------------------------------------

def _length(r: ActionRecord) -> int:
    return len(r.prompt_ids) + r.n_tokens


def _micro_batch_indices(lengths: Sequence[int], max_tokens: int | None, groups: int,
                         max_rows: int | None) -> list[list[int]]:
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n_groups = max(1, min(groups, len(order)))
    bounds = [round(i * len(order) / n_groups) for i in range(n_groups + 1)]
    out: list[list[int]] = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        cur: list[int] = []
        for i in order[lo:hi]:
            too_wide = max_tokens is not None and bool(cur) and lengths[i] * (len(cur) + 1) > max_tokens
            too_many = max_rows is not None and len(cur) >= max_rows
            if too_wide or too_many:
                out.append(cur)
                cur = []
            cur.append(i)
        if cur:
            out.append(cur)
    return out


def micro_batches(records: list[ActionRecord], max_tokens: int | None, *, groups: int = 1,
                  max_rows: int | None = None) -> list[list[ActionRecord]]:
    """Length-sorted micro-batches of `records`: at least `groups` of them, each at most `max_tokens`
    padded tokens (rows x longest row) and `max_rows` rows; an action longer than `max_tokens` is a
    micro-batch of its own.

    Sorting by length first puts rows of similar length together, so little padding is computed.
    The order is deterministic (stable sort by length).
    """
    parts = _micro_batch_indices([_length(r) for r in records], max_tokens, groups, max_rows)
    return [[records[i] for i in part] for part in parts]


def _index_batches(batch_records: Sequence[ActionRecord], idx: Sequence[int], max_tokens: int | None, *,
                   groups: int = 1, max_rows: int | None = None) -> list[list[int]]:
    """`micro_batches` over the records at `idx`, as lists of those indices."""
    parts = _micro_batch_indices([_length(batch_records[i]) for i in idx], max_tokens, groups, max_rows)
    return [[idx[j] for j in part] for part in parts]


def _inference_batches(records: Sequence[ActionRecord], idx: Sequence[int], cfg: MARFTConfig,
                       batch_size: int) -> list[list[int]]:
    """Batches for the no-gradient passes: length-sorted, at most `batch_size` rows and
    `inference_batch_tokens` padded tokens."""
    return _index_batches(records, idx, cfg.inference_batch_tokens, max_rows=batch_size)


def _scatter(mask: torch.Tensor, rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """`[B, T]` float tensor holding row b's values, in order, at the positions where `mask[b]` is set."""
    flat = torch.cat([torch.as_tensor(v, dtype=torch.float32).reshape(-1) for v in rows]).to(mask.device)
    return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_scatter(mask, flat)


# ---- the no-gradient passes that build the batch ------------------------------------------------

@torch.no_grad()
def completion_logprobs(model: torch.nn.Module, records: Sequence[ActionRecord], idx: Sequence[int],
                        cfg: MARFTConfig, pad_id: int, batch_size: int = 8) -> dict[int, torch.Tensor]:
    """`{i: log-probs of records[i]'s completion tokens}` under the model as currently set."""
    out: dict[int, torch.Tensor] = {}
    for part in _inference_batches(records, idx, cfg, batch_size):
        rows = [records[i] for i in part]
        t = collate(rows, pad_id, model_device(model))
        lp, _ = token_logprobs(model, t["input_ids"], t["attention_mask"], t["completion_mask"],
                               chunk_size=cfg.logprob_chunk)
        sel = t["completion_mask"].bool()
        for b, i in enumerate(part):
            out[i] = lp[b][sel[b]].float().cpu()
    return out


def behaviour_logprobs(records: Sequence[ActionRecord], bases: Mapping[str, BaseModel],
                       adapter_for: Callable[[ActionRecord], str], cfg: MARFTConfig) -> list[torch.Tensor]:
    """Behaviour log-probs per record: the trace's, or recomputed with the adapter the span names."""
    out: dict[int, torch.Tensor] = {i: torch.tensor(r.behaviour_logprobs, dtype=torch.float32)
                                    for i, r in enumerate(records) if r.behaviour_logprobs is not None}
    todo: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i, r in enumerate(records):
        if r.behaviour_logprobs is None:
            todo[(r.base, adapter_for(r))].append(i)
    for (base, adapter), idx in todo.items():
        b = bases[base]
        with only_adapter_trainable(b.model, adapter):
            out.update(completion_logprobs(b.model, records, idx, cfg, b.pad_id))
    return [out[i] for i in range(len(records))]


@dataclass(frozen=True)
class Critic:
    """The value heads: one per base (`on` None), or one head on the base `on` that values every record."""

    heads: Mapping[str, ValueHead]
    on: str | None = None

    def base_for(self, record: ActionRecord) -> str:
        return self.on if self.on is not None else record.base


def critic_values(records: Sequence[ActionRecord], bases: Mapping[str, BaseModel], critic: Critic | None,
                  cfg: MARFTConfig, batch_size: int = 8) -> tuple[list[torch.Tensor | None], list[torch.Tensor]]:
    """(features, rollout values) per record: frozen-base features (adapters disabled) through the value head
    of the critic's base; values 0 and no model pass without a critic. Values are `[1]` per action or
    `[n_tokens]` per token. A record valued on another base than its own is read from `critic_prompt_ids`
    (its observation in that base's tokens; action level)."""
    shape = (lambda r: 1) if cfg.granularity == "action" else (lambda r: r.n_tokens)
    if critic is None:
        return [None] * len(records), [torch.zeros(shape(r)) for r in records]
    feats: list[torch.Tensor | None] = [None] * len(records)
    values: list[torch.Tensor] = [torch.zeros(0)] * len(records)
    by_base: dict[str, list[int]] = defaultdict(list)
    for i, r in enumerate(records):
        by_base[critic.base_for(r)].append(i)
    for base, idx in by_base.items():
        b, head = bases[base], critic.heads[base]
        rows = list(records)
        for i in idx:  # a record of another base is read as its observation in this base's tokens
            if rows[i].base != base:
                rows[i] = replace(rows[i], prompt_ids=rows[i].critic_prompt_ids or [], completion_ids=[])
        for part in _inference_batches(rows, idx, cfg, batch_size):
            t = collate([rows[i] for i in part], b.pad_id, model_device(b.model))
            got = critic_features(b.model, t["input_ids"], t["attention_mask"], t["prompt_lens"],
                                  t["completion_mask"], cfg.granularity)
            with torch.no_grad():
                for i, f in zip(part, got, strict=True):
                    feats[i] = f
                    values[i] = head(f).reshape(-1)
    return feats, values


def compute_advantages(records: Sequence[ActionRecord], values: Sequence[torch.Tensor],
                       cfg: MARFTConfig) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(advantages per completion token, returns shaped like `values`) per record.

    GAE runs over each episode's actions in their joint order, across agents and bases; without a
    critic an episode's advantage is its return against the other episodes of its scenario.
    """
    adv: list[torch.Tensor] = [torch.zeros(0)] * len(records)
    ret: list[torch.Tensor] = [torch.zeros(0)] * len(records)
    episodes: dict[str, list[int]] = {}
    for i, r in enumerate(records):
        episodes.setdefault(r.episode_id, []).append(i)
    if not cfg.use_critic:
        ids = list(episodes)
        totals = torch.tensor([sum(records[i].reward for i in episodes[e]) for e in ids])
        groups = [str(records[episodes[e][0]].scenario_id or e) for e in ids]
        for e, a in zip(ids, group_relative_advantages(totals, groups).tolist(), strict=True):
            for i in episodes[e]:
                adv[i] = torch.full((records[i].n_tokens,), a)
                ret[i] = torch.full(values[i].shape, a)
        return adv, ret
    for idx in episodes.values():
        recs = [records[i] for i in idx]
        if cfg.granularity == "action":
            a, g = flat_gae(torch.tensor([r.reward for r in recs]), torch.cat([values[i] for i in idx]),
                            torch.tensor([float(r.done) for r in recs]), cfg.gamma, cfg.gae_lambda)
            for k, i in enumerate(idx):
                adv[i] = torch.full((records[i].n_tokens,), float(a[k]))
                ret[i] = g[k:k + 1]
            continue
        rewards, dones, ends = [], [], []
        for r in recs:
            last = torch.zeros(r.n_tokens)
            last[-1] = 1.0
            rewards.append(last * r.reward)
            ends.append(last)
            dones.append(last * float(r.done))
        a, g = token_gae(torch.cat(rewards), torch.cat([values[i] for i in idx]), torch.cat(dones), torch.cat(ends),
                         cfg.gamma, cfg.gae_lambda, cfg.token_gamma)
        start = 0
        for i in idx:
            n = records[i].n_tokens
            adv[i], ret[i] = a[start:start + n], g[start:start + n]
            start += n
    return adv, ret


def normalize_advantages(advantages: list[torch.Tensor], idx: Sequence[int], granularity: str) -> None:
    """Zero-mean, unit-std advantages over the records at `idx` (per action, or per token), in place."""
    if not idx:
        return
    if granularity == "action":
        a = torch.stack([advantages[i][0] for i in idx])
        if a.numel() < 2:
            return
        a = (a - a.mean()) / (a.std(unbiased=False) + 1e-8)
        for i, v in zip(idx, a.tolist(), strict=True):
            advantages[i] = torch.full_like(advantages[i], v)
        return
    flat = torch.cat([advantages[i] for i in idx])
    if flat.numel() < 2:
        return
    mean, std = flat.mean(), flat.std(unbiased=False) + 1e-8
    for i in idx:
        advantages[i] = (advantages[i] - mean) / std


def reference_logprobs(records: Sequence[ActionRecord], idx: Sequence[int], bases: Mapping[str, BaseModel],
                       cfg: MARFTConfig) -> dict[int, torch.Tensor]:
    """Log-probs of the records at `idx` under the reference (each base with adapters disabled).

    The reference is frozen, so this runs once per iteration instead of once per epoch and minibatch.
    """
    out: dict[int, torch.Tensor] = {}
    by_base: dict[str, list[int]] = defaultdict(list)
    for i in idx:
        by_base[records[i].base].append(i)
    for base, part in by_base.items():
        b = bases[base]
        with b.model.disable_adapter():
            out.update(completion_logprobs(b.model, records, part, cfg, b.pad_id))
    return out


def build_batch(buffer: RolloutBuffer, bases: Mapping[str, BaseModel], cfg: MARFTConfig, *,
                agents: Sequence[str], adapter_for: Callable[[ActionRecord], str],
                critic: Critic | None) -> TrainBatch:
    """The iteration's `TrainBatch`: behaviour log-probs, critic values, advantages (normalised over the
    records of `agents`), reference log-probs; every model pass it needs runs here, once."""
    records = tuple(buffer.records)
    trained = tuple(i for i, r in enumerate(records) if r.agent in set(agents))
    behaviour = behaviour_logprobs(records, bases, adapter_for, cfg)
    features, values = critic_values(records, bases, critic, cfg)
    advantages, returns = compute_advantages(records, values, cfg)
    if cfg.normalize_advantages:
        normalize_advantages(advantages, trained, cfg.granularity)
    ref = reference_logprobs(records, trained, bases, cfg) if cfg.kl_ref_coef > 0 else {}
    return TrainBatch(records=records, behaviour=tuple(behaviour), advantages=tuple(advantages),
                      values=tuple(values), returns=tuple(returns), features=tuple(features),
                      reference=tuple(ref.get(i) for i in range(len(records))), trained=trained)


# ---- the update ---------------------------------------------------------------------------------

def _per_unit(x: torch.Tensor, mask: torch.Tensor, granularity: str, words: torch.Tensor | None = None,
              norm: str = "token") -> torch.Tensor:
    """`[B, T]` token values -> per-unit values: the tokens themselves (`[B, T]`, masked), or one value per
    action (`[B, 1]`: the masked sum, mean (`token`) or sum per word (`word`), as `norm` says)."""
    if granularity == "token":
        return x * mask
    total = (x * mask).sum(-1, keepdim=True)
    if norm == "token":
        return total / mask.sum(-1, keepdim=True).clamp(min=1)
    if norm == "word" and words is not None:
        return total / words[:, None]
    return total


def _policy_loss(model: torch.nn.Module, batch: TrainBatch, idx: list[int], cfg: MARFTConfig, pad_id: int,
                 n_rows: int, n_tok: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of one micro-batch of an agent's minibatch, scaled so the micro-batch losses sum to the
    minibatch loss (units weighted 1/`n_rows` per action or 1/`n_tok` per token): the gradient does
    not depend on how the minibatch was split."""
    recs = [batch.records[i] for i in idx]
    t = collate(recs, pad_id, model_device(model))
    sel = t["completion_mask"].bool()
    mask = sel.float()
    new_lp, entropy = token_logprobs(model, t["input_ids"], t["attention_mask"], t["completion_mask"],
                                     chunk_size=cfg.logprob_chunk)
    old_lp = _scatter(sel, [batch.behaviour[i] for i in idx])
    adv_tok = _scatter(sel, [batch.advantages[i] for i in idx])
    words = torch.tensor([float(r.words) for r in recs], device=new_lp.device)
    g = cfg.granularity
    # one unit per token, or one per action (its ratio is the sequence ratio of its tokens)
    logratio = _per_unit(new_lp, mask, g, words, cfg.logprob_norm) - _per_unit(old_lp, mask, g, words, cfg.logprob_norm)
    weight = mask / n_tok if g == "token" else torch.full((len(recs), 1), 1.0 / n_rows, device=new_lp.device)
    adv = adv_tok if g == "token" else _per_unit(adv_tok, mask, g, norm="token")
    ent = (_per_unit(entropy, mask, g, norm="token") * weight).sum()
    ratio = logratio.exp()
    lo, hi = 1 - cfg.clip_low, 1 + cfg.clip_high
    pg = (-torch.min(ratio * adv, ratio.clamp(lo, hi) * adv) * weight).sum()
    with torch.no_grad():
        approx_kl = (((ratio - 1) - logratio) * weight).sum()
        clipfrac = (((ratio - 1).abs() > cfg.clip_high).float() * weight).sum()
    loss = pg - cfg.entropy_coef * ent
    kl_ref = torch.zeros((), device=new_lp.device)
    if cfg.kl_ref_coef > 0:
        d = (_scatter(sel, [batch.reference[i] for i in idx]) - new_lp) * mask
        kl_ref = ((d.exp() - d - 1) * mask).sum() / n_tok
        loss = loss + cfg.kl_ref_coef * kl_ref
    info = {"pg": pg.detach(), "approx_kl": approx_kl, "entropy": ent.detach(), "clipfrac": clipfrac,
            "kl_ref": kl_ref.detach(), "tokens": mask.sum()}
    return loss, info


def _policy_step(model: torch.nn.Module, batch: TrainBatch, idx: list[int], cfg: MARFTConfig, pad_id: int,
                 agent: str, adapter: str, optimizer: torch.optim.Optimizer, stats: UpdateStats) -> None:
    """One optimizer step of one agent's adapter on its records of a minibatch.

    The records are processed in length-sorted micro-batches with a backward after each, so at most
    one micro-batch's activations are alive, whatever the minibatch size.
    """
    st = stats.agents[agent]
    n_rows, n_tok = len(idx), max(1, sum(batch.records[i].n_tokens for i in idx))
    optimizer.zero_grad(set_to_none=True)
    totals: dict[str, torch.Tensor] = {}
    finite = True
    with only_adapter_trainable(model, adapter):
        for mb in _index_batches(batch.records, idx, cfg.micro_batch_tokens, groups=cfg.grad_accum_steps):
            loss, info = _policy_loss(model, batch, mb, cfg, pad_id, n_rows, n_tok)
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
    st.policy_loss += mb_info.get("pg", 0.0)
    st.approx_kl += mb_info.get("approx_kl", 0.0)
    st.entropy += mb_info.get("entropy", 0.0)
    st.clip_fraction += mb_info.get("clipfrac", 0.0)
    st.kl_ref += mb_info.get("kl_ref", 0.0)
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
    against the rollout's behaviour log-probs (so the simultaneous scheme needs no joint graph);
    each agent's records go through bounded micro-batches (`MARFTConfig.micro_batch_tokens`).
    """
    stats = UpdateStats(agents={a: AgentStats() for a in agents})
    idx = batch.indices(agents)
    for _epoch in range(cfg.ppo_epochs):
        for minibatch in _minibatches(idx, cfg, generator):
            for agent in agents:
                mine = [i for i in minibatch if batch.records[i].agent == agent]
                if mine:
                    _policy_step(model, batch, mine, cfg, pad_id, agent, adapter_names[agent], optimizers[agent],
                                 stats)
    for st in stats.agents.values():
        if st.minibatches:
            st.policy_loss /= st.minibatches
            st.approx_kl /= st.minibatches
            st.entropy /= st.minibatches
            st.clip_fraction /= st.minibatches
            st.kl_ref /= st.minibatches
        if st.steps:
            st.grad_norm /= st.steps
    return stats


def value_update(head: ValueHead, optimizer: torch.optim.Optimizer, batch: TrainBatch, idx: list[int],
                 cfg: MARFTConfig, generator: torch.Generator, stats: UpdateStats) -> None:
    """The value head's epochs over the records at `idx` (cached frozen-base features, clipped Huber loss)."""
    for _epoch in range(cfg.ppo_epochs):
        for minibatch in _minibatches(idx, cfg, generator):
            optimizer.zero_grad(set_to_none=True)
            feats = [batch.features[i] for i in minibatch]
            x = torch.stack(feats) if cfg.granularity == "action" else torch.cat(feats)
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
    """(approx KL to the behaviour policy, mean token entropy) of the updated adapter on the records at `idx`.

    This is what the collapse checks look at: the in-update KL of the first minibatch is ~0 by
    construction, the policy's distance after the step is not.
    """
    kls, ents, n = 0.0, 0.0, 0
    model.set_adapter(adapter)
    for part in _inference_batches(batch.records, idx, cfg, batch_size):
        t = collate([batch.records[i] for i in part], pad_id, model_device(model))
        mask = t["completion_mask"].bool()
        lp, ent = token_logprobs(model, t["input_ids"], t["attention_mask"], t["completion_mask"],
                                 chunk_size=cfg.logprob_chunk)
        old = torch.cat([batch.behaviour[i] for i in part]).to(lp.device)
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
