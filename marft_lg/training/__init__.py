"""marft_lg.training: MARFT PPO for the team's adapters (offline from traces, then on-policy).

Names are imported lazily so `marft-lg --help` does not pull in torch.
"""

from __future__ import annotations

from marft_lg._lazy import lazy_exports

_EXPORTS = {
    "MARFTConfig": "marft_lg.training.config",
    "MARFTTrainer": "marft_lg.training.trainer",
    "flat_gae": "marft_lg.training.gae",
    "token_gae": "marft_lg.training.gae",
    "LocalPolicy": "marft_lg.training.policy",
    "ChainCollector": "marft_lg.training.rollout",
    "GraphCollector": "marft_lg.training.rollout",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
