"""`credit: counterfactual`: each action against the replays of its step (leave-one-out over the siblings that share
its upstream), checked against a hand computation; the trainer runs the replays each iteration, trains on the
episodes' actions and the replayed steps with those advantages, and its metrics row says what the replays cost."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "graph"))
from graph_apps import linear  # noqa: E402
from graph_fakes import FakeEngine  # noqa: E402

from marft_lg import wrap  # noqa: E402
from marft_lg.graph import TeamChatModel  # noqa: E402
from marft_lg.graph.collect import GraphCollector  # noqa: E402
from marft_lg.graph.replays import ReplayBudget, plan_replays  # noqa: E402
from marft_lg.serving.team import Team  # noqa: E402
from marft_lg.training.buffer import build_buffer  # noqa: E402
from marft_lg.training.config import MARFTConfig  # noqa: E402
from marft_lg.training.credit import counterfactual_credit  # noqa: E402
from marft_lg.training.trainer import MARFTTrainer  # noqa: E402
from marft_lg.trajectories.scenarios import Scenario  # noqa: E402

SCENARIO = Scenario("s", {"msgs": ["go"]})


def test_counterfactual_advantages_match_a_hand_computation(tmp_path):
    app = wrap(linear(TeamChatModel()), team=FakeEngine(), trace_dir=tmp_path)
    collector = GraphCollector(app)
    ds = collector.collect([SCENARIO], 2, 0, seed=3)
    e0, e1 = ds.episode_ids
    batch = plan_replays(ds.select([e0]), {"s": SCENARIO}, ReplayBudget(per_action=3, agents=["writer"]), seed=1)
    replayed = collector.run(batch.jobs)
    ra, rb, rc = (j.episode_id for j in batch.jobs)
    plans = {j.episode_id: j.replay for j in batch.jobs}
    # the tree: e0 (return 1) and e1 (return 0) of one scenario; e0's writer step replayed 3 times, returns 0 and
    # 0.5, the third replay unscored (failed)
    credit = counterfactual_credit(ds, {e0: 1.0, e1: 0.0}, replayed, {ra: 0.0, rb: 0.5}, plans)
    adv = credit.advantages
    assert adv[(e0, 1)] == pytest.approx(1.0 - (0.0 + 0.5) / 2)  # e0's writer vs its replays
    assert adv[(ra, 1)] == pytest.approx(0.0 - (1.0 + 0.5) / 2)  # each replayed step vs the other siblings
    assert adv[(rb, 1)] == pytest.approx(0.5 - (1.0 + 0.0) / 2)
    for order in (0, 2):  # not replayed: the episode against its scenario group
        assert adv[(e0, order)] == pytest.approx(1.0 - 0.5)
    for order in (0, 1, 2):
        assert adv[(e1, order)] == pytest.approx(0.0 - 0.5)
    assert (rc, 1) not in adv and credit.failed == 1 and credit.used == 2
    assert credit.counterfactual_actions == 1 and credit.fallback_actions == 5
    assert set(adv) == {(e0, 0), (e0, 1), (e0, 2), (e1, 0), (e1, 1), (e1, 2), (ra, 1), (rb, 1)}

    # the buffer keeps exactly the credited actions (a replay's held and later actions are not trained on)
    rewards = {e0: [0, 0, 1.0], e1: [0, 0, 0.0], ra: [0, 0, 0.0], rb: [0, 0, 0.5]}
    from marft_lg.trajectories.dataset import TrajectoryDataset

    both = TrajectoryDataset.concat([ds, replayed.select([ra, rb])])

    class Tok:  # the fake engine's ids are all there: nothing is re-tokenised
        def apply_chat_template(self, *a, **k):
            raise AssertionError("no re-tokenising expected")

    buffer = build_buffer(both, rewards, Tok(), max_context=10_000, credit=adv)
    assert {(r.episode_id, r.order): r.advantage for r in buffer.records} == pytest.approx(adv)
    assert buffer.skipped["not_credited"] == 4


@pytest.fixture()
def tiny_team(tiny_model_dir, tmp_path):
    team = Team(tiny_model_dir, ["planner", "writer", "critic"], registry=tmp_path / "registry", versions=None, seed=0)
    yield team
    team.close()


def _reward(episode) -> float:
    return float(sum(len(str(a["completion"])) for a in episode.actions) % 3) / 2.0


def test_an_online_iteration_with_counterfactual_credit(tiny_team, tmp_path):
    torch.manual_seed(0)
    app = wrap(linear(TeamChatModel(max_tokens=4)), team=tiny_team, trace_dir=tmp_path / "traces")
    cfg = MARFTConfig(credit="counterfactual", replays_per_action=2, replay_agents=["writer", "critic"],
                      use_critic=False, group_size=2, update_scheme="simultaneous", learning_rate=1e-3, kl_cut=None,
                      max_new_tokens=4, plots=False, rollout_concurrency=4, credit_normalize="per_agent")
    trainer = MARFTTrainer(tiny_team, _reward, cfg, tmp_path / "run", progress=False)
    row = trainer.fit_online(app, [SCENARIO], iterations=1)[0]
    assert row["replays"] == 2 * 2 * 2  # 2 episodes x (writer, critic) x 2 replays
    assert row["replay_s"] > 0 and row["replays_used"] + row["replays_diverged"] + row["replays_failed"] == 8
    assert row["replays_used"] == 8  # TeamChatModel on the team: every upstream held
    # the planner trains too but is not replayed: its 2 actions fall back to the group baseline
    assert row["counterfactual_actions"] == 4 and row["fallback_actions"] == 2
    assert sorted(row["trained_agents"]) == ["critic", "planner", "writer"]
    assert row["reward_mean"] is not None  # the row's reward is the episodes', not the replays'
    app.flush()
    from marft_lg import mine

    assert len(mine(tmp_path / "traces")) == 2  # the 8 replays were never production data
    app.close()


def test_credit_settings_are_checked():
    from marft_lg._config import ConfigError

    with pytest.raises(ConfigError, match="credit"):
        MARFTConfig(credit="shapley")
    with pytest.raises(ConfigError, match="replay_fraction"):
        MARFTConfig(replay_fraction=0.0)
    with pytest.raises(ConfigError, match="replay_agents"):
        MARFTConfig(replay_agents=[])
    with pytest.raises(ConfigError, match="replay_tools"):
        MARFTConfig(replay_tools="sometimes")
