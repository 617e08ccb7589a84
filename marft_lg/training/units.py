"""The unit PPO scores and the critic values: a whole action, or each of its tokens.

`MARFTConfig.granularity` picks one `Unit` (`unit_for`); the batch builder, the critic and the loss ask
it every question whose answer depends on the unit instead of testing the string. At action level an
action is one unit (one value, one advantage, its ratio the sequence ratio of its tokens); at token
level every completion token is a unit of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch

from marft_lg.training.gae import flat_gae, token_gae

if TYPE_CHECKING:
    from marft_lg.training.buffer import ActionRecord
    from marft_lg.training.config import MARFTConfig


class Unit(Protocol):
    """What depends on the unit: value shapes, critic features, GAE, advantage normalisation, loss weights."""

    name: ClassVar[str]
    cross_base_critic: ClassVar[bool]
    """Whether a value head on one base can value another base's records (read as their re-tokenised observation)."""

    def n_values(self, record: ActionRecord) -> int:
        """How many critic values (and returns) `record` has."""
        ...

    def feature(self, hidden: torch.Tensor, prompt_len: int, completion_mask: torch.Tensor) -> torch.Tensor:
        """One row's critic input from its frozen-base hidden states `[T, H]`."""
        ...

    def value_inputs(self, features: Sequence[torch.Tensor]) -> torch.Tensor:
        """Records' cached features as one value-head input, aligned with their concatenated values."""
        ...

    def episode_advantages(self, records: Sequence[ActionRecord], values: Sequence[torch.Tensor],
                           cfg: MARFTConfig) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """GAE over one episode's records in order: (advantages per completion token, returns like `values`)."""
        ...

    def normalize(self, advantages: list[torch.Tensor], idx: Sequence[int], floor: float = 0.0) -> None:
        """Zero-mean advantages over the units of the records at `idx`, divided by their std or `floor` when that is
        larger, in place."""
        ...

    def reduce(self, x: torch.Tensor, mask: torch.Tensor, words: torch.Tensor | None = None,
               norm: str = "token") -> torch.Tensor:
        """`[B, T]` token values -> per-unit values (`norm`: how an action's tokens are combined)."""
        ...

    def advantages(self, adv_tok: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """`[B, T]` per-token advantages -> the loss's per-unit advantages."""
        ...

    def weights(self, mask: torch.Tensor, n_rows: int, n_tok: int, device: torch.device) -> torch.Tensor:
        """Per-unit loss weights, so a minibatch's loss is the mean over its actions (or tokens)."""
        ...


@dataclass(frozen=True)
class ActionUnit:
    """One unit per action: one value at the observation's last token, one advantage, the sequence ratio."""

    name: ClassVar[str] = "action"
    cross_base_critic: ClassVar[bool] = True

    def n_values(self, record: ActionRecord) -> int:
        return 1

    def feature(self, hidden: torch.Tensor, prompt_len: int, completion_mask: torch.Tensor) -> torch.Tensor:
        return hidden[int(prompt_len) - 1]

    def value_inputs(self, features: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.stack(list(features))

    def episode_advantages(self, records: Sequence[ActionRecord], values: Sequence[torch.Tensor],
                           cfg: MARFTConfig) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        a, g = flat_gae(torch.tensor([r.reward for r in records]), torch.cat(list(values)),
                        torch.tensor([float(r.done) for r in records]), cfg.gamma, cfg.gae_lambda)
        adv = [torch.full((r.n_tokens,), float(a[k])) for k, r in enumerate(records)]
        return adv, [g[k:k + 1] for k in range(len(records))]

    def normalize(self, advantages: list[torch.Tensor], idx: Sequence[int], floor: float = 0.0) -> None:
        if not idx:
            return
        a = torch.stack([advantages[i][0] for i in idx])
        if a.numel() < 2:
            return
        a = (a - a.mean()) / (a.std(unbiased=False).clamp(min=floor) + 1e-8)
        for i, v in zip(idx, a.tolist(), strict=True):
            advantages[i] = torch.full_like(advantages[i], v)

    def reduce(self, x: torch.Tensor, mask: torch.Tensor, words: torch.Tensor | None = None,
               norm: str = "token") -> torch.Tensor:
        """`[B, 1]`: the masked sum, its mean over tokens (`token`) or per word (`word`)."""
        total = (x * mask).sum(-1, keepdim=True)
        if norm == "token":
            return total / mask.sum(-1, keepdim=True).clamp(min=1)
        if norm == "word" and words is not None:
            return total / words[:, None]
        return total

    def advantages(self, adv_tok: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.reduce(adv_tok, mask, norm="token")

    def weights(self, mask: torch.Tensor, n_rows: int, n_tok: int, device: torch.device) -> torch.Tensor:
        return torch.full((mask.shape[0], 1), 1.0 / n_rows, device=device)


@dataclass(frozen=True)
class TokenUnit:
    """One unit per completion token: a value before each token, GAE over the tokens, per-token ratios."""

    name: ClassVar[str] = "token"
    cross_base_critic: ClassVar[bool] = False

    def n_values(self, record: ActionRecord) -> int:
        return record.n_tokens

    def feature(self, hidden: torch.Tensor, prompt_len: int, completion_mask: torch.Tensor) -> torch.Tensor:
        return hidden[completion_mask.nonzero().squeeze(-1) - 1]

    def value_inputs(self, features: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat(list(features))

    def episode_advantages(self, records: Sequence[ActionRecord], values: Sequence[torch.Tensor],
                           cfg: MARFTConfig) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        rewards, dones, ends = [], [], []
        for r in records:  # an action's reward, and its episode's end, sit on its last token
            last = torch.zeros(r.n_tokens)
            last[-1] = 1.0
            rewards.append(last * r.reward)
            ends.append(last)
            dones.append(last * float(r.done))
        a, g = token_gae(torch.cat(rewards), torch.cat(list(values)), torch.cat(dones), torch.cat(ends),
                         cfg.gamma, cfg.gae_lambda, cfg.token_gamma)
        adv, ret, start = [], [], 0
        for r in records:
            adv.append(a[start:start + r.n_tokens])
            ret.append(g[start:start + r.n_tokens])
            start += r.n_tokens
        return adv, ret

    def normalize(self, advantages: list[torch.Tensor], idx: Sequence[int], floor: float = 0.0) -> None:
        if not idx:
            return
        flat = torch.cat([advantages[i] for i in idx])
        if flat.numel() < 2:
            return
        mean, std = flat.mean(), flat.std(unbiased=False).clamp(min=floor) + 1e-8
        for i in idx:
            advantages[i] = (advantages[i] - mean) / std

    def reduce(self, x: torch.Tensor, mask: torch.Tensor, words: torch.Tensor | None = None,
               norm: str = "token") -> torch.Tensor:
        """`[B, T]`: the tokens themselves, masked."""
        return x * mask

    def advantages(self, adv_tok: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return adv_tok

    def weights(self, mask: torch.Tensor, n_rows: int, n_tok: int, device: torch.device) -> torch.Tensor:
        return mask / n_tok


_UNITS: dict[str, Unit] = {"action": ActionUnit(), "token": TokenUnit()}


def unit_for(choice: MARFTConfig | str) -> Unit:
    """The `Unit` of a config (its `granularity`) or of a granularity name (`action` | `token`)."""
    name = choice if isinstance(choice, str) else choice.granularity
    try:
        return _UNITS[name]
    except KeyError:
        raise ValueError(f"granularity must be one of {sorted(_UNITS)}, got {name!r}") from None
