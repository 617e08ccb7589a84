"""A relative judge's scores reach the trainer: `group_judge` over each scenario's episodes gives them different
returns, so their group-relative advantages are not zero and the adapters take a step; a judge that fails leaves
its groups unscored and training goes on with the others (tiny model)."""

from __future__ import annotations

import json
import re

from marft_lg.rewards.components.group_judge import GroupJudge
from marft_lg.rewards.composite import CompositeReward
from marft_lg.serving.types import Completion
from marft_lg.training.config import MARFTConfig
from marft_lg.training.trainer import MARFTTrainer


class RankingJudge:
    """Scores the attempts it is shown 0, 1/(n-1), ..., 1 in the order shown; fails on the scenario named `broken`."""

    def __init__(self, broken: str | None = None):
        self.broken, self.calls = broken, 0

    def chat(self, requests):
        self.calls += 1
        prompt = requests[0].messages[-1]["content"]
        if self.broken and self.broken in prompt:
            raise RuntimeError("judge down")
        n = len(re.findall(r"### Attempt \d+", prompt))
        scores = [{"attempt": i + 1, "score": i / max(1, n - 1), "blame": ""} for i in range(n)]
        return [Completion(text=json.dumps({"scores": scores}), prompt_token_ids=[], completion_token_ids=[],
                           logprobs=[])]


def _cfg():
    return MARFTConfig(learning_rate=1e-3, plots=False, kl_cut=None, entropy_surge=1e9, kl_blowup=1e9,
                       use_critic=False, group_size=2, offline_episodes_per_iteration=64,
                       update_scheme="simultaneous")


def test_judge_scores_become_advantages_and_a_failed_group_is_left_out(chain_dataset, two_agent_policy, tmp_path):
    ds, scenarios = chain_dataset
    judge = RankingJudge(broken="question 1")
    reward = CompositeReward({"group_judge": 1.0}, {"group_judge": GroupJudge(engine=judge, retries=0)})
    trainer = MARFTTrainer(two_agent_policy, reward, _cfg(), tmp_path / "run", progress=False)
    [row] = trainer.fit_offline(ds, scenarios, iterations=1)
    assert judge.calls == 3  # one call per scenario group
    assert row["episodes"] == 6 and row["skipped"] == {"unscored_episode": 4}  # the broken group: left out, not 0
    assert row["groups"] == 3 and row["single_groups"] == 1
    assert row["zero_advantage_share"] == 0.0 and row["trained_actions"] == 8
    assert set(row["updated_agents"]) == {"reasoner", "actor"}
