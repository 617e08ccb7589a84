"""Fixtures for trainer tests: a two-agent LocalPolicy on the tiny random model, small datasets."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture
def two_agent_policy(tiny_model_dir):
    from marft_lg.training.policy import LocalPolicy

    return LocalPolicy(tiny_model_dir, ["reasoner", "actor"], seed=0)


def chain_prompt(role, scenario, previous):
    msgs = [{"role": "system", "content": f"You are the {role}."}, {"role": "user", "content": scenario.inputs["q"]}]
    if previous:
        msgs.append({"role": "user", "content": "Reasoner: " + previous[0]["completion"]})
    return msgs


@pytest.fixture
def chain_dataset(two_agent_policy):
    """A real 2-agent rollout dataset (3 scenarios x 2 episodes) recorded with the tiny policy."""
    from marft_lg.training.rollout import ChainCollector
    from marft_lg.trajectories.scenarios import Scenario

    scenarios = [Scenario(f"s{i}", {"q": f"question {i}"}) for i in range(3)]
    collector = ChainCollector(two_agent_policy, ["reasoner", "actor"], chain_prompt, max_new_tokens=4)
    return collector.collect(scenarios, 2, 0, 0), scenarios
