"""Hidden states of a batch whose rows share a prompt prefix, with that prefix computed once.

An agent's actions all start with the same tokens (its system prompt, few-shot turns): on CPU that
prefix is most of every training sequence. It is run once at batch size 1, its KV cache repeated
over the batch, and only the per-row rest runs batched. The repeat is an autograd op, so gradients
reaching the prefix from every row are summed into its one computation: the result and the
gradients equal the plain batched forward up to float rounding.
"""

from __future__ import annotations

import torch


def shared_prefix_length(input_ids: torch.Tensor, attention_mask: torch.Tensor, *, min_tokens: int = 16) -> int:
    """Leading positions identical and unmasked in every row (right-padded batch), or 0 when under `min_tokens`.

    At least one token of each row stays outside the prefix, so every row has its own rest.
    """
    if input_ids.shape[0] < 2:
        return 0
    same = (input_ids == input_ids[:1]).all(dim=0) & attention_mask.bool().all(dim=0)
    n = int(same.long().cumprod(dim=0).sum())
    n = min(n, int(attention_mask.sum(dim=1).min()) - 1)
    return n if n >= min_tokens else 0


def body_hidden_states(body: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                       min_tokens: int = 16) -> torch.Tensor:
    """Last-layer hidden states `[B, T, H]` of a right-padded batch; a shared prefix is computed once."""
    from transformers import DynamicCache

    n = shared_prefix_length(input_ids, attention_mask, min_tokens=min_tokens)
    if not n:
        return body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    batch = input_ids.shape[0]
    cache = DynamicCache(config=body.config)
    head = body(input_ids=input_ids[:1, :n], past_key_values=cache, use_cache=True).last_hidden_state
    cache.batch_repeat_interleave(batch)
    rest = body(input_ids=input_ids[:, n:], attention_mask=attention_mask, past_key_values=cache,
                use_cache=True).last_hidden_state
    return torch.cat([head.expand(batch, -1, -1), rest], dim=1)
