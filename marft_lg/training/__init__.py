"""marft_lg.training: MARFT PPO for the team's adapters (offline from traces, then on-policy).

Names are imported lazily so `marft-lg --help` does not pull in torch.
"""

from __future__ import annotations

from typing import Any

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


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'marft_lg.training' has no attribute {name!r}")
