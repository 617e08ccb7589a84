"""A second tokenizer for teams on several bases: `build_tiny_tokenizer` (a small byte-level BPE, not SmolLM2's),
the engine on a model built with it (chat template, eos, pad, token ids and log-probs), and two bases with two
tokenizers each answering with token ids of their own tokenizer."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from marft_lg.serving.engine.hf import HFEngine
from marft_lg.serving.engine.models import build_tiny_model, build_tiny_tokenizer
from marft_lg.serving.team import Team
from marft_lg.serving.team_factory import team as build_team
from marft_lg.serving.types import ChatRequest

MSG = [{"role": "system", "content": "You solve problems."}, {"role": "user", "content": "What is 12 + 30?"}]
SHORT = [{"role": "user", "content": "Add 7 and 5."}]


@pytest.fixture(scope="module")
def tok_b(tiny_model_dir_b):
    return AutoTokenizer.from_pretrained(tiny_model_dir_b)


@pytest.fixture(scope="module")
def tok_a(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_tokenizer_is_deterministic_per_seed_and_written_atomically(tmp_path):
    a = build_tiny_tokenizer(tmp_path / "a")
    b = build_tiny_tokenizer(tmp_path / "b")
    c = build_tiny_tokenizer(tmp_path / "c", seed=1)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    assert (a / "tokenizer.json").read_bytes() != (c / "tokenizer.json").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c"]  # no temporary directory left behind
    stamp = (a / "tokenizer.json").stat().st_mtime_ns
    assert build_tiny_tokenizer(tmp_path / "a") == a and (a / "tokenizer.json").stat().st_mtime_ns == stamp
    small = AutoTokenizer.from_pretrained(build_tiny_tokenizer(tmp_path / "small", vocab_size=600))
    assert len(small) == 600


def test_tokenizer_differs_from_smollm2_and_speaks_chatml(tok_a, tok_b):
    assert len(tok_b) == 2000 and len(tok_a) > 40_000
    ids = {t: tok_b.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")}
    assert ids == {"<|im_start|>": 0, "<|im_end|>": 1, "<|endoftext|>": 2}
    assert ids != {t: tok_a.convert_tokens_to_ids(t) for t in ids}  # SmolLM2: <|endoftext|> 0, <|im_end|> 2
    assert tok_b.eos_token == "<|im_end|>" and tok_b.pad_token_id == tok_b.eos_token_id == 1
    assert tok_b.encode("What is 12 + 30?") != tok_a.encode("What is 12 + 30?")
    text = tok_b.apply_chat_template(MSG, add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nYou solve problems.<|im_end|>\n<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert tok_b.decode(tok_b.encode(text)) == text  # byte-level: every text round-trips
    assert tok_b.decode(tok_b.encode("Ünïcödé → 42 ✓")) == "Ünïcödé → 42 ✓"


def test_engine_on_the_second_tokenizer(tiny_model_dir_b, tok_b):
    torch.set_num_threads(1)
    eng = HFEngine(tiny_model_dir_b)
    try:
        assert eng.eos_token_ids == {1} and eng.pad_token_id == 1
        reqs = [ChatRequest(MSG, max_tokens=8, temperature=0, ignore_eos=True),
                ChatRequest(SHORT, max_tokens=5, seed=3, ignore_eos=True)]
        batched = eng.generate(reqs, [None, None])  # prompts of other lengths: left-padded with the pad id
        alone = [eng.generate([r], [None])[0] for r in reqs]
        for c, a, req in zip(batched, alone, reqs, strict=True):
            assert c.prompt_token_ids == tok_b.apply_chat_template(req.messages, add_generation_prompt=True,
                                                                   tokenize=True, return_dict=False)
            assert len(c.completion_token_ids) == req.max_tokens == len(c.logprobs)
            assert all(0 <= t < len(tok_b) for t in c.completion_token_ids)
            assert all(lp <= 0 for lp in c.logprobs)
            assert c.text == tok_b.decode(c.completion_token_ids, skip_special_tokens=True)
            assert c.completion_token_ids == a.completion_token_ids
            assert torch.allclose(torch.tensor(c.logprobs), torch.tensor(a.logprobs), atol=1e-4)
    finally:
        eng.close()


def test_engine_stops_on_the_second_tokenizers_eos(tmp_path, tiny_model_dir_b):
    """A model rigged to always say `<|im_end|>` (id 1 here; SmolLM2's eos id 2 is `<|endoftext|>` here) stops
    on it at once; with ignore_eos it runs to the length limit."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir_b)
    with torch.no_grad():  # the residual stream is the token's embedding; every row is v, eos's is 2v: eos wins
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        emb.copy_(torch.full_like(emb, 0.1))
        emb[1] *= 2
        model.model.norm.weight.fill_(1.0)
    rigged = tmp_path / "rigged"
    model.save_pretrained(rigged)
    AutoTokenizer.from_pretrained(tiny_model_dir_b).save_pretrained(rigged)
    eng = HFEngine(rigged)
    try:
        stop, run_on = eng.generate([ChatRequest(SHORT, max_tokens=6, temperature=0),
                                     ChatRequest(SHORT, max_tokens=3, temperature=0, ignore_eos=True)], [None, None])
        assert stop.completion_token_ids == [1] and stop.finish_reason == "stop" and stop.text == ""
        assert run_on.completion_token_ids == [1, 1, 1] and run_on.finish_reason == "length"
    finally:
        eng.close()


def test_two_bases_answer_with_their_own_tokenizers(tiny_model_dir, tiny_model_dir_b, tok_a, tok_b, tmp_path):
    """Each base's completion token ids decode, with its own tokenizer, to the completion's text; with the other
    base's tokenizer they would not."""
    torch.set_num_threads(1)
    for model_dir, tok, other in ((tiny_model_dir, tok_a, tok_b), (tiny_model_dir_b, tok_b, tok_a)):
        with Team(model_dir, ["solver", "checker"], versions=None, seed=0) as team:
            outs = team.chat([ChatRequest(MSG, agent="solver", max_tokens=10, seed=1, ignore_eos=True),
                              ChatRequest(SHORT, agent="checker", max_tokens=10, seed=2, ignore_eos=True)])
            assert team.tokenizer_for("solver").vocab_size == tok.vocab_size
        for c, msgs in zip(outs, (MSG, SHORT), strict=True):
            assert c.prompt_token_ids == tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                                 return_dict=False)
            assert len(c.completion_token_ids) == len(c.logprobs) == 10
            assert tok.decode(c.completion_token_ids, skip_special_tokens=True) == c.text
        assert any(other.decode(c.completion_token_ids, skip_special_tokens=True) != c.text for c in outs)
    # one Team over both bases: each role's ids come from its own base's tokenizer
    with build_team({"solver": tiny_model_dir, "checker": tiny_model_dir_b}, versions=None, seed=0) as mixed:
        a, b = mixed.chat([ChatRequest(MSG, agent="solver", max_tokens=6, seed=1, ignore_eos=True),
                           ChatRequest(MSG, agent="checker", max_tokens=6, seed=1, ignore_eos=True)])
        assert a.prompt_token_ids == tok_a.apply_chat_template(MSG, add_generation_prompt=True, tokenize=True,
                                                               return_dict=False)
        assert b.prompt_token_ids == tok_b.apply_chat_template(MSG, add_generation_prompt=True, tokenize=True,
                                                               return_dict=False)
        assert tok_a.decode(a.completion_token_ids, skip_special_tokens=True) == a.text
        assert tok_b.decode(b.completion_token_ids, skip_special_tokens=True) == b.text
        assert mixed.tokenizer_for("checker").vocab_size == tok_b.vocab_size != tok_a.vocab_size


def test_build_tiny_model_accepts_the_tokenizer(tmp_path):
    tok = build_tiny_tokenizer(tmp_path / "tok", vocab_size=800, seed=2)
    model_dir = build_tiny_model(tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2, tokenizer_dir=tok)
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    assert cfg.vocab_size == 800 and cfg.eos_token_id == 1 and cfg.pad_token_id == 1
    assert AutoTokenizer.from_pretrained(model_dir).get_vocab() == AutoTokenizer.from_pretrained(tok).get_vocab()
