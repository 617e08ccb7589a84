"""`credit: reward_to_go`: without a critic each action is compared on its own return from it on (its reward and the
later actions'), against the same agent's k-th action in its scenario group, instead of the episode's whole return:
an agent is not credited for rewards earned before it acted."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from marft_lg._config import ConfigError
from marft_lg.training.batch import compute_advantages
from marft_lg.training.buffer import ActionRecord
from marft_lg.training.config import MARFTConfig
from marft_lg.training.policy import adapter_parameters
from marft_lg.training.trainer import MARFTTrainer


def _record(episode: str, order: int, agent: str, reward: float, scenario: str = "s") -> ActionRecord:
    return ActionRecord(episode_id=episode, scenario_id=scenario, order=order, agent=agent, adapter_version=None,
                        prompt_ids=[1], completion_ids=[2, 3], behaviour_logprobs=[-1.0, -1.0], reward=reward,
                        done=False, words=1)


def _advantages(records: list[ActionRecord], credit: str) -> list[float]:
    cfg = MARFTConfig(use_critic=False, group_size=2, credit=credit)
    adv, ret = compute_advantages(records, [torch.zeros(1) for _ in records], cfg)
    for a, r in zip(adv, ret, strict=True):  # one value per token of the action, its return the same advantage
        assert a.shape == (2,) and bool((a == a[0]).all()) and float(r[0]) == pytest.approx(float(a[0]))
    return [float(a[0]) for a in adv]


def _two_agent_group(reasoner: list[float], actor: list[float]) -> list[ActionRecord]:
    out = []
    for j, (r, a) in enumerate(zip(reasoner, actor, strict=True)):
        out += [_record(f"e{j}", 0, "reasoner", r), _record(f"e{j}", 1, "actor", a)]
    return out


def test_the_later_agent_is_not_credited_for_the_earlier_agents_reward():
    # the reasoner's set-up reward differs, the actor's own reward is the same in every episode
    records = _two_agent_group([0.5, 0.0, 0.5, 0.0], [1.0, 1.0, 1.0, 1.0])
    group, to_go = _advantages(records, "group"), _advantages(records, "reward_to_go")
    assert group[1] == pytest.approx(1.0, abs=1e-4) and group[3] == pytest.approx(-1.0, abs=1e-4)  # the episode's return: actor credited
    assert to_go[1::2] == [0.0, 0.0, 0.0, 0.0]  # its own return does not differ: nothing to learn
    assert to_go[0::2] == pytest.approx(group[0::2])  # the first agent's return from it on is the whole return


def test_the_actor_is_compared_on_its_own_reward():
    records = _two_agent_group([0.5, 0.5, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0])
    to_go = _advantages(records, "reward_to_go")
    assert to_go[1::2] == pytest.approx([1.0, -1.0, 1.0, -1.0], abs=1e-4)  # the group baseline's std-scaled comparison
    totals = torch.tensor([1.5, 0.5, 1.0, 0.0])
    assert to_go[0::2] == pytest.approx(((totals - totals.mean()) / totals.std(unbiased=False)).tolist(), abs=1e-5)


def test_order_not_list_position_decides_what_comes_after():
    records = list(reversed(_two_agent_group([0.5, 0.0], [1.0, 1.0])))  # actor records listed first
    to_go = _advantages(records, "reward_to_go")
    assert to_go[0] == 0.0 and to_go[2] == 0.0  # the actors (order 1): equal own rewards
    assert to_go[1] == pytest.approx(-1.0, abs=1e-4) and to_go[3] == pytest.approx(1.0, abs=1e-4)


def test_an_agent_acting_twice_is_compared_occurrence_by_occurrence_and_groups_stay_apart():
    records = [_record("a", 0, "w", 0.0), _record("a", 1, "w", 1.0),   # w twice: returns 1.0 then 1.0
               _record("b", 0, "w", 0.0), _record("b", 1, "w", 0.0),   # 0.0 then 0.0
               _record("c", 0, "w", 1.0, scenario="t"), _record("d", 0, "w", 0.0, scenario="t"),
               _record("e", 0, "w", 1.0, scenario="u")]              # a scenario run once: nothing to compare
    to_go = _advantages(records, "reward_to_go")
    assert to_go[0] == pytest.approx(1.0, abs=1e-4) and to_go[2] == pytest.approx(-1.0, abs=1e-4)  # first occurrences: 1.0 vs 0.0
    assert to_go[1] == pytest.approx(1.0, abs=1e-4) and to_go[3] == pytest.approx(-1.0, abs=1e-4)  # second: 1.0 vs 0.0
    assert to_go[4] == pytest.approx(1.0, abs=1e-4) and to_go[5] == pytest.approx(-1.0, abs=1e-4) and to_go[6] == 0.0


def test_a_counterfactual_advantage_still_wins_and_the_config_is_checked(tmp_path):
    records = _two_agent_group([0.5, 0.0], [1.0, 1.0])
    records[1] = replace(records[1], advantage=0.7)
    assert _advantages(records, "reward_to_go")[1] == pytest.approx(0.7)
    with pytest.raises(ConfigError, match="reward_to_go is the critic-free baseline"):
        MARFTConfig(credit="reward_to_go", use_critic=True)
    with pytest.raises(ConfigError, match="credit"):
        MARFTConfig(credit="to_go", use_critic=False, group_size=2)
    path = tmp_path / "train.yaml"
    path.write_text("credit: reward_to_go\nuse_critic: false\ngroup_size: 4\n")
    assert MARFTConfig.from_yaml(path).credit == "reward_to_go"


def _weights(trainer, role):
    return [p.detach().clone() for p in adapter_parameters(trainer.model, trainer.adapter_names[role])]


@pytest.mark.parametrize("credit", ["group", "reward_to_go"])
def test_the_trainer_leaves_an_agent_whose_own_returns_are_equal_untouched(chain_dataset, two_agent_policy, tmp_path,
                                                                           credit):
    """The real update on the tiny model: the reasoner's reward differs within each scenario group, the actor's does
    not. The episode's return moves both adapters; the return from each action on moves the reasoner's only."""
    ds, scenarios = chain_dataset
    rewards = {e: np.array([0.5 * (int(e.rsplit("-", 1)[1]) % 2), 1.0]) for e in ds.episode_ids}
    cfg = MARFTConfig(learning_rate=1e-2, kl_cut=None, plots=False, entropy_surge=1e9, kl_blowup=1e9,
                      use_critic=False, group_size=2, entropy_coef=0.0, update_scheme="simultaneous",
                      offline_episodes_per_iteration=64, checkpoint_every=1, credit=credit)
    trainer = MARFTTrainer(two_agent_policy, lambda ep: 0.0, cfg, tmp_path / "run", progress=False)
    before = {r: _weights(trainer, r) for r in trainer.roles}
    row = trainer.fit_offline(ds, scenarios, action_rewards=rewards, iterations=1)[0]
    moved = {r: not all(torch.equal(x, y) for x, y in zip(before[r], _weights(trainer, r), strict=True))
             for r in trainer.roles}
    assert moved["reasoner"]
    assert moved["actor"] == (credit == "group")
    assert row["zero_advantage_share"] == pytest.approx(0.0 if credit == "group" else 0.5)


def test_the_group_baseline_counts_each_episode_once_however_many_actions_it_has():
    records = [_record("a", 0, "w", 0.0), _record("a", 1, "w", 0.5), _record("a", 2, "w", 0.5),
               _record("b", 0, "w", 0.0)]
    assert _advantages(records, "group") == pytest.approx([1.0, 1.0, 1.0, -1.0], abs=1e-4)
