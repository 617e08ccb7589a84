"""`normalize_advantages`: an action whose advantage is 0 (its group's returns all equal) stays 0 whatever the rest of
the batch holds, and `advantage_std_floor` keeps returns that differ by a few hundredths from being scaled up to
full-size advantages; per action and per token, jointly and per agent. `advantage_group_std: false` leaves each group's
differences from its mean in the reward's units (Dr. GRPO) instead of dividing them by the group's std."""

from __future__ import annotations

import pytest
import torch

from marft_lg._config import ConfigError
from marft_lg.training.batch import normalize_advantages
from marft_lg.training.buffer import ActionRecord
from marft_lg.training.config import MARFTConfig
from marft_lg.training.gae import group_relative_advantages


def _record(agent: str, n_tokens: int = 1, *, episode_id: str = "e", reward: float = 0.0) -> ActionRecord:
    return ActionRecord(episode_id=episode_id, scenario_id="s", order=0, agent=agent, adapter_version=None,
                        prompt_ids=[1], completion_ids=[2] * n_tokens, behaviour_logprobs=[-1.0] * n_tokens,
                        reward=reward, done=True, words=1)


def _normalized(values: list[float], agents: list[str], **cfg) -> list[float]:
    records = [_record(a) for a in agents]
    adv = [torch.tensor([v]) for v in values]
    zero = frozenset(i for i, a in enumerate(adv) if not bool(a.any()))
    normalize_advantages(adv, records, list(range(len(adv))), zero, sorted(set(agents)), MARFTConfig(**cfg))
    return [float(a[0]) for a in adv]


def test_a_zero_advantage_stays_zero_while_the_others_are_normalized():
    # the informative group's advantages do not average to 0 over the batch's actions (+0.5 / -0.1): before, the
    # equal group's two actions were moved to -mean/std and pushed as if their returns had been below average
    out = _normalized([0.0, 0.0, 0.5, -0.1], ["a"] * 4)
    assert out[0] == 0.0 and out[1] == 0.0
    assert out[2] == pytest.approx(1.0, abs=1e-6) and out[3] == pytest.approx(-1.0, abs=1e-6)
    old = torch.tensor([0.0, 0.0, 0.5, -0.1])
    assert ((old - old.mean()) / old.std(unbiased=False))[0] != 0.0  # what the statistics over all four gave


def test_the_floor_keeps_small_differences_small_and_leaves_large_ones_as_they_were():
    tiny = [0.01, -0.01, 0.02, -0.02]
    assert _normalized(tiny, ["a"] * 4)[0] == pytest.approx(0.01 / 0.0158114, rel=1e-4)  # scaled up ~63x
    assert _normalized(tiny, ["a"] * 4, advantage_std_floor=0.1) == pytest.approx([0.1, -0.1, 0.2, -0.2], abs=1e-6)
    large = [0.5, -0.5, 0.25, -0.25]
    assert _normalized(large, ["a"] * 4, advantage_std_floor=0.1) == pytest.approx(_normalized(large, ["a"] * 4))


def test_per_agent_normalization_keeps_zeros_and_floors_each_agent_on_its_own():
    out = _normalized([0.0, 0.3, -0.3, 0.01, -0.01, 0.0], ["a", "a", "a", "b", "b", "b"],
                      credit_normalize="per_agent", advantage_std_floor=0.05)
    assert out[0] == 0.0 and out[5] == 0.0
    assert out[1] == pytest.approx(1.0, abs=1e-6) and out[3] == pytest.approx(0.2, abs=1e-6)


def test_token_advantages_keep_zero_records_and_the_floor():
    records = [_record("a", 3), _record("a", 2), _record("a", 2)]
    adv = [torch.zeros(3), torch.tensor([0.02, 0.02]), torch.tensor([-0.02, -0.04])]
    normalize_advantages(adv, records, [0, 1, 2], frozenset({0}), ["a"],
                         MARFTConfig(granularity="token", advantage_std_floor=0.5))
    assert torch.equal(adv[0], torch.zeros(3))
    flat = torch.tensor([0.02, 0.02, -0.02, -0.04])
    assert torch.allclose(torch.cat(adv[1:]), (flat - flat.mean()) / 0.5, atol=1e-6)


def test_off_leaves_advantages_alone_and_the_floor_is_checked():
    assert _normalized([0.0, 0.5, -0.1], ["a"] * 3, normalize_advantages=False) == pytest.approx([0.0, 0.5, -0.1])
    with pytest.raises(ConfigError, match="advantage_std_floor"):
        MARFTConfig(advantage_std_floor=-0.1)


def test_without_the_group_std_a_step_cost_difference_stays_a_step_cost_difference():
    # group "cost": four episodes that only differ by a step cost (0.02); group "solved": one solved, one not
    returns = torch.tensor([0.24, 0.22, 0.24, 0.22, 1.0, 0.0])
    groups = ["cost"] * 4 + ["solved"] * 2
    grpo = group_relative_advantages(returns, groups)
    assert float(grpo[0]) == pytest.approx(float(grpo[4]), rel=1e-3)  # the std puts both groups on one scale
    drgrpo = group_relative_advantages(returns, groups, scale=False)
    assert drgrpo.tolist() == pytest.approx([0.01, -0.01, 0.01, -0.01, 0.5, -0.5], abs=1e-6)
    # through the batch: the floor then keeps the cost group's pushes a fiftieth of the solved group's
    out = _normalized(drgrpo.tolist(), ["a"] * 6, advantage_std_floor=0.1)
    assert out[0] / out[4] == pytest.approx(0.02, rel=1e-4)
    with pytest.raises(ConfigError, match="advantage_group_std"):
        MARFTConfig(advantage_group_std="no")


def test_the_trainer_reads_the_setting_for_group_and_reward_to_go_credit():
    from marft_lg.training.batch import compute_advantages

    records = [_record("a", episode_id=f"e{k}", reward=r) for k, r in enumerate([0.24, 0.22])]
    values = [torch.zeros(1), torch.zeros(1)]
    for credit in ("group", "reward_to_go"):
        scaled, _ = compute_advantages(records, values, MARFTConfig(use_critic=False, credit=credit))
        plain, _ = compute_advantages(records, values, MARFTConfig(use_critic=False, credit=credit,
                                                                   advantage_group_std=False))
        assert float(scaled[0][0]) == pytest.approx(1.0, rel=1e-3)
        assert float(plain[0][0]) == pytest.approx(0.01, abs=1e-6)
