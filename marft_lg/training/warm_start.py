"""The warm start: rejection-sampling fine-tuning (expert iteration; STaR, ReST, RAFT) before MARFT.

From mined episodes (production traces, or K fresh rollouts per scenario) the team's best are kept: the best of
each scenario's group when it beats the group's mean (a group whose returns are all equal teaches nothing), every
episode at or above a reward threshold, or every episode whose user feedback is positive (a thumbs-up episode is a
good one). Each trained agent's adapter is then fine-tuned on its own actions in them: the mean negative
log-likelihood of each completion token given the prompt the model saw, a constrained action's tokens under its
grammar's mask (as the PPO loss takes them), frozen agents untouched. It is cheap, stable and needs no value
estimate, so PPO starts from a team that already does what its best episodes did.

`warm_start(trainer, dataset, scenarios, config)` runs it on a `MARFTTrainer`'s adapters and optimizers and
returns a metrics row (logged to the run's metrics like an iteration's, phase ``warm_start``).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np
import pandas as pd
import torch

from marft_lg._config import unknown_keys
from marft_lg.serving.engine.device import model_device
from marft_lg.training.batch import constraint_masks, index_batches
from marft_lg.training.buffer import ActionRecord, build_buffer, collate
from marft_lg.training.checks import TrainingDataError
from marft_lg.training.policy import adapter_parameters, only_adapter_trainable, token_logprobs
from marft_lg.trajectories.dataset import TrajectoryDataset

KEEP_MODES = ("best_of_group", "threshold", "feedback")


@dataclass
class WarmStartConfig:
    """Which episodes teach, and how long. (train.yaml: ``warm_start:``; the phase ``warm_start``.)"""

    keep: str = "best_of_group"
    """``best_of_group``: per scenario, the episode(s) with the highest team reward, when above the group's mean by
    more than `margin`; ``threshold``: every scored episode with reward >= `threshold`; ``feedback``: every episode
    whose user feedback `feedback` is positive (True or > 0), scored or not."""
    threshold: float | None = None
    margin: float = 0.0
    feedback: str | None = None
    epochs: int = 2
    """Passes over the kept actions."""
    learning_rate: float | None = None
    """The adapters' learning rate during the warm start (None: MARFT's `learning_rate`)."""
    max_episodes: int | None = None
    """At most this many kept episodes (the highest rewards first; None: all)."""

    def __post_init__(self) -> None:
        if self.keep not in KEEP_MODES:
            raise ValueError(f"warm_start.keep must be one of {list(KEEP_MODES)}, got {self.keep!r}")
        if self.keep == "threshold" and not isinstance(self.threshold, int | float):
            raise ValueError("warm_start.keep: threshold needs warm_start.threshold (a team reward)")
        if self.keep == "feedback" and not (isinstance(self.feedback, str) and self.feedback):
            raise ValueError("warm_start.keep: feedback needs warm_start.feedback (the feedback name, e.g. thumbs)")
        if isinstance(self.epochs, bool) or not isinstance(self.epochs, int) or self.epochs < 1:
            raise ValueError(f"warm_start.epochs must be an int >= 1, got {self.epochs!r}")
        if not isinstance(self.margin, int | float) or self.margin < 0:
            raise ValueError(f"warm_start.margin must be >= 0, got {self.margin!r}")
        if self.learning_rate is not None and not (isinstance(self.learning_rate, int | float)
                                                   and 0 < self.learning_rate < 1):
            raise ValueError(f"warm_start.learning_rate must be in (0, 1), got {self.learning_rate!r}")
        if self.max_episodes is not None and (isinstance(self.max_episodes, bool)
                                              or not isinstance(self.max_episodes, int) or self.max_episodes < 1):
            raise ValueError(f"warm_start.max_episodes must be an int >= 1, got {self.max_episodes!r}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> WarmStartConfig:
        """From a train.yaml mapping; an unknown key is a ValueError naming the known ones."""
        data = dict(data or {})
        known = {f.name for f in fields(cls)}
        unknown = unknown_keys(data, known)
        if unknown:
            raise ValueError(f"warm_start: unknown key(s) {unknown}; known: {sorted(known)}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def select_episodes(dataset: TrajectoryDataset, table: pd.DataFrame | None, cfg: WarmStartConfig) -> tuple[list[str], dict[str, int]]:
    """The ids of the episodes that teach (`cfg.keep`), and what was counted on the way (groups, all-equal groups,
    unscored episodes). `table`: the reward's episode table (``episode_id, reward, scored``), not needed for
    ``feedback``."""
    stats: dict[str, int] = defaultdict(int)
    reward: dict[str, float] = {}
    if table is not None and len(table):
        for eid, r, ok in zip(table["episode_id"], table["reward"], table["scored"], strict=True):
            if bool(ok) and r is not None and math.isfinite(float(r)):
                reward[str(eid)] = float(r)
    stats["episodes"] = len(dataset)
    stats["unscored"] = len(dataset) - len(reward) if cfg.keep != "feedback" else 0
    kept: list[str] = []
    if cfg.keep == "feedback":
        for eid, fb in zip(dataset.episodes["episode_id"], dataset.episodes["feedback"], strict=True):
            value = (fb or {}).get(cfg.feedback) if isinstance(fb, dict) else None
            if value is True or (isinstance(value, int | float) and not isinstance(value, bool) and value > 0):
                kept.append(str(eid))
    elif cfg.keep == "threshold":
        kept = [eid for eid in dataset.episode_ids if eid in reward and reward[eid] >= float(cfg.threshold)]
    else:
        for members in dataset.scenario_groups().values():
            scored = [e for e in members if e in reward]
            if len(scored) < 2:
                stats["groups_too_small"] += 1
                continue
            stats["groups"] += 1
            values = np.array([reward[e] for e in scored])
            best = values.max()
            if best - values.mean() <= cfg.margin:
                stats["groups_all_equal" if np.ptp(values) == 0 else "groups_within_margin"] += 1
                continue
            kept.extend(e for e in scored if reward[e] == best)
    if cfg.max_episodes is not None and len(kept) > cfg.max_episodes:
        kept = sorted(kept, key=lambda e: (-reward.get(e, 0.0), e))[: cfg.max_episodes]
    stats["kept"] = len(kept)
    return kept, dict(stats)


def _sft_step(model: torch.nn.Module, records: Sequence[ActionRecord], idx: list[int], masks: Mapping[int, Any],
              pad_id: int, micro_tokens: int | None, chunk: int | None) -> tuple[float, int, bool]:
    """Accumulate the gradient of the mean token NLL of `records[idx]` (one optimizer step's worth); returns
    (loss, tokens, finite)."""
    from marft_lg.training.batch import stacked_masks

    n_tok = max(1, sum(records[i].n_tokens for i in idx))
    total = 0.0
    for mb in index_batches(records, idx, micro_tokens):
        t = collate([records[i] for i in mb], pad_id, model_device(model))
        lp, _ = token_logprobs(model, t["input_ids"], t["attention_mask"], t["completion_mask"], chunk_size=chunk,
                               allowed_bits=stacked_masks(masks, records, mb, t["input_ids"].device))
        loss = -(lp * t["completion_mask"].float()).sum() / n_tok
        if not torch.isfinite(loss):
            return total, n_tok, False
        loss.backward()
        total += float(loss.detach())
    return total, n_tok, True


def warm_start(trainer: Any, dataset: TrajectoryDataset, scenarios: Any = None,
               config: WarmStartConfig | None = None) -> dict[str, Any]:
    """Fine-tune each trained agent of `trainer` (a `MARFTTrainer`) on its own actions in the kept episodes of
    `dataset`; returns the metrics row (also logged). Raises `TrainingDataError` when no episode or no action of a
    trained agent is kept (naming why), never "trains" nothing silently."""
    cfg = config or WarmStartConfig()
    mcfg = trainer.cfg
    t0 = time.perf_counter()
    table, rewards = (None, None) if cfg.keep == "feedback" else trainer._scores(dataset, scenarios)
    kept, stats = select_episodes(dataset, table, cfg)
    if not kept:
        raise TrainingDataError(f"warm start: no episode kept (keep: {cfg.keep}; {stats})")
    sub = dataset.select(kept)
    action_rewards = {eid: (rewards[eid] if rewards is not None and eid in rewards
                            else np.zeros(int((sub.actions["episode_id"] == eid).sum())))
                      for eid in sub.episode_ids}
    buffer = build_buffer(sub, action_rewards, {n: b.tokenizer for n, b in trainer.bases.items()},
                          max_context=mcfg.max_context, behaviour_logprobs="recompute", agents=trainer.roles,
                          base_of=trainer.base_of.__getitem__)
    records = buffer.records
    agents = trainer._agents_to_train(records)
    if not records or not agents:
        raise TrainingDataError(f"warm start: the {len(kept)} kept episode(s) hold no action of a trained agent "
                                f"({trainer.roles}); left out: {dict(buffer.skipped)}")
    bases = {n: b.batch_base() for n, b in trainer.bases.items()}
    masks, problems = constraint_masks(records, bases)
    for i in problems:
        masks.pop(i, None)
    per_agent: dict[str, dict[str, float]] = {}
    tokens = 0
    for agent in agents:
        base = trainer.bases[trainer.base_of[agent]]
        model, adapter, opt = base.model, trainer.adapter_names[agent], trainer.optimizers[agent]
        idx = [i for i, r in enumerate(records) if r.agent == agent and i not in problems]
        if not idx:
            continue
        saved_lr = [g["lr"] for g in opt.param_groups]
        if cfg.learning_rate is not None:
            for g in opt.param_groups:
                g["lr"] = cfg.learning_rate
        losses, steps, skipped = [], 0, 0
        try:
            with base.policy.exclusive(), only_adapter_trainable(model, adapter):
                for _ in range(cfg.epochs):
                    order = torch.randperm(len(idx), generator=trainer.generator).tolist()
                    shuffled = [idx[j] for j in order]
                    size = max(1, -(-len(shuffled) // mcfg.num_minibatches))
                    for lo in range(0, len(shuffled), size):
                        part = shuffled[lo:lo + size]
                        opt.zero_grad(set_to_none=True)
                        loss, n_tok, finite = _sft_step(model, records, part, masks, base.pad_id,
                                                        mcfg.micro_batch_tokens, mcfg.logprob_chunk)
                        norm = torch.nn.utils.clip_grad_norm_(adapter_parameters(model, adapter), mcfg.max_grad_norm)
                        if finite and torch.isfinite(norm):
                            opt.step()
                            steps += 1
                            losses.append(loss)
                            tokens += n_tok
                        else:
                            skipped += 1
                        opt.zero_grad(set_to_none=True)
        finally:
            for g, lr in zip(opt.param_groups, saved_lr, strict=True):
                g["lr"] = lr
        per_agent[agent] = {"actions": len(idx), "steps": steps, "nll_first": losses[0] if losses else float("nan"),
                            "nll_last": losses[-1] if losses else float("nan"), "skipped_nonfinite": skipped}
        if steps:
            trainer.update_steps[agent] = trainer.update_steps.get(agent, 0) + steps
            trainer.unpublished.add(agent)
    elapsed = time.perf_counter() - t0
    row = {"iteration": trainer.iteration, "phase": "warm_start", "keep": cfg.keep, "episodes": len(dataset),
           "kept_episodes": len(kept), "selection": stats, "actions": sum(int(a["actions"]) for a in per_agent.values()),
           "warm_start_agents": per_agent, "updated_agents": [a for a, v in per_agent.items() if v["steps"]],
           "data_check_failed": len(problems), "tokens": tokens, "elapsed_s": elapsed,
           "tokens_per_min": tokens / elapsed * 60 if elapsed > 0 else 0.0,
           "kept_reward_mean": (float(np.mean([float(table.set_index("episode_id").loc[e, "reward"]) for e in kept]))
                                if table is not None else None)}
    if not row["updated_agents"]:
        raise TrainingDataError(f"warm start: no adapter took a step ({per_agent})")
    trainer.metrics.log(row)
    trainer.iteration += 1
    return row
