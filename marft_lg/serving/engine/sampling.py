"""Choosing each row's next token from its logits, and finding stop strings: pure functions, no model.

Every row samples with its own generator, so a seeded request gets the same tokens whatever else
shares its batch; log-probs are those of the unprocessed model distribution, as the trainer needs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def choose(logits: Any, temps: Any, top_ps: Any, generators: Sequence[Any]) -> Any:
    """One token per row: greedy where temperature is 0, else top-p sampling by inverse CDF.

    Each row draws one uniform number from its own generator, so a seeded request samples the
    same tokens whatever else shares its batch.
    """
    import torch

    greedy = temps <= 0
    chosen = logits.argmax(dim=-1)
    if bool(greedy.all()):
        return chosen
    u = torch.cat([torch.rand(1, generator=g) for g in generators]).to(logits.device)  # CPU draws: same tokens on any device
    probs = torch.softmax(logits / temps.clamp(min=1e-5)[:, None], dim=-1)
    cdf = probs.cumsum(dim=-1)
    sampled = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None])[:, 0].clamp(max=cdf.shape[-1] - 1)
    nucleus = top_ps < 1
    if bool(nucleus.any()):  # rows with top_p < 1 only: a row's token never depends on its batch-mates' settings
        sorted_p, order = probs.sort(dim=-1, descending=True)
        cum = sorted_p.cumsum(dim=-1)
        sorted_p = sorted_p.masked_fill((cum - sorted_p) >= top_ps[:, None], 0.0)
        cdf = sorted_p.cumsum(dim=-1)
        pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).clamp(max=cdf.shape[-1] - 1)
        sampled = torch.where(nucleus, order.gather(1, pick)[:, 0], sampled)
    return torch.where(greedy, chosen, sampled)


def sample(logits: Any, temps: Any, top_ps: Any, generators: Sequence[Any]) -> tuple[Any, Any, list[float]]:
    """`choose` on float32 logits, with log-probs under the unprocessed distribution (temperature 1, no top-p):
    (chosen tokens, every token's log-prob per row, the chosen tokens' log-probs)."""
    import torch

    logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    chosen = choose(logits, temps, top_ps, generators)
    chosen_lp = logp.gather(1, chosen[:, None])[:, 0].tolist()  # one device->host copy per step
    return chosen, logp, chosen_lp


def top_logprobs(row_logp: Any, k: int) -> dict[int, float]:
    """The `k` most likely tokens of one row's log-probs: {token id: log-prob}; tokens a grammar ruled out
    (log-prob -inf) are left out."""
    values, ids = row_logp.topk(k)
    return {i: v for i, v in zip(ids.tolist(), values.tolist(), strict=True) if v != float("-inf")}


def stop_index(tokens: Sequence[int], stops: Sequence[str], decode: Callable[[Sequence[int]], str]) -> int | None:
    """Where in the decoded text of `tokens` the earliest stop string begins, or None when none occurs."""
    text = decode(tokens)
    hits = [i for s in stops if (i := text.find(s)) >= 0]
    return min(hits) if hits else None
