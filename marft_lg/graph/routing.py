"""Per-episode routing state shared by `wrap` and `TeamChatModel`, and the per-call seed derivation.

The wrapper's `EpisodeTracer` (graph/scope.py) makes one `EpisodeRoute` per graph run from the
run's config; `TeamChatModel` reaches it through its own run manager's handlers
(`scope.route_of`), so no route is ever looked up in process-global state.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class EpisodeRoute:
    """Where the LLM calls of one episode go: team, node->role table, version pins, seed, overrides."""

    episode_id: str
    team: Any = None  # a ChatEngine (Team) for TeamChatModel calls without their own engine
    node_roles: dict[str, str] | None = None
    versions: dict[str, str] | str | None = None
    seed: int | None = None
    engine_override: Any = None  # shadow mirroring: a candidate engine that answers every call
    replay: Any = None  # a counterfactual replay's `serving.replay.ReplayState`: its calls go through a ReplayEngine
    replay_engine: Any = None  # the engine a replay's step is sampled from when its reference is "engine"
    _counters: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def next_call_index(self, task_key: str) -> int:
        """0, 1, 2, ... for successive calls made inside one task (a task runs its calls in order)."""
        with self._lock:
            index = self._counters.get(task_key, 0)
            self._counters[task_key] = index + 1
            return index

    def version_for(self, role: str | None) -> str | None:
        return pinned_version(self.versions, role)


def pinned_version(versions: Mapping[str, str] | str | None, role: str | None) -> str | None:
    """``{role: ref}`` -> that role's ref; a plain string (an alias such as "candidate") pins every role."""
    if role is None or versions is None:
        return None
    if isinstance(versions, str):
        return versions
    return versions.get(role)


def derive_seed(episode_seed: int, key: str, call_index: int) -> int:
    """A stable 31-bit seed from a seed, a place and an index: one LLM call's (episode seed, the call's place in
    the graph, its index), or one paired replay's (the comparison's seed, the scenario id, the sample)."""
    digest = hashlib.blake2b(f"{episode_seed}|{key}|{call_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**31 - 1)
