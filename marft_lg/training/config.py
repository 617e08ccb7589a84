"""`MARFTConfig`: every knob of the MARFT PPO trainer, with the paper's App. B defaults.

Defaults follow Table 3/5 of the MARFT paper (App. B): Adam (eps 1e-5), MAS lr 1e-6, critic lr 1e-5,
1 PPO epoch, 1 minibatch, gamma 0.99, GAE lambda 0.95, clip 0.2, max grad norm 0.5, Huber value
loss, value-head hidden size 64, context 2048, 512 new tokens, approx-KL hard cut 0.02.
"""

from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

_CHOICES: dict[str, tuple[str, ...]] = {
    "granularity": ("action", "token"),
    "update_scheme": ("sequential", "simultaneous"),
    "logprob_norm": ("sum", "token", "word"),
    "behaviour_logprobs": ("auto", "trace", "recompute"),
}


class ConfigError(ValueError):
    """A configuration value or key that cannot be used; the message says where and what to do."""


@dataclass
class MARFTConfig:
    """MARFT PPO settings (YAML-loadable with `from_yaml`; unknown keys are errors)."""

    # --- what is optimised -------------------------------------------------------------------
    granularity: str = "action"
    """`action`: one ratio/advantage per agent action; `token`: per generated token."""
    update_scheme: str = "sequential"
    """`sequential`: one agent's adapter trains per interval (the paper's agent-by-agent scheme);
    `simultaneous`: every agent's adapter steps on every update."""
    agent_iteration_interval: int = 1
    """Sequential scheme: PPO updates spent on one agent before moving to the next."""
    logprob_norm: str = "sum"
    """Action log-prob = sum of token log-probs (`sum`), their mean (`token`) or sum / words (`word`)."""
    use_critic: bool = True
    """False: no value head; advantages are group-relative over the K rollouts of a scenario."""
    group_size: int = 4
    """K episodes per scenario in the online phase (the paper's 4 rollout threads)."""

    # --- PPO losses ----------------------------------------------------------------------------
    clip_low: float = 0.2
    clip_high: float = 0.2
    value_clip: float | None = 0.2
    """Clip of the value prediction around the rollout value (None disables)."""
    huber_delta: float = 10.0
    value_coef: float = 1.0
    entropy_coef: float = 0.01
    kl_cut: float | None = 0.02
    """Trust-region hard cut: skip the policy step of a minibatch whose approx KL exceeds this."""
    kl_ref_coef: float = 0.0
    """Penalty on KL to the reference (base model with adapters disabled); 0 disables (no extra pass)."""
    normalize_advantages: bool = True

    # --- advantages ----------------------------------------------------------------------------
    gamma: float = 0.99
    gae_lambda: float = 0.95
    token_gamma: float = 1.0
    """Token granularity: discount between tokens of one action (gamma applies between actions)."""

    # --- optimisation --------------------------------------------------------------------------
    learning_rate: float = 1e-6
    agent_learning_rates: dict[str, float] = field(default_factory=dict)
    """Per-role overrides of `learning_rate`."""
    critic_learning_rate: float = 1e-5
    adam_eps: float = 1e-5
    ppo_epochs: int = 1
    num_minibatches: int = 1
    grad_accum_steps: int = 1
    """Chunks each agent's minibatch is split into for the backward pass, at least (the paper's
    gradient_cp_steps); `micro_batch_tokens` may split further. Losses are scaled so the gradient
    is the same however the minibatch is split."""
    micro_batch_tokens: int | None = 1024
    """Most padded tokens (rows x longest row) one forward+backward of the policy holds: an agent's
    minibatch runs in length-sorted micro-batches of at most this size with a backward after each,
    so peak activation memory is set by this, not by the batch size or the number of agents. An
    action longer than this is a micro-batch of its own; null: split only by `grad_accum_steps`."""
    inference_batch_tokens: int | None = 4096
    """Most padded tokens per batch in the no-gradient passes (behaviour/reference log-probs, critic
    features, post-update check); those batches are length-sorted too."""
    max_grad_norm: float = 0.5
    value_head_hidden: int = 64
    seed: int = 0

    # --- sequences -----------------------------------------------------------------------------
    max_context: int = 2048
    """Actions whose prompt + completion exceed this are skipped and counted."""
    max_new_tokens: int = 512
    temperature: float = 1.0
    logprob_chunk: int = 256
    """Positions per chunk in the log-prob pass (bounds the live vocab-sized logits)."""
    behaviour_logprobs: str = "auto"
    """`auto`: take them from the trace, recompute (flagged) when missing; `trace`: skip actions
    without them; `recompute`: always recompute with the adapters the spans name."""

    # --- stability -----------------------------------------------------------------------------
    entropy_surge: float = 3.0
    """Restore the last good adapters when mean entropy exceeds this multiple of its running mean."""
    kl_blowup: float = 1.0
    """Restore the last good adapters when the post-update approx KL exceeds this."""

    # --- phases -------------------------------------------------------------------------------
    offline_episodes_per_iteration: int = 64
    """Offline phase: episodes of the dataset consumed per iteration (the data cursor walks them)."""
    offline_passes: int = 1
    """Offline phase: passes over the whole dataset."""
    rollout_concurrency: int = 8
    """Online phase: episodes run at once through the wrapped graph (the engine batches them)."""

    # --- bookkeeping ---------------------------------------------------------------------------
    checkpoint_every: int = 1
    tensorboard: bool = False
    plots: bool = True

    def __post_init__(self) -> None:
        for name, allowed in _CHOICES.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ConfigError(f"MARFTConfig.{name} = {value!r} is not one of {list(allowed)}")
        for name in ("ppo_epochs", "num_minibatches", "grad_accum_steps", "group_size",
                     "agent_iteration_interval", "logprob_chunk", "max_context", "checkpoint_every",
                     "offline_episodes_per_iteration", "offline_passes", "rollout_concurrency"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"MARFTConfig.{name} must be >= 1, got {getattr(self, name)!r}")
        for name in ("micro_batch_tokens", "inference_batch_tokens"):
            value = getattr(self, name)
            if value is not None and int(value) < 1:
                raise ConfigError(f"MARFTConfig.{name} must be >= 1 or null (no limit), got {value!r}")
        if not self.use_critic and self.group_size < 2:
            raise ConfigError("use_critic: false needs group_size >= 2 (the group-relative baseline "
                              "compares K rollouts of one scenario)")

    def lr_for(self, role: str) -> float:
        """Learning rate of one agent's adapter."""
        return float(self.agent_learning_rates.get(role, self.learning_rate))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "<dict>") -> MARFTConfig:
        """Build from a mapping; an unknown key raises with the closest known name."""
        known = {f.name for f in fields(cls)}
        for key in data:
            if key not in known:
                hint = difflib.get_close_matches(key, sorted(known), n=1)
                tip = f"; did you mean {hint[0]!r}?" if hint else f"; known keys: {sorted(known)}"
                raise ConfigError(f"{source}: unknown MARFTConfig key {key!r}{tip}")
        return cls(**data)

    @classmethod
    def from_yaml(cls, path: str | Path, *, section: str | None = None) -> MARFTConfig:
        """Load a YAML file (or one `section` of it, e.g. `marft` of a train.yaml)."""
        p = Path(path)
        data = yaml.safe_load(p.read_text()) or {}
        if section is not None:
            data = data.get(section) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: expected a mapping of MARFTConfig keys, got {type(data).__name__}")
        return cls.from_dict(data, source=f"{p}" + (f" [{section}]" if section else ""))
