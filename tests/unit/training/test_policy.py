import torch

from marft_lg.serving.engine.device import model_device
from marft_lg.training.policy import (
    adapter_parameters,
    naive_token_logprobs,
    only_adapter_trainable,
    token_logprobs,
)


def _batch(policy):
    outs = policy.generate("actor", [[{"role": "user", "content": "two plus two"}],
                                     [{"role": "user", "content": "a much longer question about numbers"}]],
                           max_new_tokens=6, seed=3)
    seqs = [o["prompt_token_ids"] + o["completion_token_ids"] for o in outs]
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attn, comp = torch.zeros_like(ids), torch.zeros_like(ids)
    for b, (o, s) in enumerate(zip(outs, seqs, strict=True)):
        ids[b, :len(s)] = torch.tensor(s)
        attn[b, :len(s)] = 1
        comp[b, len(o["prompt_token_ids"]):len(s)] = 1
    device = model_device(policy.model)
    return outs, ids.to(device), attn.to(device), comp.to(device)


def test_chunked_logprobs_match_full_logits_and_engine(two_agent_policy):
    with torch.no_grad():  # give the adapters distinct, non-zero weights
        for p in adapter_parameters(two_agent_policy.model, "actor@v0"):
            p.normal_(0, 0.05)
    outs, ids, attn, comp = _batch(two_agent_policy)
    two_agent_policy.model.set_adapter("actor@v0")
    for chunk in (1, 3, 1000):
        lp, ent = token_logprobs(two_agent_policy.model, ids, attn, comp, chunk_size=chunk)
        ref = naive_token_logprobs(two_agent_policy.model, ids, attn, comp)
        torch.testing.assert_close(lp, ref, rtol=1e-4, atol=1e-4)
        assert (ent[comp.bool()] > 0).all() and (lp[~comp.bool()] == 0).all()
    for b, o in enumerate(outs):  # the generator's recorded behaviour log-probs are the same numbers
        torch.testing.assert_close(lp[b][comp[b].bool()].cpu(), torch.tensor(o["logprobs"]), rtol=1e-4, atol=1e-4)


def test_only_the_updated_adapter_gets_gradients(two_agent_policy):
    _, ids, attn, comp = _batch(two_agent_policy)
    model = two_agent_policy.model
    with only_adapter_trainable(model, "reasoner@v0"):
        lp, _ = token_logprobs(model, ids, attn, comp, chunk_size=4)
        lp.sum().backward()
    trained = dict((n, p) for n, p in model.named_parameters() if ".reasoner@v0." in n)
    assert all(p.grad is not None for p in trained.values())
    # a fresh LoRA has B = 0, so the gradient reaches B (and A only once B moves)
    assert all(p.grad.abs().sum() > 0 for n, p in trained.items() if ".lora_B." in n)
    assert all(p.grad is None for p in adapter_parameters(model, "actor@v0"))
    base = [p for n, p in model.named_parameters() if "lora_" not in n]
    assert all(p.grad is None for p in base)


def test_adapters_are_distinct_policies(two_agent_policy):
    _, ids, attn, comp = _batch(two_agent_policy)
    model = two_agent_policy.model
    with torch.no_grad():
        for p in adapter_parameters(model, "reasoner@v0"):
            p.normal_(0, 0.1)
        model.set_adapter("reasoner@v0")
        a, _ = token_logprobs(model, ids, attn, comp)
        model.set_adapter("actor@v0")
        b, _ = token_logprobs(model, ids, attn, comp)
        with model.disable_adapter():
            base, _ = token_logprobs(model, ids, attn, comp)
    assert not torch.allclose(a, b)
    torch.testing.assert_close(b, base)  # a fresh LoRA (B = 0) is the base model
