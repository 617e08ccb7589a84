"""A reward that can never be computed on the episodes at hand is refused before any work: `task_completion` on
users' inputs (no reference), users' `feedback` on new episodes, `interrupt_feedback` where nothing answers the
interrupt; in on-policy training (Python and train.yaml) and in a comparison."""

from __future__ import annotations

import pytest

from marft_lg.rewards.composite import CompositeReward
from marft_lg.rewards.requirements import reward_needs, uncomputable
from marft_lg.trajectories.scenarios import Scenario

NOREF = [Scenario("a", {"q": "1+1?"}), Scenario("b", {"q": "2+2?"})]
REF = [Scenario("a", {"q": "1+1?"}, reference="2")]


def _reward(weights, components=None):
    return CompositeReward.from_yaml({"weights": weights, "components": components or {}})


def test_what_each_component_needs_and_when_it_cannot_be_had():
    task = _reward({"task_completion": 1.0, "step_count": -0.1})
    assert reward_needs(task) == {"task_completion": {"reference"}}
    assert uncomputable(task, scenarios=REF, fresh=True) == []
    [why] = uncomputable(task, scenarios=NOREF, fresh=True)
    assert "task_completion needs a reference answer and none of the 2 scenarios has one" in why
    checked = _reward({"task_completion": 1.0}, {"task_completion": {"check": "builtins:bool"}})
    assert uncomputable(checked, scenarios=NOREF, fresh=True) == []  # a check judges the answer alone
    off = _reward({"task_completion": 0.0, "step_count": -0.1})
    assert uncomputable(off, scenarios=NOREF, fresh=True) == []  # weight 0: not needed

    thumbs = _reward({"feedback": 1.0}, {"feedback": {"key": "thumbs"}})
    assert uncomputable(thumbs, scenarios=NOREF, fresh=False) == []  # mined production episodes may have it
    assert "users record after a run" in uncomputable(thumbs, scenarios=NOREF, fresh=True)[0]
    defaulted = _reward({"feedback": 1.0}, {"feedback": {"key": "thumbs", "default": 0.5}})
    assert uncomputable(defaulted, fresh=True) == []

    verdict = _reward({"interrupt_feedback": 1.0}, {"interrupt_feedback": {"values": {"approved": 1}}})
    assert uncomputable(verdict, fresh=True, resumes=True) == []
    assert uncomputable(verdict, fresh=True, resumes=None) == []  # not known (Ray workers): the runner says later
    assert "nothing answers it" in uncomputable(verdict, fresh=True, resumes=False)[0]


def test_on_policy_training_and_a_comparison_refuse_before_any_rollout(tmp_path, tiny_model_dir):
    from marft_lg.evaluation.shadow import shadow_compare
    from marft_lg.training.config import MARFTConfig
    from marft_lg.training.policy import LocalPolicy
    from marft_lg.training.trainer import MARFTTrainer

    class App:  # any rollout would fail the test
        resume = None

        def collect(self, *a, **k):
            raise AssertionError("no rollout may run")

        run = invoke = collect

    trainer = MARFTTrainer(LocalPolicy(tiny_model_dir, ["reasoner", "actor"], seed=0), _reward({"task_completion": 1.0}), MARFTConfig(plots=False),
                           tmp_path / "run", progress=False)
    with pytest.raises(ValueError, match="never be computed on on-policy episodes: task_completion needs a refer"):
        trainer.fit_online(App(), NOREF, iterations=1)
    with pytest.raises(ValueError, match="never be computed on the comparison's new episodes"):
        shadow_compare(App(), "live", "live", NOREF, _reward({"task_completion": 1.0}), drift=False, progress=False)
