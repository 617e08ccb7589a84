"""The critic: the shared base model with adapters disabled (frozen, no second copy) + a small value head.

Because the base is frozen, its features are computed once per batch without gradients
(`critic_features`: on the model's device, kept on the CPU) and only the head trains (on the CPU:
it is a tiny MLP). The `Unit` picks the features: action level, the last hidden state of the rollout
observation (the prompt's last token); token level, the state before each action token.
"""

from __future__ import annotations

import torch
from torch import nn

from marft_lg.training.policy import hidden_states
from marft_lg.training.units import Unit


class ValueHead(nn.Module):
    """`hidden -> hidden_size -> 1` MLP (the paper's value-head hidden size is 64)."""

    def __init__(self, in_features: int, hidden_size: int = 64):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_features, hidden_size), nn.Tanh(), nn.Linear(hidden_size, 1))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net(features.float()).squeeze(-1)


@torch.no_grad()
def critic_features(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    prompt_lens: torch.Tensor, completion_mask: torch.Tensor, unit: Unit) -> list[torch.Tensor]:
    """Frozen-base features per row: `[H]` at the observation's last token (action) or `[n_tokens, H]` (token)."""
    ctx = model.disable_adapter() if hasattr(model, "disable_adapter") else torch.no_grad()
    with ctx:
        h = hidden_states(model, input_ids, attention_mask)
    return [unit.feature(h[b], int(prompt_lens[b]), completion_mask[b]).to("cpu", torch.float32, copy=True)
            for b in range(input_ids.shape[0])]


def huber_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                     value_clip: float | None, delta: float) -> torch.Tensor:
    """Clipped Huber value loss (max of clipped and unclipped errors, as in MAPPO/MARFT)."""
    huber = nn.functional.huber_loss
    loss = huber(values, returns, delta=delta, reduction="none")
    if value_clip is not None:
        clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
        loss = torch.max(loss, huber(clipped, returns, delta=delta, reduction="none"))
    return loss.mean()
