"""MARFT through the real stack: embedded 135M Team -> wrapped math-team graph -> traces -> mine -> reward -> PPO."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from marft_lg.examples.math_team.graph import ROLES, build_graph
from marft_lg.examples.math_team.problems import make_problems
from marft_lg.examples.math_team.reward import math_reward

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def stack(embedded_model_dir, tmp_path_factory):
    from marft_lg.graph.chat_model import TeamChatModel
    from marft_lg.graph.wrap import wrap
    from marft_lg.serving.team import Team

    torch.set_num_threads(2)
    root = tmp_path_factory.mktemp("marft")
    team = Team(embedded_model_dir, ROLES, registry=root / "registry", versions=None, seed=0)
    app = wrap(build_graph(TeamChatModel(team=team, max_tokens=12, temperature=1.0)), team=team,
               trace_dir=root / "traces")
    yield team, app, root
    team.close()


def test_offline_uses_engine_logprobs_and_online_publishes(stack):
    from marft_lg.training.batch import BaseModel, behaviour_logprobs
    from marft_lg.training.buffer import build_buffer
    from marft_lg.training.config import MARFTConfig
    from marft_lg.training.rollout import GraphCollector
    from marft_lg.training.trainer import MARFTTrainer

    team, app, root = stack
    scenarios = list(make_problems(2, 0, seed=1))
    reward = math_reward()
    ds = GraphCollector(app, run_id="offline").collect(scenarios, 2, 0, seed=3)
    assert len(ds) == 4 and set(ds.actions["agent"]) == set(ROLES)

    # the behaviour log-probs recorded by the engine are what the trainer's own pass computes
    buf = build_buffer(ds, {e: [0.0, 1.0] for e in ds.episode_ids}, team.tokenizer, max_context=2048)
    assert buf.n_recomputed == 0
    recorded = [list(r.behaviour_logprobs) for r in buf.records]
    flagged = [replace(r, behaviour_logprobs=None) for r in buf.records]
    cfg = MARFTConfig(learning_rate=1e-4, update_scheme="simultaneous", use_critic=False, group_size=2, kl_cut=None,
                      plots=False)
    with team.exclusive() as model:
        recomputed = behaviour_logprobs(flagged, {"": BaseModel(model, team.tokenizer.pad_token_id)},
                                        lambda r: team.adapter_name(r.agent), cfg)
    for rec, lp in zip(recorded, recomputed, strict=True):
        torch.testing.assert_close(lp, torch.tensor(rec), rtol=0, atol=2e-3)

    trainer = MARFTTrainer(team, reward, cfg, root / "run", progress=False)
    rows = trainer.fit_offline(ds, scenarios, iterations=1)
    assert rows[0]["recomputed_logprobs"] == 0 and rows[0]["agents"]["actor"]["steps"] == 1
    before = team.versions()
    rows = trainer.fit_online(app, scenarios, iterations=1)
    assert rows[0]["episodes"] == 2 * cfg.group_size and rows[0]["reward_mean"] is not None
    after = team.versions()
    assert all(after[r] != before[r] for r in ROLES) and set(rows[0]["published"]) == set(ROLES)
    assert team.registry.versions("actor")  # written through the registry
