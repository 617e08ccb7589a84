"""Generalised advantage estimation over the ordered sequence of agent actions (MARFT sec. 4, App. A).

MARFT treats the agents of one step as acting in turn: each action bootstraps from the value of the
next action (the next agent in the step, or the first agent of the next step), an episode's last
action from 0. Flattening the (step, agent) grid into one ordered sequence makes that plain GAE.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def discounted_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    dones: torch.Tensor,
    discounts: torch.Tensor,
    lam: float,
    last_value: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE where `discounts[k]` is the discount between position k and k+1 (the shared kernel)."""
    n = rewards.shape[0]
    rewards, values = rewards.double(), values.double()
    advantages = torch.zeros(n, dtype=torch.float64)
    gae = 0.0
    for k in reversed(range(n)):
        not_done = 1.0 - float(dones[k])
        next_value = last_value if k == n - 1 else float(values[k + 1])
        g = float(discounts[k])
        delta = float(rewards[k]) + g * next_value * not_done - float(values[k])
        gae = delta + g * lam * not_done * gae
        advantages[k] = gae
    returns = advantages + values
    return advantages.float(), returns.float()


def flat_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    dones: torch.Tensor,
    gamma: float,
    lam: float,
    last_value: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Action-level GAE over 1-D tensors of agent actions in order (one or more concatenated episodes).

    `dones[k] = 1` when action k ends its episode (it then bootstraps from 0); otherwise action k
    bootstraps from `values[k+1]`, and the very last action from `last_value`.
    Returns `(advantages, returns)` with `returns = advantages + values`.
    """
    rewards, values, dones = _as_1d(rewards), _as_1d(values), _as_1d(dones)
    if not rewards.shape == values.shape == dones.shape:
        raise ValueError(f"flat_gae: rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and "
                         f"dones {tuple(dones.shape)} must have the same length")
    return discounted_gae(rewards, values, dones, torch.full_like(rewards, float(gamma)), lam, last_value)


def token_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    dones: torch.Tensor,
    action_ends: torch.Tensor,
    gamma: float,
    lam: float,
    token_gamma: float = 1.0,
    last_value: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level twin of `flat_gae` over the concatenated tokens of the ordered actions.

    `action_ends[k] = 1` on the last token of an action: the discount to the next token is `gamma`
    there (between actions) and `token_gamma` inside an action. An action's reward sits on its last
    token; `dones[k] = 1` on the last token of an episode.
    """
    rewards, values, dones, action_ends = (_as_1d(t) for t in (rewards, values, dones, action_ends))
    if not rewards.shape == values.shape == dones.shape == action_ends.shape:
        raise ValueError("token_gae: rewards, values, dones and action_ends must have the same length")
    discounts = torch.where(action_ends.bool(), torch.tensor(float(gamma)), torch.tensor(float(token_gamma)))
    return discounted_gae(rewards, values, dones, discounts, lam, last_value)


EQUAL_RETURNS_TOLERANCE = 1e-9
"""Returns this close (relative to the largest magnitude, when above 1) are one return: float sums of equal rewards
differ in the last bits (0.1 + 0.2 vs 0.3), and such a group has nothing to compare."""


def returns_equal(returns: Sequence[float]) -> bool:
    """Whether every return of a group is the same, up to `EQUAL_RETURNS_TOLERANCE` (True for none or one)."""
    if len(returns) < 2:
        return True
    top, bottom = max(returns), min(returns)
    return top - bottom <= EQUAL_RETURNS_TOLERANCE * max(1.0, abs(top), abs(bottom))


def group_relative_advantages(returns: torch.Tensor, groups: list[str], eps: float = 1e-6, *,
                              scale: bool = True) -> torch.Tensor:
    """Critic-free baseline (GRPO-like): each episode's return minus its scenario group's mean, over the group's std
    (`scale`; without it the difference itself, Dr. GRPO, so a group whose returns differ by a step cost is not
    scaled up to the size of a solved-or-not difference).

    A group of one gets advantage 0 (nothing to compare against), and so does a group whose returns are all equal
    (`returns_equal`: exactly 0, not the rounding error of the mean over a tiny std).
    """
    returns = _as_1d(returns).double()
    out = torch.zeros_like(returns)
    index: dict[str, list[int]] = {}
    for i, g in enumerate(groups):
        index.setdefault(g, []).append(i)
    for members in index.values():
        r = returns[members]
        if returns_equal(r.tolist()):
            continue
        out[members] = (r - r.mean()) / (r.std(unbiased=False) + eps) if scale else r - r.mean()
    return out.float()


def _as_1d(t: torch.Tensor | list) -> torch.Tensor:
    t = torch.as_tensor(t, dtype=torch.float32)
    if t.dim() != 1:
        raise ValueError(f"expected a 1-D tensor, got shape {tuple(t.shape)}")
    return t
