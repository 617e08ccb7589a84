"""Rollout buffer: a TrajectoryDataset + per-action rewards -> token-level training records.

Token ids and behaviour log-probs come from the traces (what the engine generated). An action
without token ids is re-tokenised from its chat messages with the model's chat template; one
without usable log-probs is marked for recomputation (`recomputed=True`) and counted by reason in
`RolloutBuffer.recomputed` (`missing`: the trace has none; `logprob_length_mismatch`: their count
differs from the completion's tokens; `config`: `behaviour_logprobs: recompute`). Actions left out are
counted by reason in `RolloutBuffer.skipped`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from marft_lg.trajectories.dataset import TrajectoryDataset


@dataclass
class ActionRecord:
    """One agent action ready for PPO: tokens, behaviour log-probs, reward and, later, advantages."""

    episode_id: str
    scenario_id: str | None
    order: int
    agent: str
    adapter_version: str | None
    prompt_ids: list[int]
    completion_ids: list[int]
    behaviour_logprobs: list[float] | None
    reward: float
    done: bool
    words: int
    recomputed: bool = False
    features: torch.Tensor | None = None
    value: float = 0.0
    token_values: torch.Tensor | None = None
    advantage: float = 0.0
    ret: float = 0.0
    token_advantages: torch.Tensor | None = None
    token_returns: torch.Tensor | None = None
    ref_logprobs: list[float] | None = None
    """Log-probs of the completion under the reference (adapters disabled), when KL-to-reference is on."""

    @property
    def n_tokens(self) -> int:
        return len(self.completion_ids)


@dataclass
class RolloutBuffer:
    """Records in episode order, what was left out and why (`skipped`), and which kept records have
    recomputed behaviour log-probs and why (`recomputed`)."""

    records: list[ActionRecord]
    skipped: Counter = field(default_factory=Counter)
    recomputed: Counter = field(default_factory=Counter)

    def for_agent(self, agent: str) -> list[ActionRecord]:
        return [r for r in self.records if r.agent == agent]

    def episodes(self) -> dict[str, list[ActionRecord]]:
        out: dict[str, list[ActionRecord]] = {}
        for r in self.records:
            out.setdefault(r.episode_id, []).append(r)
        return out

    @property
    def n_recomputed(self) -> int:
        return sum(r.recomputed for r in self.records)


def build_buffer(dataset: TrajectoryDataset, action_rewards: dict[str, Any], tokenizer: Any, *,
                 max_context: int, behaviour_logprobs: str = "auto") -> RolloutBuffer:
    """Turn mined actions into records; episodes without rewards are left out, over-long actions skipped.

    An episode's last kept action is its terminal one (`done=True`); the reward of a skipped
    action is moved to the previous kept action of its episode so no reward is lost.
    """
    skipped: Counter = Counter()
    recomputed: Counter = Counter()
    records: list[ActionRecord] = []
    sid_by_ep = dict(zip(dataset.episodes["episode_id"], dataset.episodes["scenario_id"], strict=True))
    for eid, group in dataset.actions.groupby("episode_id", sort=False):
        if eid not in action_rewards:
            skipped["unscored_episode"] += len(group)
            continue
        rewards = np.asarray(action_rewards[eid], dtype=float).reshape(-1)
        rows = group.sort_values("order").to_dict("records")
        if len(rewards) != len(rows):
            raise ValueError(f"episode {eid}: {len(rewards)} action rewards for {len(rows)} actions; "
                             "the reward's action_rewards must have one entry per action in `order`")
        kept: list[ActionRecord] = []
        for row, rew in zip(rows, rewards, strict=True):
            prompt_ids, completion_ids = _tokens(row, tokenizer)
            logprobs = row.get("completion_logprobs")
            logprobs = None if logprobs is None else [float(x) for x in logprobs]
            if not completion_ids:
                skipped["empty_completion"] += 1
                continue
            if len(prompt_ids) + len(completion_ids) > max_context:
                skipped["context"] += 1
                continue
            problem = None
            if logprobs is None:
                problem = "missing"
            elif len(logprobs) != len(completion_ids):
                problem = "logprob_length_mismatch"
            if behaviour_logprobs == "recompute":
                recompute, logprobs = True, None
                recomputed["config"] += 1
            elif problem is None:
                recompute = False
            elif behaviour_logprobs == "auto":
                recompute, logprobs = True, None
                recomputed[problem] += 1
            else:  # "trace": only the trace's own log-probs may be used
                skipped["no_logprobs" if problem == "missing" else problem] += 1
                continue
            kept.append(ActionRecord(
                episode_id=str(eid), scenario_id=sid_by_ep.get(eid), order=int(row["order"]), agent=str(row["agent"]),
                adapter_version=row.get("adapter_version"), prompt_ids=prompt_ids, completion_ids=completion_ids,
                behaviour_logprobs=logprobs, reward=float(rew), done=False,
                words=max(1, len(str(row.get("completion") or "").split())), recomputed=recompute))
        if not kept:
            continue
        # Rewards of skipped actions go to the nearest earlier kept action (or the first kept one).
        for row, rew in zip(rows, rewards, strict=True):
            if not any(k.order == int(row["order"]) for k in kept):
                earlier = [k for k in kept if k.order < int(row["order"])]
                (earlier[-1] if earlier else kept[0]).reward += float(rew)
        kept[-1].done = True
        records.extend(kept)
    return RolloutBuffer(records=records, skipped=skipped, recomputed=recomputed)


def _tokens(row: dict[str, Any], tokenizer: Any) -> tuple[list[int], list[int]]:
    prompt, completion = row.get("prompt_token_ids"), row.get("completion_token_ids")
    if prompt is None or len(prompt) == 0:
        enc = tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=True, return_dict=False)
        prompt = enc["input_ids"] if isinstance(enc, dict) else enc
    if completion is None:
        completion = tokenizer(str(row.get("completion") or ""), add_special_tokens=False)["input_ids"]
    return [int(x) for x in prompt], [int(x) for x in completion]


def collate(records: list[ActionRecord], pad_id: int, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """Right-padded `input_ids`, `attention_mask`, `completion_mask` and `prompt_lens` for a batch, on `device`."""
    width = max(len(r.prompt_ids) + r.n_tokens for r in records)
    ids = torch.full((len(records), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(records), width), dtype=torch.long)
    comp = torch.zeros((len(records), width), dtype=torch.long)
    for b, r in enumerate(records):
        seq = r.prompt_ids + r.completion_ids
        ids[b, :len(seq)] = torch.tensor(seq)
        attn[b, :len(seq)] = 1
        comp[b, len(r.prompt_ids):len(seq)] = 1
    out = {"input_ids": ids, "attention_mask": attn, "completion_mask": comp,
           "prompt_lens": torch.tensor([len(r.prompt_ids) for r in records])}
    if device is not None and torch.device(device).type != "cpu":
        out = {k: v.to(device, non_blocking=True) for k, v in out.items()}
    return out
