"""The warm start (rejection-sampling fine-tuning) on the tiny model: which episodes teach (best of each group,
a threshold, positive feedback), that only the kept episodes' actions of the trained agents are learned from
(frozen agents untouched), that the kept completions become likelier, and that nothing kept is an error."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from marft_lg.training.checks import TrainingDataError
from marft_lg.training.config import MARFTConfig
from marft_lg.training.policy import LocalPolicy, adapter_parameters
from marft_lg.training.trainer import MARFTTrainer
from marft_lg.training.warm_start import WarmStartConfig, select_episodes, warm_start


def hashed_reward(ep):
    """A distinct reward per episode (the id's hash), so every group has one best episode."""
    return float(int(hashlib.sha256(ep.episode_id.encode()).hexdigest()[:6], 16) % 97) / 97


def _cfg(**kw):
    return MARFTConfig(**{"learning_rate": 1e-3, "plots": False, "kl_cut": None, "entropy_surge": 1e9,
                          "kl_blowup": 1e9, "num_minibatches": 1, **kw})


def _weights(policy, adapter):
    return [p.detach().clone() for p in adapter_parameters(policy.model, adapter)]


def _table(ds, fn=hashed_reward):
    eps = list(ds.iter_episodes())
    return __import__("pandas").DataFrame({"episode_id": [e.episode_id for e in eps],
                                           "reward": [fn(e) for e in eps], "scored": [True] * len(eps)})


def test_the_best_of_each_group_a_threshold_or_positive_feedback_is_kept(chain_dataset):
    ds, _ = chain_dataset
    table = _table(ds)
    kept, stats = select_episodes(ds, table, WarmStartConfig())
    reward = dict(zip(table["episode_id"], table["reward"], strict=True))
    groups = ds.scenario_groups()
    assert len(kept) == len(groups) == stats["groups"] == 3
    for members in groups.values():
        assert max(members, key=reward.get) in kept
    flat = table.assign(reward=0.5)
    kept, stats = select_episodes(ds, flat, WarmStartConfig())  # all-equal groups teach nothing
    assert kept == [] and stats["groups_all_equal"] == 3
    kept, _ = select_episodes(ds, table, WarmStartConfig(keep="threshold", threshold=0.5))
    assert sorted(kept) == sorted(e for e, r in reward.items() if r >= 0.5)
    ds.episodes["feedback"] = [{"thumbs": v} for v in (1, 0, True, -1, False, 2)]
    kept, _ = select_episodes(ds, None, WarmStartConfig(keep="feedback", feedback="thumbs"))
    assert kept == [ds.episode_ids[i] for i in (0, 2, 5)]
    for bad in ({"keep": "best"}, {"keep": "threshold"}, {"keep": "feedback"}, {"epochs": 0}, {"lr": 1}):
        with pytest.raises((ValueError, TypeError)):
            WarmStartConfig.from_dict(bad)


def test_only_the_kept_actions_of_the_trained_agents_are_learned_and_become_likelier(chain_dataset, tiny_model_dir,
                                                                                   tmp_path):
    ds, scenarios = chain_dataset
    cfg = WarmStartConfig(keep="threshold", threshold=0.5, epochs=3, learning_rate=1e-2)
    kept, _ = select_episodes(ds, _table(ds), cfg)
    assert 0 < len(kept) < len(ds)

    def trained(dataset, run):
        policy = LocalPolicy(tiny_model_dir, ["reasoner", "actor"], seed=0)
        trainer = MARFTTrainer(policy, hashed_reward, _cfg(train_agents=["reasoner"]), tmp_path / run,
                               progress=False)
        actor = _weights(policy, trainer.bases[trainer.base_of["reasoner"]].policy.adapter_name("actor"))
        row = warm_start(trainer, dataset, scenarios, cfg)
        return policy, trainer, row, actor

    policy, trainer, row, actor_before = trained(ds, "all")
    assert row["phase"] == "warm_start" and row["kept_episodes"] == len(kept)
    assert row["updated_agents"] == ["reasoner"] and row["warm_start_agents"]["reasoner"]["steps"] == 3
    assert row["warm_start_agents"]["reasoner"]["nll_last"] < row["warm_start_agents"]["reasoner"]["nll_first"]
    actor_name = trainer.bases[trainer.base_of["reasoner"]].policy.adapter_name("actor")
    assert all(torch.equal(x, y) for x, y in zip(actor_before, _weights(policy, actor_name), strict=True))
    # the same kept episodes alone give the very same weights: the other episodes taught nothing
    only, only_trainer, _, _ = trained(ds.select(kept), "kept")
    name = trainer.adapter_names["reasoner"]
    for x, y in zip(_weights(policy, name), _weights(only, only_trainer.adapter_names["reasoner"]), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert trainer.unpublished == {"reasoner"} and trainer.update_steps["reasoner"] == 3


def test_nothing_to_learn_from_is_an_error_naming_why(chain_dataset, two_agent_policy, tmp_path):
    ds, scenarios = chain_dataset
    trainer = MARFTTrainer(two_agent_policy, lambda ep: 1.0, _cfg(), tmp_path / "run", progress=False)
    with pytest.raises(TrainingDataError, match="no episode kept.*groups_all_equal"):
        warm_start(trainer, ds, scenarios)
    with pytest.raises(TrainingDataError, match="no episode kept"):
        warm_start(trainer, ds, scenarios, WarmStartConfig(keep="threshold", threshold=2.0))
    assert np.isclose(trainer.iteration, 0)


def test_a_resumed_run_skips_the_done_warm_start_and_ends_equal_to_an_uninterrupted_one(chain_dataset,
                                                                                       tiny_model_dir, tmp_path):
    ds, scenarios = chain_dataset
    cfg = WarmStartConfig(epochs=2, learning_rate=1e-2)

    def trainer_at(run_dir):
        policy = LocalPolicy(tiny_model_dir, ["reasoner", "actor"], seed=0)
        return MARFTTrainer(policy, hashed_reward, _cfg(offline_episodes_per_iteration=2, plots=True), run_dir,
                            progress=False)

    straight = trainer_at(tmp_path / "a")
    assert straight.fit_warm_start(ds, scenarios, cfg)["phase"] == "warm_start"
    straight.fit_offline(ds, scenarios, iterations=2)

    first = trainer_at(tmp_path / "b")
    first.fit_warm_start(ds, scenarios, cfg)  # then the process dies
    resumed = trainer_at(tmp_path / "b")
    assert resumed.fit_warm_start(ds, scenarios, cfg, resume=True) is None and resumed.warm_started
    resumed.fit_offline(ds, scenarios, iterations=2, resume=True)
    for role in ("reasoner", "actor"):
        for x, y in zip(adapter_parameters(straight.model, straight.adapter_names[role]),
                        adapter_parameters(resumed.model, resumed.adapter_names[role]), strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
    rows = [__import__("json").loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in rows] == ["warm_start", "offline", "offline"]
    assert (tmp_path / "b" / "agents.png").stat().st_size > 1000  # the plots read the warm start's row too
