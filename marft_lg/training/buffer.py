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
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from marft_lg.constraints import constraint_key, load_constraint
from marft_lg.trajectories.dataset import TrajectoryDataset, scenario_of


@dataclass(frozen=True)
class ActionRecord:
    """One agent action as the trace recorded it, ready for PPO: tokens (of its own base's tokenizer),
    behaviour log-probs, reward. Immutable: what the update computes from it lives in `batch.TrainBatch`."""

    episode_id: str
    scenario_id: str | None
    order: int
    agent: str
    adapter_version: str | None
    prompt_ids: list[int]
    completion_ids: list[int]
    behaviour_logprobs: list[float] | None
    """The trace's log-probs of the completion tokens; None: recompute them (`recomputed`)."""
    reward: float
    done: bool
    words: int
    recomputed: bool = False
    base: str = ""
    """The base model the agent runs on (its tokens are that base's tokenizer's)."""
    critic_prompt_ids: list[int] | None = None
    """The observation in the critic base's tokens, when the critic sits on another base than `base`."""
    constraint: str | None = None
    """The grammar the completion was decoded under (`marft_lg.constraints`, as JSON), None when it was free."""
    advantage: float | None = None
    """The action's own advantage when a credit estimator set one (`training.credit`: counterfactual replays)."""

    @property
    def n_tokens(self) -> int:
        return len(self.completion_ids)


@dataclass
class RolloutBuffer:
    """Records in episode order, what was left out and why (`skipped`), which kept records have
    recomputed behaviour log-probs and why (`recomputed`), and the frozen agents' actions per agent
    (`frozen`: part of the environment, their rewards credited to the previous trained action)."""

    records: list[ActionRecord]
    skipped: Counter = field(default_factory=Counter)
    recomputed: Counter = field(default_factory=Counter)
    frozen: Counter = field(default_factory=Counter)
    retokenised: Counter = field(default_factory=Counter)
    """Kept records per agent whose trace held no prompt token ids: their prompt was rendered again with the chat
    template, which may differ from what the model saw (tools, tool-call turns). Never the case for a record of
    `marft-lg serve` or `TeamChatModel`, whose prompts are the engine's own ids."""

    @property
    def n_recomputed(self) -> int:
        return sum(r.recomputed for r in self.records)


Tokenizers = Any | Mapping[str, Any]
"""One tokenizer, or ``{base name: tokenizer}`` for a team on several bases."""


def build_buffer(dataset: TrajectoryDataset, action_rewards: dict[str, Any], tokenizer: Tokenizers, *,
                 max_context: int, behaviour_logprobs: str = "auto", agents: Collection[str] | None = None,
                 base_of: Callable[[str], str] | None = None, critic_base: str | None = None,
                 credit: Mapping[tuple[str, int], float] | None = None) -> RolloutBuffer:
    """Turn mined actions into records; episodes without rewards are left out, over-long actions skipped.

    `agents`: the trained roles; the other agents' actions (frozen agents, e.g. one on an external API)
    are the environment: no record, counted in `frozen`. `base_of(role)` names a role's base, whose
    tokenizer (`tokenizer[base]`) re-tokenises actions the trace has no token ids for. With `critic_base`,
    records on other bases also get their observation in that base's tokens (`critic_prompt_ids`).
    An episode's last kept action is its terminal one (`done=True`); the reward of an action without a
    record (skipped, frozen) goes to the previous kept action of its episode so no reward is lost.
    `credit` ``{(episode id, order): advantage}`` (a credit estimator's): only the actions it names are kept
    (`skipped["not_credited"]`: a replay's held and later actions), each with its advantage.
    """
    skipped: Counter = Counter()
    recomputed: Counter = Counter()
    frozen: Counter = Counter()
    retokenised: Counter = Counter()
    records: list[ActionRecord] = []
    sid_by_ep = {eid: scenario_of(sid) for eid, sid in zip(dataset.episodes["episode_id"], dataset.episodes["scenario_id"],
                                                            strict=True)}
    for eid, group in dataset.actions.groupby("episode_id", sort=False):
        if eid not in action_rewards:
            skipped["unscored_episode"] += len(group)
            continue
        rewards = np.asarray(action_rewards[eid], dtype=float).reshape(-1)
        rows = group.sort_values("order").to_dict("records")
        if len(rewards) != len(rows):
            raise ValueError(f"episode {eid}: {len(rewards)} action rewards for {len(rows)} actions; "
                             "the reward's action_rewards must have one entry per action in `order`")
        kept: list[dict[str, Any]] = []
        for i, row in enumerate(rows):
            agent = str(row["agent"])
            if agents is not None and agent not in agents:
                frozen[agent] += 1
                continue
            advantage = None
            if credit is not None:
                advantage = credit.get((str(eid), int(row["order"])))
                if advantage is None:
                    skipped["not_credited"] += 1
                    continue
            base = base_of(agent) if base_of is not None else ""
            tok = _tokenizer(tokenizer, base)
            prompt_ids, completion_ids = _tokens(row, tok)
            logprobs = row.get("completion_logprobs")
            logprobs = None if logprobs is None else [float(x) for x in logprobs]
            if not completion_ids:
                skipped["empty_completion"] += 1
                continue
            if len(prompt_ids) + len(completion_ids) > max_context:
                skipped["context"] += 1
                continue
            if not _has_ids(row.get("prompt_token_ids")):
                retokenised[agent] += 1
            plan, why = _logprob_plan(logprobs, len(completion_ids), behaviour_logprobs)
            if plan == "skip":
                skipped[why] += 1
                continue
            recompute = plan == "recompute"
            if recompute:
                recomputed[why] += 1
                logprobs = None
            critic_ids = None
            if critic_base is not None and base != critic_base:
                critic_ids = _prompt_ids(row, _tokenizer(tokenizer, critic_base))
            kept.append({"index": i, "episode_id": str(eid), "scenario_id": sid_by_ep.get(eid), "order": int(row["order"]),
                         "agent": agent, "adapter_version": row.get("adapter_version"), "prompt_ids": prompt_ids,
                         "completion_ids": completion_ids, "behaviour_logprobs": logprobs, "reward": 0.0,
                         "constraint": _constraint(row.get("constraint")),
                         "words": max(1, len(str(row.get("completion") or "").split())), "recomputed": recompute,
                         "base": base, "critic_prompt_ids": critic_ids, "advantage": advantage})
        if not kept:
            continue
        # Every reward goes to its own record, or to the nearest earlier kept one (the first kept one before it).
        for i, rew in enumerate(rewards):
            earlier = [k for k in kept if k["index"] <= i]
            (earlier[-1] if earlier else kept[0])["reward"] += float(rew)
        for k, fields in enumerate(kept):
            fields.pop("index")
            records.append(ActionRecord(**fields, done=k == len(kept) - 1))
    return RolloutBuffer(records=records, skipped=skipped, recomputed=recomputed, frozen=frozen,
                         retokenised=retokenised)


def _constraint(value: Any) -> str | None:
    """An action's constraint cell as canonical JSON (None: free, missing, or not a constraint)."""
    c = load_constraint(value)
    return constraint_key(c) if c is not None else None


def _logprob_plan(logprobs: list[float] | None, n_tokens: int, mode: str) -> tuple[str, str | None]:
    """What to do with an action's trace log-probs under `behaviour_logprobs: mode`: (`use` | `recompute` |
    `skip`, the reason counted in `recomputed` or `skipped`)."""
    problem = None
    if logprobs is None:
        problem = "missing"
    elif len(logprobs) != n_tokens:
        problem = "logprob_length_mismatch"
    if mode == "recompute":
        return "recompute", "config"
    if problem is None:
        return "use", None
    if mode == "auto":
        return "recompute", problem
    return "skip", "no_logprobs" if problem == "missing" else problem  # "trace": only the trace's own may be used


def _has_ids(value: Any) -> bool:
    return value is not None and len(value) > 0


def _tokenizer(tokenizer: Tokenizers, base: str) -> Any:
    if isinstance(tokenizer, Mapping):
        if base not in tokenizer:
            raise KeyError(f"no tokenizer for base {base!r}; known: {sorted(tokenizer)}")
        return tokenizer[base]
    return tokenizer


def _prompt_ids(row: dict[str, Any], tokenizer: Any) -> list[int]:
    enc = tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=True, return_dict=False)
    return [int(x) for x in (enc["input_ids"] if isinstance(enc, dict) else enc)]


def _tokens(row: dict[str, Any], tokenizer: Any) -> tuple[list[int], list[int]]:
    """The recorded ids, as the engine produced them; only a trace without them is tokenised again."""
    prompt, completion = row.get("prompt_token_ids"), row.get("completion_token_ids")
    if not _has_ids(prompt):
        prompt = _prompt_ids(row, tokenizer)
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
