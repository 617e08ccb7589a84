"""A heterogeneous team with the real SmolLM2-135M as one base: the solver on 135M, the checker on a small model
with another tokenizer, the planner frozen on an external OpenAI-compatible endpoint. One on-policy iteration
trains and publishes both workers, each on its own base; a comparison replays both version maps and its
report names each agent's base."""

from __future__ import annotations

import pytest
import torch

from examples.mixed_team.external import ExternalEndpoint
from marft_lg.evaluation.shadow import shadow_compare
from marft_lg.graph.chat_model import TeamChatModel
from marft_lg.graph.wrap import wrap
from marft_lg.rewards.composite import CompositeReward
from marft_lg.serving.team_factory import team as build_team
from marft_lg.training.config import MARFTConfig
from marft_lg.training.trainer import MARFTTrainer
from marft_lg.trajectories.scenarios import Scenario
from tests.hetero_team import adapter_weights, build_graph, episode_reward

pytestmark = pytest.mark.integration


def test_real_base_beside_a_small_one_and_a_frozen_planner(embedded_model_dir, tiny_model_dir_b, tmp_path):
    from langchain_openai import ChatOpenAI

    torch.set_num_threads(2)
    scenarios = [Scenario(f"s{i}", {"question": f"What is {i + 2} + {i + 5}?"}) for i in range(2)]
    with ExternalEndpoint(reply=lambda messages: "Add the two numbers.") as external, \
            build_team({"solver": embedded_model_dir, "checker": tiny_model_dir_b}, registry=tmp_path / "registry",
                 versions=None, seed=0) as team:
        planner = ChatOpenAI(base_url=external.base_url, api_key="x", model="external-planner", max_retries=0)
        app = wrap(build_graph(planner, TeamChatModel(team=team, max_tokens=8, temperature=1.0)), team=team,
                   trace_dir=tmp_path / "traces")
        before = {r: adapter_weights(team, r) for r in ("solver", "checker")}
        cfg = MARFTConfig(update_scheme="simultaneous", group_size=2, learning_rate=1e-3, kl_cut=None, plots=False,
                          rollout_concurrency=4)
        row = MARFTTrainer(team, episode_reward, cfg, tmp_path / "run", progress=False).fit_online(app, scenarios, 1)[0]
        assert row["frozen_agents"] == ["planner"] and sorted(row["published"]) == ["checker", "solver"]
        for role in ("solver", "checker"):
            assert any(not torch.equal(a, b) for a, b in zip(before[role], adapter_weights(team, role), strict=True))
        assert team.registry.manifest("solver", "v1")["base_name"] != team.registry.manifest("checker", "v1")["base_name"]

        reward = CompositeReward.from_yaml({"weights": {"format_compliance": 1.0}, "components": {
            "format_compliance": {"agents": {"checker": "^[A-Za-z]", "solver": "[0-9]"}}}})
        result = shadow_compare(app, {"solver": "init", "checker": "init"}, {"solver": "v1", "checker": "v1"},
                                scenarios, reward, progress=False, drift_prompts=2)
        assert result.meta["agent_bases"] == {"solver": team.base_of("solver"), "checker": team.base_of("checker")}
        assert result.meta["frozen_agents"] == ["planner"]
        assert set(result.drift) == {"solver", "checker"} and all(d["n_tokens"] > 0 for d in result.drift.values())
