"""A heterogeneous team trained on-policy: roles on two base models (other hidden sizes, other tokenizers) and a
frozen planner on an external OpenAI-compatible endpoint. Only the trained roles change, each on its own base;
the frozen planner is the environment: in the episodes and in its successors' observations and `depends_on`,
never in the update."""

from __future__ import annotations

import pytest
import torch

from examples.mixed_team.external import ExternalEndpoint
from marft_lg.graph.chat_model import TeamChatModel
from marft_lg.graph.wrap import wrap
from marft_lg.serving.team_factory import team as build_team
from marft_lg.training.config import MARFTConfig
from marft_lg.training.rollout import GraphCollector
from marft_lg.training.trainer import MARFTTrainer
from tests.hetero_team import SCENARIOS, TRAINED, adapter_weights, build_graph, episode_reward


@pytest.fixture
def external():
    with ExternalEndpoint(reply=lambda messages: "First add, then double-check the sum.") as server:
        yield server


@pytest.fixture
def hetero(tmp_path, tiny_model_dir, tiny_model_dir_b, external):
    from langchain_openai import ChatOpenAI

    team = build_team({"solver": tiny_model_dir, "checker": tiny_model_dir_b}, registry=tmp_path / "registry",
                versions=None, seed=0)
    planner = ChatOpenAI(base_url=external.base_url, api_key="x", model="external-planner", max_retries=0)
    app = wrap(build_graph(planner, TeamChatModel(team=team, max_tokens=6, temperature=1.0)), team=team,
               trace_dir=tmp_path / "traces")
    yield team, app
    team.close()


def test_bases_differ_in_size_and_tokenizer(hetero):
    team, _ = hetero
    a, b = team.team_of("solver"), team.team_of("checker")
    assert a.model.config.hidden_size != b.model.config.hidden_size
    assert len(a.tokenizer) != len(b.tokenizer)


def test_frozen_planner_is_in_the_episodes_and_its_successors_depends_on(hetero):
    team, app = hetero
    ds = GraphCollector(app, run_id="look").collect(SCENARIOS[:1], 2, 0, seed=1)
    for eid in ds.episode_ids:
        acts = ds.actions[ds.actions["episode_id"] == eid].sort_values("order")
        by_agent = {a["agent"]: a for a in acts.to_dict("records")}
        assert set(by_agent) == {"planner", *TRAINED}
        planner = by_agent["planner"]
        assert planner["completion_logprobs"] is None or len(planner["completion_logprobs"]) == 0
        assert planner["order"] in list(by_agent["solver"]["depends_on"])
        assert "double-check" in str(by_agent["solver"]["messages"])
        for role in TRAINED:
            assert len(by_agent[role]["completion_token_ids"]) > 0 and len(by_agent[role]["completion_logprobs"]) > 0


def test_online_iteration_updates_only_the_trained_roles_on_both_bases(hetero, tmp_path):
    team, app = hetero
    cfg = MARFTConfig(update_scheme="simultaneous", group_size=2, learning_rate=1e-2, kl_cut=None, max_new_tokens=6,
                      plots=False, normalize_advantages=True, rollout_concurrency=4)
    trainer = MARFTTrainer(team, episode_reward, cfg, tmp_path / "run", progress=False)
    assert trainer.frozen_roles == [] and sorted(trainer.bases) == sorted(team.bases)
    assert {b: h.net[0].in_features for b, h in trainer.critic.heads.items()} == {
        team.base_of(r): team.team_of(r).model.config.hidden_size for r in TRAINED}
    before = {r: adapter_weights(team, r) for r in TRAINED}
    row = trainer.fit_online(app, SCENARIOS, iterations=1)[0]
    assert sorted(row["trained_agents"]) == sorted(TRAINED)
    assert row["frozen_agents"] == ["planner"] and row["frozen_actions"] == {"planner": 4}
    assert row["agent_bases"] == {r: team.base_of(r) for r in TRAINED}
    assert sorted(row["published"]) == sorted(TRAINED)
    for role in TRAINED:
        assert row["agents"][role]["steps"] == 1
        after = adapter_weights(team, role)  # the published version now served, with the trained weights
        assert any(not torch.equal(x, y) for x, y in zip(before[role], after, strict=True)), role
        manifest = team.registry.manifest(role, row["published"][role])
        assert manifest["base_name"] == team.base_of(role)


def test_train_agents_freezes_a_served_role_and_the_sequential_scheme_goes_across_bases(hetero, tmp_path):
    team, app = hetero
    cfg = MARFTConfig(train_agents=["checker"], group_size=2, learning_rate=1e-2, kl_cut=None, plots=False,
                      rollout_concurrency=4)
    trainer = MARFTTrainer(team, episode_reward, cfg, tmp_path / "frozen", progress=False)
    assert list(trainer.bases) == [team.base_of("checker")]  # the solver's base is not paused or needed in-process
    solver_before = adapter_weights(team, "solver")
    row = trainer.fit_online(app, SCENARIOS[:1], iterations=1)[0]
    assert row["trained_agents"] == ["checker"] and row["frozen_agents"] == ["planner", "solver"]
    assert all(torch.equal(x, y) for x, y in zip(solver_before, adapter_weights(team, "solver"), strict=True))
    assert team.versions()["solver"] == "init"
    with pytest.raises(ValueError, match="does not serve"):
        MARFTTrainer(team, episode_reward, MARFTConfig(train_agents=["planner"]), tmp_path / "bad", progress=False)

    seq = MARFTTrainer(team, episode_reward, MARFTConfig(group_size=2, kl_cut=None, plots=False, rollout_concurrency=4),
                       tmp_path / "seq", progress=False)
    rows = seq.fit_online(app, SCENARIOS[:1], iterations=2)
    assert [r["trained_agents"] for r in rows] == [["solver"], ["checker"]]  # agent by agent, base by base


def test_one_critic_on_a_chosen_base_values_every_action(hetero, tmp_path):
    team, app = hetero
    chosen = team.base_of("checker")
    cfg = MARFTConfig(critic_base=chosen, update_scheme="simultaneous", group_size=2, kl_cut=None, plots=False,
                      rollout_concurrency=4)
    trainer = MARFTTrainer(team, episode_reward, cfg, tmp_path / "one-critic", progress=False)
    assert list(trainer.critic.heads) == [chosen]
    row = trainer.fit_online(app, SCENARIOS[:1], iterations=1)[0]
    assert row["value_loss"] > 0 and sorted(row["trained_agents"]) == sorted(TRAINED)
    with pytest.raises(ValueError, match="critic_base"):
        MARFTTrainer(team, episode_reward, MARFTConfig(critic_base="nope"), tmp_path / "bad", progress=False)
