"""The waste of an iteration (scenario groups whose returns are all equal, actions with advantage 0, where the time
goes) in every metrics row, and DAPO's dynamic sampling: such groups stay out of the update, counted, and an online
iteration draws the next scenarios until it has its informative groups, within `dynamic_sampling_max_draws`."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from marft_lg._config import ConfigError
from marft_lg.training.checks import TrainingDataError
from marft_lg.training.config import MARFTConfig
from marft_lg.training.gae import group_relative_advantages, returns_equal
from marft_lg.training.policy import LocalPolicy, adapter_parameters
from marft_lg.training.rollout import ChainCollector
from marft_lg.training.sampling import DRAW_STRIDE, draw_iteration
from marft_lg.training.trainer import MARFTTrainer
from marft_lg.trajectories.scenarios import Scenario
from tests.unit.training.conftest import chain_prompt

TIMES = ("rollout_s", "scoring_s", "replay_s", "update_s", "iteration_s", "time_s", "tokens_per_s", "tokens_per_min")


def by_plan(plan: dict[str, list[float]]):
    """A reward fixed by scenario and episode index j (the id's last part): `plan[scenario][j % len]`."""

    def reward(ep):
        values = plan[ep.info["scenario_id"]]
        return values[int(ep.episode_id.rsplit("-", 1)[1]) % len(values)]

    return reward


def _cfg(**kw) -> MARFTConfig:
    base = {"learning_rate": 1e-3, "kl_cut": None, "plots": False, "entropy_surge": 1e9, "kl_blowup": 1e9,
            "use_critic": False, "group_size": 2, "update_scheme": "simultaneous", "entropy_coef": 0.0,
            "offline_episodes_per_iteration": 64, "checkpoint_every": 1}
    return MARFTConfig(**{**base, **kw})


def _weights(trainer, role):
    return [p.detach().clone() for p in adapter_parameters(trainer.model, trainer.adapter_names[role])]


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


class Recording:
    """A collector that runs the tiny chain and remembers each call's scenarios and iteration number."""

    def __init__(self, policy):
        self.inner = ChainCollector(policy, ["reasoner", "actor"], chain_prompt, max_new_tokens=2)
        self.calls: list[tuple[list[str], int]] = []

    def collect(self, scenarios, k, iteration, seed):
        self.calls.append(([s.scenario_id for s in scenarios], iteration))
        return self.inner.collect(scenarios, k, iteration, seed)


SCENARIOS = [Scenario(f"s{i}", {"q": f"question {i}"}) for i in range(4)]


# ---- what is equal ------------------------------------------------------------------------------------------------
def test_equal_returns_are_equal_up_to_float_rounding_and_get_advantage_exactly_zero():
    assert returns_equal([0.1 + 0.2, 0.3]) and returns_equal([1e6, 1e6 + 1e-4]) and returns_equal([2.0])
    assert not returns_equal([0.0, 1e-6]) and not returns_equal([0.5, 0.25])
    adv = group_relative_advantages(torch.tensor([0.1 + 0.2, 0.3, 0.0, 1.0]), ["a", "a", "b", "b"])
    assert adv[0].item() == adv[1].item() == 0.0 and adv[2].item() < 0 < adv[3].item()
    assert draw_iteration(3, 1) == 3 + DRAW_STRIDE and draw_iteration(3, 2) != draw_iteration(4, 1)


def test_config_checks_and_loads_dynamic_sampling(tmp_path):
    assert not MARFTConfig().dynamic_sampling and MARFTConfig().dynamic_sampling_max_draws == 3
    with pytest.raises(ConfigError, match="group_size"):
        MARFTConfig(dynamic_sampling=True, group_size=1)
    with pytest.raises(ConfigError, match="dynamic_sampling_max_draws"):
        MARFTConfig(dynamic_sampling_max_draws=-1)
    with pytest.raises(ConfigError, match="dynamic_sampling"):
        MARFTConfig(dynamic_sampling="yes")
    path = tmp_path / "marft.yaml"
    path.write_text("dynamic_sampling: true\ndynamic_sampling_max_draws: 0\n")
    cfg = MARFTConfig.from_yaml(path)
    assert cfg.dynamic_sampling and cfg.dynamic_sampling_max_draws == 0


# ---- the waste, measured --------------------------------------------------------------------------------------------
def test_the_row_measures_equal_groups_zero_advantages_and_the_time_split(chain_dataset, two_agent_policy, tmp_path):
    """3 scenarios x 2 episodes: s0 both solved, s2 neither (equal), s1 one of two. Without a critic the 8 actions of
    s0 and s2 have advantage exactly 0: 2 of 3 groups and 8 of 12 trained actions are waste."""
    ds, scenarios = chain_dataset
    reward = by_plan({"s0": [1.0], "s1": [0.0, 1.0], "s2": [0.0]})
    trainer = MARFTTrainer(two_agent_policy, reward, _cfg(), tmp_path / "run", progress=False)
    row = trainer.fit_offline(ds, scenarios, iterations=1)[0]
    assert (row["groups"], row["equal_groups"], row["single_groups"]) == (3, 2, 0)
    assert row["equal_groups_share"] == pytest.approx(2 / 3)
    assert row["trained_actions"] == 12 and row["zero_advantage_share"] == pytest.approx(8 / 12)
    assert row["replay_s"] == 0.0 and row["update_s"] == row["time_s"] > 0 and row["scoring_s"] > 0
    assert row["iteration_s"] >= row["update_s"] + row["scoring_s"] - 1e-6
    assert row["tokens_per_min"] == pytest.approx(row["tokens"] / (row["iteration_s"] / 60))
    assert "dynamic_sampling" not in row and row["episodes"] == 6
    logged = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert logged["equal_groups"] == 2 and logged["zero_advantage_share"] == pytest.approx(8 / 12)


def test_an_all_equal_group_gives_no_gradient(chain_dataset, two_agent_policy, tmp_path):
    """Group baseline, no entropy bonus: every advantage is 0, so the adapters do not move (and the row says why)."""
    ds, scenarios = chain_dataset
    trainer = MARFTTrainer(two_agent_policy, by_plan({"s0": [1.0], "s1": [0.0], "s2": [0.5]}), _cfg(),
                           tmp_path / "run", progress=False)
    before = {r: _weights(trainer, r) for r in trainer.roles}
    row = trainer.fit_offline(ds, scenarios, iterations=1)[0]
    assert row["equal_groups_share"] == 1.0 and row["zero_advantage_share"] == 1.0
    assert all(_same(before[r], _weights(trainer, r)) for r in trainer.roles)


# ---- dynamic sampling offline ---------------------------------------------------------------------------------------
def test_offline_dynamic_sampling_trains_exactly_as_on_the_informative_groups_alone(chain_dataset, tiny_model_dir,
                                                                                     tmp_path):
    """The dropped groups leave no trace in the update: the adapters equal those trained on the informative group
    alone, and differ from an update that kept them (advantage normalisation and the PPO averages see them)."""
    ds, scenarios = chain_dataset
    reward = by_plan({"s0": [1.0], "s1": [0.0, 1.0], "s2": [0.0]})

    def train(name, dataset, **kw):
        policy = LocalPolicy(tiny_model_dir, ["reasoner", "actor"], seed=0)
        trainer = MARFTTrainer(policy, reward, _cfg(entropy_coef=0.01, **kw), tmp_path / name, progress=False)
        row = trainer.fit_offline(dataset, scenarios, iterations=1)[0]
        return row, {r: _weights(trainer, r) for r in trainer.roles}

    row, sampled = train("sampled", ds, dynamic_sampling=True)
    _, alone = train("alone", ds.select(ds.scenario_groups()["s1"]))
    _, everything = train("everything", ds)
    assert all(_same(sampled[r], alone[r]) for r in sampled)
    assert not all(_same(sampled[r], everything[r]) for r in sampled)
    assert row["dynamic_sampling"] == {"draws": 1, "wanted": None, "informative": 1, "dropped_groups": 2,
                                       "dropped_equal": 2, "dropped_single": 0, "dropped_episodes": 4,
                                       "kept_episodes": 2, "short": 0}
    assert row["episodes"] == 6 and row["equal_groups"] == 2  # the row's rewards and waste: the whole chunk
    assert row["trained_actions"] == 4 and row["zero_advantage_share"] == 0.0


def test_offline_chunk_with_only_equal_groups_says_dynamic_sampling_dropped_them(chain_dataset, two_agent_policy,
                                                                                 tmp_path):
    ds, scenarios = chain_dataset
    trainer = MARFTTrainer(two_agent_policy, by_plan({"s0": [1.0], "s1": [0.0], "s2": [1.0]}),
                           _cfg(dynamic_sampling=True), tmp_path / "run", progress=False)
    with pytest.raises(TrainingDataError, match=r"dynamic sampling dropped every scenario group .* 3 group\(s\) "
                                                r"whose episodes all got the same return"):
        trainer.fit_offline(ds, scenarios, iterations=1)


# ---- dynamic sampling online ----------------------------------------------------------------------------------------
def test_online_draws_again_until_it_has_its_informative_groups(two_agent_policy, tmp_path):
    """s0 and s1 always score alike: the first draw has no informative group, the second (the next two scenarios of
    the list, as iteration 1000000: new episode ids and seeds) has both."""
    collector = Recording(two_agent_policy)
    reward = by_plan({"s0": [1.0], "s1": [0.0], "s2": [0.0, 1.0], "s3": [1.0, 0.0]})
    trainer = MARFTTrainer(two_agent_policy, reward, _cfg(dynamic_sampling=True), tmp_path / "run", progress=False)
    row = trainer.fit_online(collector, SCENARIOS, iterations=1, scenarios_per_iteration=2)[0]
    assert collector.calls == [(["s0", "s1"], 0), (["s2", "s3"], DRAW_STRIDE)]
    assert row["dynamic_sampling"] == {"draws": 2, "wanted": 2, "informative": 2, "dropped_groups": 2,
                                       "dropped_equal": 2, "dropped_single": 0, "dropped_episodes": 4,
                                       "kept_episodes": 4, "short": 0}
    assert row["episodes"] == 8 and row["groups"] == 4 and row["equal_groups_share"] == 0.5  # all that was collected
    assert row["trained_actions"] == 8 and row["zero_advantage_share"] == 0.0
    assert row["rollout_s"] > 0 and row["scoring_s"] > 0 and row["iteration_s"] >= row["rollout_s"] + row["update_s"]
    assert trainer.extra_scenarios == 2
    trainer.fit_online(collector, SCENARIOS, iterations=2, scenarios_per_iteration=2)
    assert collector.calls[2] == (["s0", "s1"], 1)  # the next iteration starts after the scenarios drawn


def test_counterfactual_credit_is_computed_on_the_kept_episodes(two_agent_policy, tmp_path):
    class Running(Recording):
        def run(self, jobs):  # what counterfactual credit replays through (never reached: the spy answers)
            raise AssertionError("not replayed in this test")

    collector = Running(two_agent_policy)
    trainer = MARFTTrainer(two_agent_policy, by_plan({"s0": [1.0], "s1": [0.0, 1.0], "s2": [0.5], "s3": [0.5]}),
                           _cfg(dynamic_sampling=True, credit="counterfactual", dynamic_sampling_max_draws=0),
                           tmp_path / "run", progress=False)
    seen = []
    trainer._credit = lambda runner, dataset, rewards, objects: seen.append(sorted(dataset.episode_ids))  # noqa: ARG005
    row = trainer.fit_online(collector, SCENARIOS, iterations=1, scenarios_per_iteration=2)[0]
    assert seen == [sorted(f"chain-it0-s1-{j}" for j in range(2))]
    assert row["dynamic_sampling"]["short"] == 1


def test_the_draw_budget_bounds_the_refill_and_the_row_reports_the_shortfall(two_agent_policy, tmp_path, caplog):
    collector = Recording(two_agent_policy)
    reward = by_plan({"s0": [1.0], "s1": [0.0], "s2": [0.0, 1.0], "s3": [1.0]})
    trainer = MARFTTrainer(two_agent_policy, reward, _cfg(dynamic_sampling=True, dynamic_sampling_max_draws=1),
                           tmp_path / "run", progress=False)
    with caplog.at_level(logging.WARNING, logger="marft_lg.training"):
        row = trainer.fit_online(collector, SCENARIOS, iterations=1, scenarios_per_iteration=2)[0]
    assert [c[0] for c in collector.calls] == [["s0", "s1"], ["s2", "s3"]]  # one extra round, then it trains
    assert row["dynamic_sampling"] == {"draws": 2, "wanted": 2, "informative": 1, "dropped_groups": 3,
                                       "dropped_equal": 3, "dropped_single": 0, "dropped_episodes": 6,
                                       "kept_episodes": 2, "short": 1}
    assert "found 1 of 2 informative scenario groups in 2 draw(s)" in caplog.text


def test_no_informative_group_in_the_budget_stops_with_a_message_naming_dynamic_sampling(two_agent_policy, tmp_path):
    collector = Recording(two_agent_policy)
    trainer = MARFTTrainer(two_agent_policy, lambda ep: 1.0, _cfg(dynamic_sampling=True, dynamic_sampling_max_draws=2),
                           tmp_path / "run", progress=False)
    with pytest.raises(TrainingDataError, match=r"no on-policy iteration of this call had anything to train: .*"
                                                r"dynamic sampling dropped every scenario group in 3 draw\(s\)"):
        trainer.fit_online(collector, SCENARIOS, iterations=1, scenarios_per_iteration=2)
    assert [c[1] for c in collector.calls] == [0, DRAW_STRIDE, 2 * DRAW_STRIDE]
    [row] = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert row["updated_agents"] == [] and "dynamic sampling dropped every scenario group" in row["skipped_update"]
    assert row["dynamic_sampling"]["informative"] == 0 and row["reward_mean"] == 1.0
    assert row["equal_groups_share"] == 1.0 and row["equal_groups"] == row["groups"] == 6  # the waste, counted


def test_an_iteration_with_nothing_informative_is_skipped_and_the_run_goes_on(two_agent_policy, tmp_path, caplog):
    """s0 and s1 always score alike (iteration 0 skips its update, said in its row and a warning); s2 and s3 do not
    (iteration 1 trains): one uninformative iteration does not stop a long run."""
    reward = by_plan({"s0": [1.0], "s1": [0.0], "s2": [0.0, 1.0], "s3": [1.0, 0.0]})
    collector = Recording(two_agent_policy)
    trainer = MARFTTrainer(two_agent_policy, reward, _cfg(dynamic_sampling=True, dynamic_sampling_max_draws=0),
                           tmp_path / "run", progress=False)
    with caplog.at_level(logging.WARNING, logger="marft_lg.training"):
        rows = trainer.fit_online(collector, SCENARIOS, iterations=2, scenarios_per_iteration=2)
    assert [bool(r.get("skipped_update")) for r in rows] == [True, False]
    assert rows[0]["updated_agents"] == [] and rows[1]["updated_agents"]
    assert "this iteration's update is skipped" in caplog.text


def test_resume_is_exact_with_dynamic_sampling(tiny_model_dir, tmp_path):
    """The scenario cursor the extra draws moved is in the checkpoint: a run stopped after one iteration and resumed
    draws the same scenarios, and ends with the same adapters and rows, as one that never stopped."""
    reward = by_plan({"s0": [1.0], "s1": [0.0, 1.0], "s2": [0.0], "s3": [1.0, 0.0]})

    def run(name, plan):
        calls = []
        for iterations, resume in plan:
            policy = LocalPolicy(tiny_model_dir, ["reasoner", "actor"], seed=0)
            collector = Recording(policy)
            trainer = MARFTTrainer(policy, reward, _cfg(dynamic_sampling=True), tmp_path / name, progress=False)
            trainer.fit_online(collector, SCENARIOS, iterations=iterations, scenarios_per_iteration=2, resume=resume)
            calls += collector.calls
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return trainer, calls, rows

    straight, calls_a, rows_a = run("a", [(3, False)])
    resumed, calls_b, rows_b = run("b", [(1, False), (3, True)])
    assert calls_a == calls_b and straight.extra_scenarios == resumed.extra_scenarios > 0
    assert max(r["dynamic_sampling"]["draws"] for r in rows_a) > 1
    for role in straight.roles:
        assert _same(_weights(straight, role), _weights(resumed, role))
    strip = [{k: v for k, v in r.items() if k not in TIMES} for r in rows_a]
    assert strip == [{k: v for k, v in r.items() if k not in TIMES} for r in rows_b]


def test_with_every_scenario_per_iteration_the_refill_starts_the_list_again(two_agent_policy, tmp_path, caplog):
    """No `scenarios_per_iteration`: each iteration runs the whole list; a refill draws from its start, as new
    episodes (another iteration number), and what it finds is what the iteration trains on."""
    collector = Recording(two_agent_policy)
    reward = by_plan({"s0": [1.0], "s1": [0.0, 1.0]})
    trainer = MARFTTrainer(two_agent_policy, reward, _cfg(dynamic_sampling=True, dynamic_sampling_max_draws=1),
                           tmp_path / "run", progress=False)
    with caplog.at_level(logging.WARNING, logger="marft_lg.training"):
        row = trainer.fit_online(collector, SCENARIOS[:2], iterations=1)[0]
    assert collector.calls == [(["s0", "s1"], 0), (["s0"], DRAW_STRIDE)]
    assert row["dynamic_sampling"]["draws"] == 2 and row["dynamic_sampling"]["short"] == 1
    assert row["dynamic_sampling"]["dropped_episodes"] == 4 and row["episodes"] == 6
