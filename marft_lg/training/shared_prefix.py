"""Hidden states of a batch whose rows share a prompt prefix, with that prefix computed once.

An agent's actions all start with the same tokens (its system prompt, few-shot turns): on CPU that
prefix is most of every training sequence. It is run once at batch size 1, its KV cache repeated
over the batch, and only the per-row rest runs batched. The repeat is an autograd op, so gradients
reaching the prefix from every row are summed into its one computation: the result and the
gradients equal the plain batched forward up to float rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

MIN_SHARED = 16
"""A common prefix shorter than this is not worth its separate forward."""


def usable_prefix(common: int, shortest: int, rows: int, *, min_tokens: int = MIN_SHARED) -> int:
    """The prefix computed once for `rows` rows whose first `common` tokens are the same, the shortest `shortest`
    long: 0 for one row or under `min_tokens`; at least one token of each row stays its own."""
    if rows < 2:
        return 0
    n = min(common, shortest - 1)
    return n if n >= min_tokens else 0


def shared_prefix_length(input_ids: torch.Tensor, attention_mask: torch.Tensor, *, min_tokens: int = MIN_SHARED) -> int:
    """Leading positions identical and unmasked in every row of a right-padded batch, as `usable_prefix` counts them."""
    same = (input_ids == input_ids[:1]).all(dim=0) & attention_mask.bool().all(dim=0)
    common = int(same.long().cumprod(dim=0).sum())
    return usable_prefix(common, int(attention_mask.sum(dim=1).min()), input_ids.shape[0], min_tokens=min_tokens)


def common_length(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """How many leading tokens `a` and `b` share, counting at most `limit`."""
    n = 0
    for x, y in zip(a[:limit], b[:limit], strict=False):
        if x != y:
            break
        n += 1
    return n


def row_positions(common: int, shortest: int, longest: int, rows: int) -> int:
    """Positions `body_hidden_states` runs for `rows` right-padded rows (`shortest` .. `longest` tokens, the first
    `common` the same in all) beyond the prefix it computes once: each row's rest, padded to the longest."""
    return rows * (longest - usable_prefix(common, shortest, rows))


def body_hidden_states(body: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                       min_tokens: int = MIN_SHARED) -> torch.Tensor:
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
