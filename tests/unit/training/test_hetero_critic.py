"""One critic on a chosen base values every action of a two-base team: a record of the other base is read as its
observation re-tokenised in the critic base's tokens (`critic_prompt_ids`), never its own tokens; and GAE runs
over the episode's joint action order across the bases, each action bootstrapping from the next one's value
whatever its base (checked against a hand computation)."""

from __future__ import annotations

import pytest
import torch

from marft_lg.serving.team_factory import team as build_team
from marft_lg.training.batch import BaseModel, Critic, compute_advantages, critic_values
from marft_lg.training.buffer import ActionRecord
from marft_lg.training.config import MARFTConfig
from marft_lg.training.critic import ValueHead

OBS = [{"role": "user", "content": "What is 2 + 3? Answer with the number."}]
LATER = [{"role": "user", "content": "Check: is 5 the sum of 2 and 3?"}]


@pytest.fixture(scope="module")
def two_bases(tiny_model_dir, tiny_model_dir_b):
    team = build_team({"solver": tiny_model_dir, "checker": tiny_model_dir_b}, versions=None, seed=0)
    yield team
    team.close()


def _ids(tok, messages):
    enc = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return [int(x) for x in (enc["input_ids"] if isinstance(enc, dict) else enc)]


def _record(order, agent, base, prompt, completion, reward, done, critic_ids=None):
    return ActionRecord("ep", "s", order, agent, None, prompt, completion, None, reward, done, 1, base=base,
                        critic_prompt_ids=critic_ids)


def test_the_other_bases_actions_are_valued_on_their_observation_in_the_critic_bases_tokens(two_bases):
    team = two_bases
    a, b = team.base_of("solver"), team.base_of("checker")
    tok_a, tok_b = team.tokenizer_for("solver"), team.tokenizer_for("checker")
    assert tok_a.get_vocab() != tok_b.get_vocab()
    bases = {n: BaseModel(team.bases[n].model, team.bases[n].tokenizer.pad_token_id or 0) for n in (a, b)}
    torch.manual_seed(0)
    head = ValueHead(team.bases[b].model.config.hidden_size)
    critic = Critic({b: head}, on=b)
    cfg = MARFTConfig(critic_base=b)
    solver = _record(0, "solver", a, _ids(tok_a, OBS), tok_a("5", add_special_tokens=False)["input_ids"], 0.0, False,
                     critic_ids=_ids(tok_b, OBS))
    twin = _record(1, "checker", b, _ids(tok_b, OBS), [], 0.0, False)  # the same observation, on the critic's base
    other = _record(2, "checker", b, _ids(tok_b, LATER), tok_b("yes", add_special_tokens=False)["input_ids"], 1.0,
                    True)
    _, values = critic_values([solver, twin, other], bases, critic, cfg)
    assert torch.allclose(values[0], values[1])  # read as the critic base's tokens of its observation
    assert not torch.allclose(values[0], values[2])
    garbled = _record(0, "solver", a, [7] * 5, solver.completion_ids, 0.0, False, critic_ids=_ids(tok_b, OBS))
    _, again = critic_values([garbled], bases, critic, cfg)
    assert torch.allclose(again[0], values[0])  # its own base's tokens play no part


def test_gae_bootstraps_across_bases_over_the_joint_order():
    cfg = MARFTConfig(gamma=0.9, gae_lambda=0.8, use_critic=True)
    rewards, values = [0.2, -0.5, 1.0], [0.3, 0.1, 0.6]
    records = [_record(0, "solver", "base-a", [1], [5, 6], rewards[0], False),
               _record(1, "checker", "base-b", [1], [7], rewards[1], False),
               _record(2, "solver", "base-a", [1], [8, 9, 10], rewards[2], True)]
    adv, ret = compute_advantages(records, [torch.tensor([v]) for v in values], cfg)
    g, lam = 0.9, 0.8
    a2 = rewards[2] - values[2]  # the episode's last action: bootstraps from 0
    a1 = rewards[1] + g * values[2] - values[1] + g * lam * a2  # base b's action from base a's next value
    a0 = rewards[0] + g * values[1] - values[0] + g * lam * a1  # base a's action from base b's value
    for k, want in enumerate((a0, a1, a2)):
        assert torch.allclose(adv[k], torch.full((records[k].n_tokens,), want))
        assert ret[k].item() == pytest.approx(want + values[k])
