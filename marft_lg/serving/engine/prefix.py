"""Prompt prefixes shared across requests (system prompt, few-shot turns): found once, their keys and values kept."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any


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


class PrefixStore:
    """Keys and values of recent prompt prefixes per adapter weights (least recently used dropped first).

    A later request on the same weights that begins the same way skips prefilling that prefix again.
    """

    def __init__(self, max_entries: int = 16):
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[Any, tuple[int, ...]], list[tuple[Any, Any]]] = OrderedDict()

    def find(self, key: Any, prompt: list[int], limit: int) -> tuple[int, list[tuple[Any, Any]]]:
        """The longest stored prefix (under `key`) the prompt starts with, cut to `limit` tokens: (length, layers)."""
        best, layers, hit = 0, [], None
        for entry in self._entries:
            if entry[0] != key:
                continue
            tokens, n = entry[1], 0
            end = min(len(tokens), len(prompt))
            while n < end and tokens[n] == prompt[n]:
                n += 1
            if min(n, limit) > best:
                best, layers, hit = min(n, limit), self._entries[entry], entry
        if hit is not None:
            self._entries.move_to_end(hit)
        return best, layers

    def add(self, key: Any, tokens: list[int], layers: list[tuple[Any, Any]]) -> None:
        """Keep the per-layer (keys, values) of prefix `tokens` under `key`, dropping the oldest beyond `max_entries`."""
        self._entries[(key, tuple(tokens))] = layers
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        """Forget every stored prefix (the adapters or their weights changed)."""
        self._entries.clear()
