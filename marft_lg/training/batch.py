"""One iteration's frozen `TrainBatch`, built once from the buffer's records by `build_batch`:

1. behaviour log-probs: the trace's, or recomputed with the adapter the span names; and the proximal ones each
   ratio is clipped around (the current policy's for the records it did not sample: decoupled PPO);
2. critic values: frozen-base features -> value head (a head per base, or one on a chosen base);
3. advantages: GAE over each episode's joint ordered actions, whatever base each agent runs on
   (or the group-relative baseline without a critic), normalised over the records being trained;
4. reference log-probs, when the KL-to-reference penalty is on.

A constrained action (decoded under a grammar, `marft_lg.constraints`) gets its token masks here too: every
log-prob of it, behaviour, reference or updated, is taken under the distribution its grammar allowed.

The data is checked here as well (`training.checks`): a constrained completion its grammar rejects, and an on-policy
record whose recomputed log-probs differ from the recorded ones, are named `DataProblem`s, left out of `trained`.

Also the length-sorted micro-batching every model pass over records goes through (here and in `ppo`).
What depends on the action/token unit is asked of the config's `Unit` (`units.unit_for`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from marft_lg.constraints import Grammars, label, load_constraint
from marft_lg.serving.engine.device import model_device
from marft_lg.training.buffer import ActionRecord, RolloutBuffer, collate
from marft_lg.training.checks import DataProblem, grammar_rejection, logprob_mismatch
from marft_lg.training.config import MARFTConfig
from marft_lg.training.critic import ValueHead, critic_features
from marft_lg.training.gae import group_relative_advantages
from marft_lg.training.policy import only_adapter_trainable, token_logprobs
from marft_lg.training.shared_prefix import common_length, row_positions
from marft_lg.training.units import unit_for
from marft_lg.trajectories.dataset import scenario_key


@dataclass(frozen=True)
class BaseModel:
    """One base model of the team as the batch builder sees it: the PeftModel holding its adapters."""

    model: torch.nn.Module
    pad_id: int
    grammars: Any = None
    """`Grammars` (or `LazyGrammars`) of this base's tokenizer, for the token masks of constrained actions."""
    tokenizer: Any = None
    """This base's tokenizer, to show a rejected token as text (None: its id only)."""


class LazyGrammars:
    """A base's `Grammars`, made on first use (xgrammar is only loaded when an action was constrained)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any):
        self._model, self._tokenizer, self._grammars = model, tokenizer, None

    def checked_bits(self, constraint: dict[str, Any], token_ids: Sequence[int]) -> tuple[torch.Tensor, int | None]:
        """`Grammars.checked_bits` of this base."""
        if self._grammars is None:
            self._grammars = Grammars.for_model(self._model, self._tokenizer)
        return self._grammars.checked_bits(constraint, token_ids)


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
    proximal: tuple[torch.Tensor, ...]
    """The log-probs each record's PPO ratio is clipped around: its behaviour log-probs, or for a trained record the
    current weights did not sample (``offline_anchor: current``) those of the policy at the start of the iteration."""
    off_policy: int
    """How many trained records got their proximal log-probs recomputed (the metrics' `off_policy_actions`)."""
    advantages: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    returns: tuple[torch.Tensor, ...]
    features: tuple[torch.Tensor | None, ...]
    reference: tuple[torch.Tensor | None, ...]
    trained: tuple[int, ...]
    masks: Mapping[int, torch.Tensor] = field(default_factory=dict)
    """Packed token masks of the constrained records (`constraint_masks`), by record index."""
    problems: Mapping[int, DataProblem] = field(default_factory=dict)
    """Records that failed a data check (`training.checks`), by index: never in `trained`."""
    zero_advantage: frozenset[int] = frozenset()
    """The `trained` records whose advantage was exactly 0 on every token before normalisation: no signal of their
    own (e.g. their scenario group's returns were all equal); the metrics' `zero_advantage_share`."""

    def mask_bits(self, idx: Sequence[int], device: torch.device | None = None) -> torch.Tensor | None:
        return stacked_masks(self.masks, self.records, idx, device)

    def indices(self, agents: Sequence[str] | None = None, base: str | None = None) -> list[int]:
        """Indices of the trained records of `agents` (all trained ones when None), on `base` if given."""
        keep = None if agents is None else set(agents)
        return [i for i in self.trained if (keep is None or self.records[i].agent in keep)
                and (base is None or self.records[i].base == base)]


@dataclass(frozen=True)
class Critic:
    """The value heads: one per base (`on` None), or one head on the base `on` that values every record."""

    heads: Mapping[str, ValueHead]
    on: str | None = None

    def base_for(self, record: ActionRecord) -> str:
        return self.on if self.on is not None else record.base


# ---- micro-batching -----------------------------------------------------------------------------

def _tokens(r: ActionRecord) -> list[int]:
    return r.prompt_ids + r.completion_ids


def _micro_batch_indices(seqs: Sequence[Sequence[int]], max_tokens: int | None, groups: int,
                         max_rows: int | None) -> list[list[int]]:
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    n_groups = max(1, min(groups, len(order)))
    bounds = [round(i * len(order) / n_groups) for i in range(n_groups + 1)]
    out: list[list[int]] = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        cur: list[int] = []
        common = 0  # leading tokens every row of `cur` shares (its first row is its shortest)
        for i in order[lo:hi]:
            if cur:
                first = seqs[cur[0]]
                shared = common_length(first, seqs[i], common)
                cost = row_positions(shared, len(first), len(seqs[i]), len(cur) + 1)
                if (max_tokens is not None and cost > max_tokens) or (max_rows is not None and len(cur) >= max_rows):
                    out.append(cur)
                    cur = []
                else:
                    common = shared
            if not cur:
                common = len(seqs[i])
            cur.append(i)
        if cur:
            out.append(cur)
    return out


def micro_batches(records: list[ActionRecord], max_tokens: int | None, *, groups: int = 1,
                  max_rows: int | None = None) -> list[list[ActionRecord]]:
    """Length-sorted micro-batches of `records`: at least `groups` of them, each at most `max_tokens` padded
    positions beyond the prompt prefix its rows share and at most `max_rows` rows; an action longer than
    `max_tokens` is a micro-batch of its own.

    Sorting by length first puts rows of similar length together, so little padding is computed. The prompt
    prefix the rows share runs once per micro-batch (`shared_prefix`) and is not counted: no split makes it
    smaller (as with an action longer than the budget), and counted per row it left an agent with a long system
    prompt (few-shot turns, tool schemas) one row per micro-batch, that prompt recomputed for every row. The
    order is deterministic (stable sort by length).
    """
    parts = _micro_batch_indices([_tokens(r) for r in records], max_tokens, groups, max_rows)
    return [[records[i] for i in part] for part in parts]


def index_batches(batch_records: Sequence[ActionRecord], idx: Sequence[int], max_tokens: int | None, *,
                  groups: int = 1, max_rows: int | None = None) -> list[list[int]]:
    """`micro_batches` over the records at `idx`, as lists of those indices."""
    parts = _micro_batch_indices([_tokens(batch_records[i]) for i in idx], max_tokens, groups, max_rows)
    return [[idx[j] for j in part] for part in parts]


def inference_batches(records: Sequence[ActionRecord], idx: Sequence[int], cfg: MARFTConfig,
                      batch_size: int) -> list[list[int]]:
    """Batches for the no-gradient passes: length-sorted, at most `batch_size` rows and
    `inference_batch_tokens` padded positions beyond their shared prompt prefix."""
    return index_batches(records, idx, cfg.inference_batch_tokens, max_rows=batch_size)


def scatter(mask: torch.Tensor, rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """`[B, T]` float tensor holding row b's values, in order, at the positions where `mask[b]` is set."""
    flat = torch.cat([torch.as_tensor(v, dtype=torch.float32).reshape(-1) for v in rows]).to(mask.device)
    return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_scatter(mask, flat)


# ---- the no-gradient passes that build the batch ------------------------------------------------

def constraint_masks(records: Sequence[ActionRecord],
                     bases: Mapping[str, BaseModel]) -> tuple[dict[int, torch.Tensor], dict[int, DataProblem]]:
    """(`{i: packed mask [tokens, ceil(V / 32)]}` of every constrained record: what its grammar allowed at each
    completion step, re-derived from the recorded constraint and tokens with its base's tokenizer; the records whose
    grammar rejects one of their tokens, as `grammar_rejected` problems)."""
    out: dict[int, torch.Tensor] = {}
    problems: dict[int, DataProblem] = {}
    for i, r in enumerate(records):
        constraint = load_constraint(r.constraint)
        b = bases.get(r.base)
        if constraint is not None and b is not None and b.grammars is not None:
            out[i], rejected = b.grammars.checked_bits(constraint, r.completion_ids)
            if rejected is not None:
                problems[i] = grammar_rejection(r, label(constraint), rejected, b.tokenizer)
    return out, problems


def stacked_masks(masks: Mapping[int, torch.Tensor], records: Sequence[ActionRecord], idx: Sequence[int],
                  device: torch.device | None = None) -> torch.Tensor | None:
    """The masks of the records at `idx`, one row per completion token in collate order (a free record's rows
    allow every token); None when none of them is constrained."""
    if not any(i in masks for i in idx):
        return None
    width = next(m.shape[1] for i, m in masks.items() if i in idx)
    rows = [masks[i] if i in masks else torch.full((records[i].n_tokens, width), -1, dtype=torch.int32) for i in idx]
    return torch.cat(rows).to(device) if device is not None else torch.cat(rows)


@torch.no_grad()
def completion_logprobs(model: torch.nn.Module, records: Sequence[ActionRecord], idx: Sequence[int],
                        cfg: MARFTConfig, pad_id: int, batch_size: int = 8,
                        masks: Mapping[int, torch.Tensor] | None = None) -> dict[int, torch.Tensor]:
    """`{i: log-probs of records[i]'s completion tokens}` under the model as currently set (a constrained record's
    under its grammar's mask, `masks`)."""
    out: dict[int, torch.Tensor] = {}
    for part in inference_batches(records, idx, cfg, batch_size):
        rows = [records[i] for i in part]
        t = collate(rows, pad_id, model_device(model))
        lp, _ = token_logprobs(model, t["input_ids"], t["attention_mask"], t["completion_mask"],
                               chunk_size=cfg.logprob_chunk,
                               allowed_bits=stacked_masks(masks or {}, records, part, t["input_ids"].device))
        sel = t["completion_mask"].bool()
        for b, i in enumerate(part):
            out[i] = lp[b][sel[b]].float().cpu()
    return out


def behaviour_logprobs(records: Sequence[ActionRecord], bases: Mapping[str, BaseModel],
                       adapter_for: Callable[[ActionRecord], str], cfg: MARFTConfig,
                       masks: Mapping[int, torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Behaviour log-probs per record: the trace's, or recomputed with the adapter the span names."""
    out: dict[int, torch.Tensor] = {i: torch.tensor(r.behaviour_logprobs, dtype=torch.float32)
                                    for i, r in enumerate(records) if r.behaviour_logprobs is not None}
    todo = [i for i, r in enumerate(records) if r.behaviour_logprobs is None]
    out.update(adapter_logprobs(records, todo, bases, adapter_for, cfg, masks))
    return [out[i] for i in range(len(records))]


def adapter_logprobs(records: Sequence[ActionRecord], idx: Sequence[int], bases: Mapping[str, BaseModel],
                     adapter_for: Callable[[ActionRecord], str], cfg: MARFTConfig,
                     masks: Mapping[int, torch.Tensor] | None = None) -> dict[int, torch.Tensor]:
    """`{i: log-probs of records[i]'s completion}` under the adapter `adapter_for` names for it, for `idx`: one no-grad
    pass per (base, adapter)."""
    todo: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i in idx:
        todo[(records[i].base, adapter_for(records[i]))].append(i)
    out: dict[int, torch.Tensor] = {}
    for (base, adapter), part in todo.items():
        b = bases[base]
        with only_adapter_trainable(b.model, adapter):
            out.update(completion_logprobs(b.model, records, part, cfg, b.pad_id, masks=masks))
    return out


def proximal_logprobs(records: Sequence[ActionRecord], trained: Sequence[int], behaviour: Sequence[torch.Tensor],
                      bases: Mapping[str, BaseModel], current_adapter: Callable[[ActionRecord], str],
                      on_policy: Callable[[ActionRecord], bool], cfg: MARFTConfig,
                      masks: Mapping[int, torch.Tensor] | None = None) -> tuple[list[torch.Tensor], int]:
    """(the log-probs each record's ratio is clipped around, how many were recomputed): the behaviour log-probs, except
    under ``offline_anchor: current`` for the `trained` records the current weights did not sample, whose log-probs
    under the current adapters are taken (one no-grad pass)."""
    proximal = list(behaviour)
    if cfg.offline_anchor != "current":
        return proximal, 0
    stale = [i for i in trained if not on_policy(records[i])]
    for i, lp in adapter_logprobs(records, stale, bases, current_adapter, cfg, masks).items():
        proximal[i] = lp
    return proximal, len(stale)


def verify_logprobs(records: Sequence[ActionRecord], idx: Sequence[int], behaviour: Sequence[torch.Tensor],
                    bases: Mapping[str, BaseModel], adapter_for: Callable[[ActionRecord], str], cfg: MARFTConfig,
                    masks: Mapping[int, torch.Tensor] | None = None) -> dict[int, DataProblem]:
    """The records at `idx` (on-policy: recorded by the weights their adapter holds now) whose log-probs, recomputed
    with that adapter, differ from the recorded `behaviour` by more than `logprob_tolerance`: one no-grad pass."""
    again = adapter_logprobs(records, idx, bases, adapter_for, cfg, masks)
    problems: dict[int, DataProblem] = {}
    for i in idx:
        problem = logprob_mismatch(records[i], behaviour[i], again[i], cfg.logprob_tolerance)
        if problem is not None:
            problems[i] = problem
    return problems


def critic_values(records: Sequence[ActionRecord], bases: Mapping[str, BaseModel], critic: Critic | None,
                  cfg: MARFTConfig, batch_size: int = 8) -> tuple[list[torch.Tensor | None], list[torch.Tensor]]:
    """(features, rollout values) per record: frozen-base features (adapters disabled) through the value head
    of the critic's base; values 0 and no model pass without a critic. Values are `[1]` per action or
    `[n_tokens]` per token. A record valued on another base than its own is read from `critic_prompt_ids`
    (its observation in that base's tokens; action level)."""
    unit = unit_for(cfg)
    if critic is None:
        return [None] * len(records), [torch.zeros(unit.n_values(r)) for r in records]
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
        for part in inference_batches(rows, idx, cfg, batch_size):
            t = collate([rows[i] for i in part], b.pad_id, model_device(b.model))
            got = critic_features(b.model, t["input_ids"], t["attention_mask"], t["prompt_lens"],
                                  t["completion_mask"], unit)
            with torch.no_grad():
                for i, f in zip(part, got, strict=True):
                    feats[i] = f
                    values[i] = head(f).reshape(-1)
    return feats, values


def compute_advantages(records: Sequence[ActionRecord], values: Sequence[torch.Tensor],
                       cfg: MARFTConfig) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(advantages per completion token, returns shaped like `values`) per record.

    GAE runs over each episode's actions in their joint order, across agents and bases (per action or
    per token, as the config's unit says); without a critic an episode's advantage is its return
    against the other episodes of its scenario. A record with its own `advantage` (`credit: counterfactual`)
    keeps it on every token; the critic's targets stay the GAE returns.
    """
    adv, ret = _estimated_advantages(records, values, cfg)
    for i, r in enumerate(records):  # a credit estimator's own advantage (counterfactual replays) wins
        if r.advantage is not None:
            adv[i] = torch.full((r.n_tokens,), float(r.advantage))
            if not cfg.use_critic:
                ret[i] = torch.full(values[i].shape, float(r.advantage))
    return adv, ret


def _estimated_advantages(records: Sequence[ActionRecord], values: Sequence[torch.Tensor],
                          cfg: MARFTConfig) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """GAE over each episode's joint order, or the group-relative baseline without a critic."""
    adv: list[torch.Tensor] = [torch.zeros(0)] * len(records)
    ret: list[torch.Tensor] = [torch.zeros(0)] * len(records)
    episodes: dict[str, list[int]] = {}
    for i, r in enumerate(records):
        episodes.setdefault(r.episode_id, []).append(i)
    if not cfg.use_critic:
        compared = (_reward_to_go_groups(records, episodes) if cfg.credit == "reward_to_go"
                    else _episode_return_groups(records, episodes))
        members, returns, groups = zip(*compared, strict=True) if compared else ((), (), ())
        relative = group_relative_advantages(torch.tensor(returns), list(groups), scale=cfg.advantage_group_std)
        for idx, a in zip(members, relative.tolist(), strict=True):
            for i in idx:
                adv[i] = torch.full((records[i].n_tokens,), a)
                ret[i] = torch.full(values[i].shape, a)
        return adv, ret
    unit = unit_for(cfg)
    for idx in episodes.values():
        a, g = unit.episode_advantages([records[i] for i in idx], [values[i] for i in idx], cfg)
        for k, i in enumerate(idx):
            adv[i], ret[i] = a[k], g[k]
    return adv, ret


def _episode_return_groups(records: Sequence[ActionRecord],
                           episodes: Mapping[str, list[int]]) -> list[tuple[list[int], float, str]]:
    """(an episode's records, its return, its scenario group) per episode: every action of an episode shares the
    episode's whole return, one entry per episode in its group's statistics (`credit: group`)."""
    return [(idx, sum(records[i].reward for i in idx), scenario_key(e, records[idx[0]].scenario_id))
            for e, idx in episodes.items()]


def _reward_to_go_groups(records: Sequence[ActionRecord],
                         episodes: Mapping[str, list[int]]) -> list[tuple[list[int], float, str]]:
    """([record], its reward-to-go, its comparison group) per record (`credit: reward_to_go`): an action's return is
    the rewards of it and of the actions after it in its episode's joint order (none it cannot have caused), compared
    with the same agent's `k`-th action in the other episodes of its scenario group."""
    out = []
    for e, idx in episodes.items():
        idx = sorted(idx, key=lambda i: records[i].order)
        to_go, rest = [0.0] * len(idx), 0.0
        for k in range(len(idx) - 1, -1, -1):
            rest += records[idx[k]].reward
            to_go[k] = rest
        group, seen = scenario_key(e, records[idx[0]].scenario_id), defaultdict(int)
        for i, g in zip(idx, to_go, strict=True):
            agent = records[i].agent
            out.append(([i], g, f"{group}\x00{agent}\x00{seen[agent]}"))
            seen[agent] += 1
    return out


def reference_logprobs(records: Sequence[ActionRecord], idx: Sequence[int], bases: Mapping[str, BaseModel],
                       cfg: MARFTConfig, masks: Mapping[int, torch.Tensor] | None = None) -> dict[int, torch.Tensor]:
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
            out.update(completion_logprobs(b.model, records, part, cfg, b.pad_id, masks=masks))
    return out


def normalize_advantages(advantages: list[torch.Tensor], records: Sequence[ActionRecord], trained: Sequence[int],
                         zero: Collection[int], agents: Sequence[str], cfg: MARFTConfig) -> None:
    """`normalize_advantages`, in place: the trained records' advantages made zero-mean and divided by their std, or
    by `advantage_std_floor` when that is larger (returns that differ by a few hundredths, e.g. a step cost, are
    not blown up into full-size pushes), jointly or per agent (`credit_normalize: per_agent`, Dr. MAS). A record
    whose advantage is 0 (its group's returns all equal) stays 0 and out of the statistics: moved by the batch's
    mean it would push what no return preferred."""
    if not cfg.normalize_advantages:
        return
    signal = [i for i in trained if i not in zero]
    parts = ([[i for i in signal if records[i].agent == a] for a in agents] if cfg.credit_normalize == "per_agent"
             else [signal])
    for idx in parts:
        unit_for(cfg).normalize(advantages, idx, floor=cfg.advantage_std_floor)


def build_batch(buffer: RolloutBuffer, bases: Mapping[str, BaseModel], cfg: MARFTConfig, *,
                agents: Sequence[str], adapter_for: Callable[[ActionRecord], str],
                critic: Critic | None, on_policy: Callable[[ActionRecord], bool] | None = None,
                current_adapter: Callable[[ActionRecord], str] | None = None) -> TrainBatch:
    """The iteration's `TrainBatch`: behaviour and proximal log-probs, critic values, advantages (normalised over the
    records of `agents`), reference log-probs; every model pass it needs runs here, once. `on_policy` says which
    records the current weights sampled and `current_adapter` names a record's role's current adapter: without both,
    every record's ratio is clipped around its behaviour log-probs.

    The records that fail a data check are left out of `trained` (`problems`): a constrained completion its grammar
    rejects, and, under ``verify_logprobs: first``, a record of `agents` that `on_policy` says the current weights
    recorded (with its own log-probs) whose log-probs they do not give back."""
    records = tuple(buffer.records)
    mine = [i for i, r in enumerate(records) if r.agent in set(agents)]
    masks, problems = constraint_masks(records, bases)
    behaviour = behaviour_logprobs(records, bases, adapter_for, cfg, masks)
    if cfg.verify_logprobs == "first" and on_policy is not None:
        check = [i for i in mine if i not in problems and not records[i].recomputed and on_policy(records[i])]
        problems.update(verify_logprobs(records, check, behaviour, bases, adapter_for, cfg, masks))
    trained = tuple(i for i in mine if i not in problems)
    proximal, n_stale = (proximal_logprobs(records, trained, behaviour, bases, current_adapter, on_policy, cfg, masks)
                         if on_policy is not None and current_adapter is not None else (list(behaviour), 0))
    features, values = critic_values(records, bases, critic, cfg)
    advantages, returns = compute_advantages(records, values, cfg)
    zero = frozenset(i for i in trained if not bool(advantages[i].any()))
    normalize_advantages(advantages, records, trained, zero, agents, cfg)
    ref = reference_logprobs(records, trained, bases, cfg, masks) if cfg.kl_ref_coef > 0 else {}
    return TrainBatch(records=records, behaviour=tuple(behaviour), proximal=tuple(proximal), off_policy=n_stale,
                      advantages=tuple(advantages),
                      values=tuple(values), returns=tuple(returns), features=tuple(features),
                      reference=tuple(ref.get(i) for i in range(len(records))), trained=trained, masks=masks,
                      problems=problems, zero_advantage=zero)

