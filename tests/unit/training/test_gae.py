import numpy as np
import pytest
import torch

from marft_lg.training.gae import flat_gae, group_relative_advantages, token_gae


def paper_gae(rewards, values, masks, next_value, gamma, lam):
    """MARFT App. A `compute_gae_and_returns`, transcribed: rewards [T, A], values and masks [T+1, A].

    `masks[t, a]` for a >= 1 says agent a acts in step t; `masks[t + 1, 0]` says the episode goes on after step t.
    """
    T, A = rewards.shape
    values = values.copy()
    values[T, 0] = next_value
    adv = np.zeros((T, A))
    gae = 0.0
    for step in reversed(range(T)):
        for agent in reversed(range(A)):
            if agent == A - 1:
                delta = rewards[step, agent] + gamma * values[step + 1, 0] * masks[step + 1, 0] - values[step, agent]
                gae = delta + gamma * lam * masks[step + 1, 0] * gae
            else:
                delta = rewards[step, agent] + gamma * values[step, agent + 1] * masks[step, agent + 1] - values[step, agent]
                gae = delta + gamma * lam * masks[step, agent + 1] * gae
            adv[step, agent] = gae
    return adv, adv + values[:T]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_flat_gae_equals_paper_recurrence(seed):
    rng = np.random.default_rng(seed)
    T, A = 7, 3
    rewards = rng.normal(size=(T, A))
    values = rng.normal(size=(T + 1, A))
    done_steps = rng.random(T) < 0.3  # episodes end (and the env resets) after these steps
    masks = np.ones((T + 1, A))  # every agent acts every step
    masks[1:, 0] = 1.0 - done_steps
    next_value = float(values[T, 0])
    adv_p, ret_p = paper_gae(rewards, values, masks, next_value, 0.99, 0.95)
    dones = np.zeros((T, A))
    dones[:, A - 1] = done_steps
    adv, ret = flat_gae(torch.tensor(rewards.reshape(-1)), torch.tensor(values[:T].reshape(-1)),
                        torch.tensor(dones.reshape(-1)), 0.99, 0.95, last_value=next_value)
    np.testing.assert_allclose(adv.numpy(), adv_p.reshape(-1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret.numpy(), ret_p.reshape(-1), rtol=1e-5, atol=1e-5)


def test_flat_gae_episode_end_bootstraps_from_zero():
    adv, ret = flat_gae(torch.tensor([0.0, 1.0, 0.0]), torch.tensor([0.5, 0.5, 2.0]), torch.tensor([0.0, 1.0, 0.0]),
                        gamma=1.0, lam=1.0, last_value=10.0)
    # action 1 ends its episode: advantage = r - V = 0.5, so action 0 = 0 + V1 - V0 + 0.5 = 0.5
    assert adv[1].item() == pytest.approx(0.5)
    assert adv[0].item() == pytest.approx(0.5)
    assert adv[2].item() == pytest.approx(0.0 + 10.0 - 2.0)
    assert torch.allclose(ret, adv + torch.tensor([0.5, 0.5, 2.0]))


def test_flat_gae_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="same length"):
        flat_gae(torch.zeros(3), torch.zeros(2), torch.zeros(3), 0.99, 0.95)


def test_token_gae_reduces_to_action_gae_for_one_token_actions():
    r, v, d = torch.tensor([0.0, 0.3, 1.0]), torch.tensor([0.1, 0.2, 0.4]), torch.tensor([0.0, 0.0, 1.0])
    a1, _ = flat_gae(r, v, d, 0.9, 0.8)
    a2, _ = token_gae(r, v, d, torch.ones(3), 0.9, 0.8, token_gamma=0.5)
    assert torch.allclose(a1, a2)


def test_token_gae_uses_token_gamma_inside_actions():
    # two tokens in one action, reward on the last; lam=1: first token's advantage = tg * r - v0
    adv, _ = token_gae(torch.tensor([0.0, 1.0]), torch.zeros(2), torch.tensor([0.0, 1.0]), torch.tensor([0.0, 1.0]),
                       gamma=0.1, lam=1.0, token_gamma=0.5)
    assert adv[0].item() == pytest.approx(0.5)


def test_group_relative_advantages():
    adv = group_relative_advantages(torch.tensor([1.0, 0.0, 5.0, 5.0, 3.0]), ["a", "a", "b", "b", "c"])
    assert adv[0] > 0 > adv[1]
    assert adv[2] == adv[3] == 0 and adv[4] == 0
