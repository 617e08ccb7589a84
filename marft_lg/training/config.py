"""`MARFTConfig`: every knob of the MARFT PPO trainer, with the paper's App. B defaults.

Defaults follow Table 3/5 of the MARFT paper (App. B): Adam (eps 1e-5), MAS lr 1e-6, critic lr 1e-5,
1 PPO epoch, 1 minibatch, gamma 0.99, GAE lambda 0.95, clip 0.2, max grad norm 0.5, Huber value
loss, value-head hidden size 64, context 2048, 512 new tokens, approx-KL hard cut 0.02.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from marft_lg._config import ConfigError, YamlDoc, check_fields, check_int, check_range, load_yaml
from marft_lg.tracking.settings import check_report_to

_CHOICES: dict[str, tuple[str, ...]] = {
    "granularity": ("action", "token"),
    "update_scheme": ("sequential", "simultaneous"),
    "logprob_norm": ("sum", "token", "word"),
    "behaviour_logprobs": ("auto", "trace", "recompute"),
    "verify_logprobs": ("first", "off"),
    "on_data_mismatch": ("drop", "error"),
    "credit": ("group", "reward_to_go", "counterfactual"),
    "credit_normalize": ("joint", "per_agent"),
    "replay_tools": ("refuse", "rerun"),
    "offline_anchor": ("current", "behaviour"),
}


__all__ = ["ConfigError", "MARFTConfig"]

_POSITIVE_INTS = ("ppo_epochs", "num_minibatches", "grad_accum_steps", "group_size", "agent_iteration_interval",
                  "logprob_chunk", "max_context", "max_new_tokens", "checkpoint_every", "value_head_hidden",
                  "offline_episodes_per_iteration", "offline_passes", "rollout_concurrency", "replays_per_action")
# name -> (low, high, low_open, high_open, allow_none)
_RANGES: dict[str, tuple[float | None, float | None, bool, bool, bool]] = {
    "clip_low": (0.0, 1.0, False, True, False),   # the ratio's lower bound 1 - clip_low must stay > 0
    "clip_high": (0.0, None, False, False, False),
    "value_clip": (0.0, None, True, False, True),
    "huber_delta": (0.0, None, True, False, False),
    "value_coef": (0.0, None, False, False, False),
    "entropy_coef": (0.0, None, False, False, False),
    "kl_cut": (0.0, None, True, False, True),
    "kl_ref_coef": (0.0, None, False, False, False),
    "advantage_std_floor": (0.0, None, False, False, False),
    "importance_cap": (1.0, None, False, False, False),  # an on-policy unit's weight is 1: never capped below it
    "gamma": (0.0, 1.0, False, False, False),
    "gae_lambda": (0.0, 1.0, False, False, False),
    "token_gamma": (0.0, 1.0, False, False, False),
    "learning_rate": (0.0, None, True, False, False),
    "critic_learning_rate": (0.0, None, True, False, False),
    "adam_eps": (0.0, None, True, False, False),
    "max_grad_norm": (0.0, None, True, False, False),
    "temperature": (0.0, None, False, False, False),
    "entropy_surge": (0.0, None, True, False, False),
    "kl_blowup": (0.0, None, True, False, False),
    "replay_fraction": (0.0, 1.0, True, False, False),
    "logprob_tolerance": (0.0, None, True, False, False),
}

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
    train_agents: list[str] | None = None
    """The roles whose adapters train; the team's other roles are frozen (served, traced, never updated), as
    are agents outside the team (e.g. one on an external API). null: every role of the team trains."""
    critic_base: str | None = None
    """A team on several bases: the base whose frozen features the one value head reads (action level only);
    null: one value head per base, each valuing its own agents' actions."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling. A scenario group whose scored episodes all got the same return (`gae.returns_equal`:
    up to 1e-9, relative above 1) teaches the group baseline nothing (every advantage is 0); with this on such groups
    stay out of the update, counted in the metrics row (`dynamic_sampling`). Online, a group with fewer than 2 scored episodes is
    dropped too, and the iteration draws the next scenarios of the cycling list (`dynamic_sampling_max_draws` extra
    collect rounds at most) until it has as many informative groups as scenarios per iteration; short of that it
    trains on what it has and says so. Offline, each iteration's chunk loses its all-equal groups (episodes without
    a scenario, groups of one, are kept). Needs `group_size >= 2`."""
    dynamic_sampling_max_draws: int = 3
    """`dynamic_sampling`: the most extra collect rounds one online iteration may run to refill its dropped groups
    (0: drop them, never draw more)."""

    # --- credit (docs/training.md "Who gets the credit") -------------------------------------------
    credit: str = "group"
    """`group`: one advantage per episode (GAE with a critic, else the return against its scenario group), shared by
    its agents; `reward_to_go` (critic-free): each action's own return from it on (its reward and the later actions')
    against the same agent's in its scenario group, so no agent is credited for what came before it;
    `counterfactual`: each action against replays of its step with the upstream held (`training.credit`)."""
    replays_per_action: int = 2
    """`credit: counterfactual`: replays of each replayed action (its siblings besides itself)."""
    replay_agents: list[str] | None = None
    """The roles whose actions are replayed; null: the trained roles. The others fall back to the group baseline."""
    replay_fraction: float = 1.0
    """The share of an iteration's episodes whose actions are replayed (the rest use the group baseline)."""
    replay_tools: str = "refuse"
    """`refuse`: an action whose upstream made tool calls is not replayed (a replay would run those tools again);
    `rerun`: replay it anyway, running them again (only for tools without side effects)."""
    replay_reference: str | None = None
    """The policy a replayed step is sampled from: null (the agent's current adapter), `base` or a version ref."""
    credit_normalize: str = "joint"
    """`joint`: advantages normalised over all trained actions; `per_agent`: over each agent's own (Dr. MAS)."""

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
    advantage_group_std: bool = True
    """Critic-free credit (`group`, `reward_to_go`): each return against its comparison group's mean is divided by the
    group's std (GRPO). false: the difference itself (Dr. GRPO, Liu et al. 2025), so a group whose returns differ
    only by a step cost does not push as hard as one that differs by a solved answer; `normalize_advantages` then
    scales the whole batch, by at least `advantage_std_floor`."""
    advantage_std_floor: float = 0.0
    """`normalize_advantages` divides by the advantages' std or by this, whichever is larger (in the reward's units):
    a batch whose returns differ only by small amounts (a step cost, a formatting term) then trains little instead
    of being scaled up to the size of a solved-or-not difference. 0: always the std."""
    offline_anchor: str = "current"
    """What the ratio of a record the current weights did not sample (a mined trace, data from before an earlier
    update or a warm start) is clipped around. `current`: the policy at the start of the iteration (one no-grad pass
    over those records), its distance from the recorded behaviour policy applied as an importance weight capped at
    `importance_cap` (decoupled PPO, Hilton et al. 2021); `behaviour`: the recorded log-probs themselves, whose
    ratio to a policy that has moved since can be thousands at action level, so nearly every action is clipped and a
    negative-advantage one pushes without bound. On-policy records are the same either way."""
    importance_cap: float = 1.0
    """Largest importance weight pi_current / pi_behaviour of an off-policy unit (IMPALA's truncation, rho-bar = 1)."""

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
    """Most padded positions one forward+backward of the policy computes beyond the prompt prefix its rows share
    (that prefix runs once, whatever its length, as one long action would): an agent's minibatch runs in
    length-sorted micro-batches of at most this size with a backward after each, so peak activation memory is set
    by this and the longest prompt, not by the batch size or the number of agents. An action longer than this is a
    micro-batch of its own; null: split only by `grad_accum_steps`."""
    inference_batch_tokens: int | None = 4096
    """Most padded positions per batch in the no-gradient passes (behaviour/reference log-probs, critic features,
    post-update check), counted as for `micro_batch_tokens`; those batches are length-sorted too."""
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
    verify_logprobs: str = "first"
    """`first`: at the first pass over records the current adapter weights produced (their span's version is the one
    being trained, not yet updated), recompute their log-probs (one no-grad pass) and leave out those that differ from
    the recorded ones by more than `logprob_tolerance` (a wrong chat template, prompt ids not what the server saw, a
    shifted token); `off`: trust the recorded log-probs."""
    logprob_tolerance: float = 0.1
    """`verify_logprobs`: the largest per-token difference between a recorded and a recomputed log-prob still taken
    for kernel noise. Measured on float32 CPU: at most 1e-6 (tiny model) and 2e-5 (SmolLM2-135M), against 0.8 for a
    prompt with another system turn and 13.5 for a shifted token (135M); the margin is for bf16 GPU kernels and
    a vLLM server, whose log-probs differ more."""
    on_data_mismatch: str = "drop"
    """An action that fails a data check (its grammar rejects its tokens, its log-probs do not match): `drop` leaves it
    out of the update, counted in the metrics and named in a warning (an iteration whose actions all fail stops with
    `TrainingDataError`); `error`: stop at the first iteration with one."""

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
    """Same as listing `tensorboard` in `report_to` (event files in `<run_dir>/tensorboard`)."""
    plots: bool = True

    # --- experiment tracking (docs/tracking.md) --------------------------------------------------
    report_to: list[str] = field(default_factory=list)
    """Trackers the run logs to: any of `tensorboard`, `mlflow`, `wandb` (offline), or `none`."""
    tracking_uri: str | None = None
    """MLflow tracking URI; null: a SQLite store in the run folder (`sqlite:///<run_dir>/mlflow.db`)."""
    experiment: str | None = None
    """MLflow experiment / W&B project; null: `marft-lg`."""

    def __post_init__(self) -> None:
        """Check every value's type and range; a bad one raises `ConfigError` naming the key."""
        for name, allowed in _CHOICES.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ConfigError(f"{value!r} is not one of {list(allowed)}", key=name)
        for name in _POSITIVE_INTS:
            check_int(name, getattr(self, name), low=1)
        check_int("seed", self.seed, low=0)
        for name in ("micro_batch_tokens", "inference_batch_tokens"):
            check_int(name, getattr(self, name), low=1, allow_none=True)
        for name, (low, high, low_open, high_open, allow_none) in _RANGES.items():
            check_range(name, getattr(self, name), low=low, high=high, low_open=low_open, high_open=high_open,
                        allow_none=allow_none)
            value = getattr(self, name)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(self, name, float(value))
        check_int("dynamic_sampling_max_draws", self.dynamic_sampling_max_draws, low=0)
        for name in ("use_critic", "normalize_advantages", "advantage_group_std", "dynamic_sampling", "tensorboard",
                     "plots"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"expected true or false, got {getattr(self, name)!r}", key=name)
        if not isinstance(self.agent_learning_rates, dict):
            raise ConfigError(f"expected a mapping {{role: learning rate}}, got {self.agent_learning_rates!r}",
                              key="agent_learning_rates")
        for role, lr in self.agent_learning_rates.items():
            check_range(("agent_learning_rates", str(role)), lr, low=0.0, low_open=True)
        if self.train_agents is not None:
            if not isinstance(self.train_agents, list) or not all(isinstance(r, str) and r for r in self.train_agents):
                raise ConfigError(f"expected a list of role names, got {self.train_agents!r}", key="train_agents")
            if not self.train_agents:
                raise ConfigError("is empty: name at least one role to train (null trains every role)",
                                  key="train_agents")
            dup = sorted({r for r in self.train_agents if self.train_agents.count(r) > 1})
            if dup:
                raise ConfigError(f"lists {dup} more than once", key="train_agents")
        if self.replay_agents is not None and (not isinstance(self.replay_agents, list) or not self.replay_agents
                                               or not all(isinstance(r, str) and r for r in self.replay_agents)):
            raise ConfigError(f"expected a non-empty list of role names or null, got {self.replay_agents!r}",
                              key="replay_agents")
        if self.replay_reference is not None and (not isinstance(self.replay_reference, str)
                                                  or not self.replay_reference):
            raise ConfigError(f"expected null, 'base' or a version such as 'v3', got {self.replay_reference!r}",
                              key="replay_reference")
        if self.critic_base is not None and (not isinstance(self.critic_base, str) or not self.critic_base):
            raise ConfigError(f"expected a base model name or null, got {self.critic_base!r}", key="critic_base")
        self.report_to = check_report_to(self.report_to)
        for name in ("tracking_uri", "experiment"):
            if getattr(self, name) is not None and (not isinstance(getattr(self, name), str) or not getattr(self, name)):
                raise ConfigError(f"expected text or null, got {getattr(self, name)!r}", key=name)
        if self.dynamic_sampling and self.group_size < 2:
            raise ConfigError("dynamic_sampling: true needs group_size >= 2 (it drops the scenario groups whose K "
                              "episodes all got the same return; a group of one never differs)", key="group_size")
        if self.credit == "reward_to_go" and self.use_critic:
            raise ConfigError("credit: reward_to_go is the critic-free baseline (use_critic: false); with a critic, "
                              "GAE already gives each action the return from it on", key="credit")
        if not self.use_critic and self.group_size < 2:
            raise ConfigError("use_critic: false needs group_size >= 2 (the group-relative baseline "
                              "compares K rollouts of one scenario)", key="group_size")

    def lr_for(self, role: str) -> float:
        """Learning rate of one agent's adapter."""
        return float(self.agent_learning_rates.get(role, self.learning_rate))

    def trackers(self) -> list[str]:
        """The trackers of `report_to`, with `tensorboard` when `tensorboard: true`."""
        return list(dict.fromkeys(self.report_to + (["tensorboard"] if self.tensorboard else [])))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "<dict>", doc: YamlDoc | None = None) -> MARFTConfig:
        """Build from a mapping; an unknown key (with the closest known name), a value of the wrong type or
        out of range raises `ConfigError` naming `source` (or `doc`'s file and line) and the key."""
        doc = doc if doc is not None else YamlDoc.of(data, source)
        checked = check_fields(cls, data, doc, what="MARFTConfig")
        try:
            return cls(**checked)
        except ConfigError as exc:
            raise doc.locate(exc) from None

    @classmethod
    def from_yaml(cls, path: str | Path, *, section: str | None = None) -> MARFTConfig:
        """Load a YAML file (or one `section` of it, e.g. `marft` of a train.yaml)."""
        doc = load_yaml(path, what="MARFTConfig file")
        if section is not None:
            if doc.data is not None and not isinstance(doc.data, dict):
                raise doc.error(f"expected a mapping with a {section!r} section, got {type(doc.data).__name__}")
            doc = doc.at(section)
        return cls.from_dict(doc.data or {}, doc=doc)
