"""Token choice and stop strings on plain tensors, without any model: greedy, seeds, top-p, stops."""

from __future__ import annotations

import pytest
import torch

from marft_lg.serving.engine.sampling import choose, sample, stop_index, top_logprobs


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _logits(rows: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=_gen(seed)) * 3


def test_greedy_rows_pick_the_argmax():
    logits = _logits()
    chosen = choose(logits, torch.zeros(4), torch.ones(4), [_gen(i) for i in range(4)])
    assert chosen.tolist() == logits.argmax(-1).tolist()


def test_greedy_rows_ignore_top_p_and_draw_nothing():
    logits = _logits()
    gens = [_gen(i) for i in range(4)]
    states = [g.get_state() for g in gens]
    chosen = choose(logits, torch.zeros(4), torch.full((4,), 0.3), gens)
    assert chosen.tolist() == logits.argmax(-1).tolist()
    assert all(torch.equal(g.get_state(), s) for g, s in zip(gens, states, strict=True))


@pytest.mark.parametrize("top_ps", [[1.0, 1.0, 1.0, 1.0, 1.0], [1.0, 0.5, 0.9, 1.0, 0.95]])
def test_a_seeded_row_gets_the_same_token_alone_and_inside_a_batch(top_ps):
    logits = _logits(rows=5, seed=1)
    row = 2
    temps = torch.tensor([0.0, 1.3, 0.8, 0.5, 2.0])
    for seed in range(20):
        alone = choose(logits[row:row + 1], temps[row:row + 1], torch.tensor(top_ps[row:row + 1]), [_gen(seed)])
        gens = [_gen(1000 + i) for i in range(5)]
        gens[row] = _gen(seed)
        batch = choose(logits, temps, torch.tensor(top_ps), gens)
        assert batch[row].item() == alone[0].item()


def test_a_top_p_1_row_keeps_its_token_beside_a_top_p_row():
    """(Before: one row with top_p < 1 sent the whole batch down the sorted inverse CDF, which mapped a top_p = 1
    row's draw to another token in 88 of 200 seeds.)"""
    logits = _logits(rows=2, seed=1)
    temps = torch.tensor([0.8, 0.8])
    for seed in range(50):
        alone = choose(logits[:1], temps[:1], torch.tensor([1.0]), [_gen(seed)])
        batch = choose(logits, temps, torch.tensor([1.0, 0.5]), [_gen(seed), _gen(9)])
        assert batch[0].item() == alone[0].item()


def test_the_same_seed_repeats_and_different_seeds_vary():
    logits = torch.zeros(1, 50)  # uniform: every token equally likely
    draws = [choose(logits, torch.ones(1), torch.ones(1), [_gen(s)]).item() for s in range(40)]
    assert draws == [choose(logits, torch.ones(1), torch.ones(1), [_gen(s)]).item() for s in range(40)]
    assert len(set(draws)) > 10


def test_top_p_never_chooses_a_token_outside_the_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]])
    logits = probs.log()
    g = _gen(7)
    seen = {choose(logits, torch.ones(1), torch.tensor([0.75]), [g]).item() for _ in range(2000)}
    assert seen == {0, 1}  # 0.5 + 0.3 covers 0.75; the rest is cut
    seen = {choose(logits, torch.ones(1), torch.tensor([0.5]), [g]).item() for _ in range(500)}
    assert seen == {0}  # the first token alone covers the nucleus


def test_without_top_p_every_token_can_be_chosen():
    logits = torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]]).log()
    g = _gen(3)
    seen = {choose(logits, torch.ones(1), torch.ones(1), [g]).item() for _ in range(2000)}
    assert seen == {0, 1, 2, 3, 4}


def test_greedy_and_sampled_rows_mix_in_one_batch():
    logits = torch.zeros(4, 30)
    logits[:, 5] = 1.0  # a mild favourite: sampled rows still wander, greedy rows never do
    temps = torch.tensor([0.0, 1.0, 0.0, 1.0])
    gens = [_gen(i) for i in range(4)]
    picks = [choose(logits, temps, torch.ones(4), gens).tolist() for _ in range(200)]
    assert all(p[0] == 5 and p[2] == 5 for p in picks)
    assert len({p[1] for p in picks}) > 5 and len({p[3] for p in picks}) > 5


def test_sample_reports_log_probs_of_the_unprocessed_distribution():
    logits = _logits(rows=3, seed=4).to(torch.bfloat16)
    temps, top_ps = torch.tensor([0.0, 0.5, 1.0]), torch.tensor([1.0, 0.9, 1.0])
    chosen, logp, chosen_lp = sample(logits, temps, top_ps, [_gen(i) for i in range(3)])
    expected = torch.log_softmax(logits.float(), dim=-1)
    assert torch.equal(logp, expected)
    assert chosen_lp == expected.gather(1, chosen[:, None])[:, 0].tolist()
    tops = top_logprobs(logp[1], 3)
    assert list(tops) == expected[1].topk(3).indices.tolist()
    assert list(tops.values()) == pytest.approx(expected[1].topk(3).values.tolist())


def test_stop_index_finds_the_earliest_stop_string():
    text = "alpha beta gamma beta"

    def decode(tokens):
        return text[: len(tokens)]

    tokens = list(range(len(text)))
    assert stop_index(tokens, ["gamma", "beta"], decode) == text.find("beta")
    assert stop_index(tokens, ["gamma"], decode) == text.find("gamma")
    assert stop_index(tokens, ["delta"], decode) is None
    assert stop_index(tokens[:8], ["gamma", "beta"], decode) is None  # "alpha be": not yet
    assert stop_index(tokens[:10], ["gamma", "beta"], decode) == 6
