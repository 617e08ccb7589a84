"""marft_lg: train the agents of a LangGraph app with Multi-Agent Reinforcement Fine-Tuning.

The public surface is re-exported here and imported lazily, so `import marft_lg` stays cheap
(torch and transformers load only when a name that needs them is used).
"""

from __future__ import annotations

from marft_lg._lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # serving
    "ChatRequest": "marft_lg.serving.types",
    "Completion": "marft_lg.serving.types",
    "Team": "marft_lg.serving.team",
    "team": "marft_lg.serving.team_factory",
    "AdapterRegistry": "marft_lg.serving.registry.store",
    "resolve_model": "marft_lg.serving.engine.models",
    # graph + tracing
    "TeamChatModel": "marft_lg.graph.chat_model",
    "wrap": "marft_lg.graph.wrap",
    "record_feedback": "marft_lg.tracing.feedback",
    # trajectories
    "TrajectoryDataset": "marft_lg.trajectories.dataset",
    "Episode": "marft_lg.trajectories.dataset",
    "Scenario": "marft_lg.trajectories.scenarios",
    "ScenarioSet": "marft_lg.trajectories.scenarios",
    "mine": "marft_lg.trajectories.mining",
    # rewards
    "CompositeReward": "marft_lg.rewards.composite",
    "RewardComponent": "marft_lg.rewards.base",
    # training
    "MARFTConfig": "marft_lg.training.config",
    "MARFTTrainer": "marft_lg.training.trainer",
    # evaluation
    "shadow_compare": "marft_lg.evaluation.shadow",
    "PromotionGate": "marft_lg.evaluation.gate",
    # jobs
    "RetrainJob": "marft_lg.jobs.config",
    # tracking
    "open_tracker": "marft_lg.tracking.base",
    "export_version": "marft_lg.tracking.export",
}

__all__ = sorted(_EXPORTS) + ["__version__"]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, extra=("__version__",))
