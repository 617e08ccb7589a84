"""The prompt prefix a set of token sequences shares (system prompt, few-shot turns), computed once."""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix_length(sequences: Sequence[Sequence[int]]) -> int:
    """Leading tokens shared by every sequence, leaving at least one token of each outside the prefix
    (so every sequence still has its own next-token logits)."""
    if not sequences:
        return 0
    first = sequences[0]
    n = min(len(s) for s in sequences) - 1
    for seq in sequences[1:]:
        k = 0
        while k < n and seq[k] == first[k]:
            k += 1
        n = k
    return max(n, 0)
