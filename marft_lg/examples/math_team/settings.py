"""The MARFT settings the math team learns with on 2 CPU cores (docs/training.md says why each).

Shared by `marft_lg.examples.math_team.learn` (the 20-minute learning evidence) and `marft-lg demo`.
"""

ROLLOUT_TEMPERATURE = 0.8

MARFT_SETTINGS = {
    "learning_rate": 1e-3, "update_scheme": "simultaneous", "use_critic": False, "temperature": ROLLOUT_TEMPERATURE,
    "ppo_epochs": 1, "num_minibatches": 2, "kl_cut": None, "entropy_coef": 0.0,
}

# Per-agent reply caps: the reasoner's set-up fits in 32 tokens, the actor's boxed answer in 24.
REPLY_TOKENS = {"reasoner_tokens": 32, "actor_tokens": 24}
