"""A shared prompt prefix computed once gives the same hidden states and the same LoRA gradients."""

import torch

from marft_lg.serving.engine.device import model_device
from marft_lg.training.policy import adapter_parameters, lm_parts, only_adapter_trainable
from marft_lg.training.shared_prefix import body_hidden_states, shared_prefix_length

SYSTEM = {"role": "system", "content": "You are the actor. Think step by step and answer in a box. " * 3}


def _batch(policy, questions, answers):
    tok = policy.tokenizer
    seqs = [tok.apply_chat_template([SYSTEM, {"role": "user", "content": q}], add_generation_prompt=True,
                                    tokenize=True, return_dict=False) + tok.encode(a) for q, a in zip(questions, answers,
                                                                                                       strict=True)]
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tok.pad_token_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = torch.tensor(s)
        attn[b, :len(s)] = 1
    device = model_device(policy.model)
    return ids.to(device), attn.to(device)


def test_prefix_length_is_the_common_unmasked_start(two_agent_policy):
    ids, attn = _batch(two_agent_policy, ["2+2?", "what is seven times three?", "9-4"], ["4", "21", "5"])
    n = shared_prefix_length(ids, attn)
    assert n > 16
    assert (ids[:, :n] == ids[:1, :n]).all() and not (ids[:, n] == ids[0, n]).all()
    assert shared_prefix_length(ids[:1], attn[:1]) == 0  # one row: nothing to share
    assert shared_prefix_length(ids, attn, min_tokens=10**6) == 0
    same, same_attn = ids[:1].repeat(2, 1), attn[:1].repeat(2, 1)  # identical rows keep one token each
    assert shared_prefix_length(same, same_attn) == int(same_attn[0].sum()) - 1


def test_hidden_states_and_gradients_equal_the_plain_forward(two_agent_policy):
    model = two_agent_policy.model
    with torch.no_grad():
        for p in adapter_parameters(model, "actor@v0"):
            p.normal_(0, 0.05)
    ids, attn = _batch(two_agent_policy, ["2+2?", "what is seven times three?", "9-4"], ["4", "21 it is", "5"])
    body, _ = lm_parts(model)
    grads = []
    with only_adapter_trainable(model, "actor@v0"):
        for min_tokens in (16, 10**6):  # shared prefix, then the plain batched forward
            model.zero_grad()
            h = body_hidden_states(body, ids, attn, min_tokens=min_tokens)
            (h * attn[..., None]).pow(2).mean().backward()
            grads.append([p.grad.clone() for p in adapter_parameters(model, "actor@v0")])
            if min_tokens == 16:
                shared_h = h.detach()
            else:
                plain_h = h.detach()
    mask = attn.bool()
    torch.testing.assert_close(shared_h[mask], plain_h[mask], rtol=1e-4, atol=1e-4)
    assert any(g.abs().sum() > 0 for g in grads[0])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-6)
