"""Episodes that did not finish are never scored as finished: a paused one (stopped at an interrupt) is unscored
with its reason; a failed one (status error) follows the composite's `errored` setting, unscored by default."""

from __future__ import annotations

import math

import numpy as np
import pytest
from rewards_factory import make_dataset

from marft_lg._config import ConfigError
from marft_lg.rewards import CompositeReward
from marft_lg.rewards.composite import UNFINISHED

LEAK = "-----BEGIN RSA PRIVATE KEY-----"


def _dataset():
    def ep(eid: str, status: str, answer: str = r"\boxed{42}"):
        return {"episode_id": eid, "status": status, "metadata": {"reference": "42"},
                "actions": [{"agent": "reasoner", "completion": "6*7"}, {"agent": "actor", "completion": answer}]}

    return make_dataset([ep("ok", "ok"), ep("failed", "error"), ep("paused", "paused"),
                         ep("failed_leak", "error", LEAK)])


def _reward(**kwargs) -> CompositeReward:
    return CompositeReward({"task_completion": 1.0, "content_safety": 0.0}, answer_agents=["actor"], **kwargs)


def test_by_default_failed_and_paused_episodes_are_unscored_with_the_reason():
    result = _reward().score(_dataset())
    eps = result.episodes.set_index("episode_id")
    assert eps.loc["ok", "scored"] and eps.loc["ok", "reward"] == 1.0
    for eid, status in (("failed", "error"), ("paused", "paused"), ("failed_leak", "error")):
        assert not eps.loc[eid, "scored"] and math.isnan(eps.loc[eid, "reward"])
        assert eps.loc[eid, "error"].startswith(f"{UNFINISHED}: status '{status}'")
        assert math.isnan(eps.loc[eid, "task_completion"])
    assert "stopped at an interrupt" in eps.loc["paused", "error"]
    assert set(result.action_rewards) == {"ok"}
    summary = result.summary()
    assert (summary["scored"], summary["unscored"], summary["unfinished"]) == (1, 3, 3)
    assert summary["errors"] == {}  # the components did not fail: they were not asked


def test_errored_score_scores_a_failed_episode_as_finished_but_never_a_paused_one():
    eps = _reward(errored="score").score(_dataset()).episodes.set_index("episode_id")
    assert eps.loc["failed", "scored"] and eps.loc["failed", "reward"] == 1.0
    assert not eps.loc["paused", "scored"] and eps.loc["paused", "error"].startswith(UNFINISHED)


def test_errored_zero_trains_on_a_failed_episode_at_reward_zero_and_keeps_vetoes():
    result = _reward(errored="zero").score(_dataset())
    eps = result.episodes.set_index("episode_id")
    assert eps.loc["failed", "scored"] and eps.loc["failed", "reward"] == 0.0
    assert eps.loc["failed", "task_completion"] == 1.0  # the columns still say what the components saw
    np.testing.assert_array_equal(result.action_rewards["failed"], [0.0, 0.0])
    assert eps.loc["failed_leak", "vetoed"] and eps.loc["failed_leak", "reward"] == -1.0
    assert result.action_rewards["failed_leak"].sum() == -1.0
    assert not eps.loc["paused", "scored"]


def test_score_episode_online_follows_the_same_rule():
    ep = next(e for e in _dataset().iter_episodes() if e.episode_id == "paused")
    r = _reward().score_episode(ep)
    assert not r.scored and r.action_rewards is None and r.error.startswith(UNFINISHED)


def test_errored_in_yaml_round_trips_and_a_bad_value_names_the_key(tmp_path):
    reward = _reward(errored="zero")
    again = CompositeReward.from_yaml(reward.to_dict())
    assert again.errored == "zero" and again.to_dict() == reward.to_dict()
    assert CompositeReward.from_yaml({"weights": {"task_completion": 1.0}}).errored == "unscored"
    path = tmp_path / "reward.yaml"
    path.write_text("weights: {task_completion: 1.0}\nerrored: skip\n")
    with pytest.raises(ConfigError, match=r"reward\.yaml:2.*errored must be one of \['unscored', 'score', 'zero'\]"):
        CompositeReward.from_yaml(path)
    with pytest.raises(ValueError, match="errored must be one of"):
        _reward(errored="skip")
