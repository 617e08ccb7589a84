"""User reward components imported by path in the tests (as `my_pkg.rewards:MyScore` would be)."""

from __future__ import annotations

from dataclasses import dataclass

from marft_lg.rewards import ComponentScore, RewardComponent


@dataclass
class LengthScore(RewardComponent):
    """1.0 for each action whose completion is at most `max_chars` long, averaged; attributed per action."""

    range = (0.0, 1.0)
    max_chars: int = 10

    def __call__(self, episode):
        n = len(episode.actions)
        ok = {a["order"]: 1.0 / n for a in episode.actions if len(a["completion"]) <= self.max_chars}
        return ComponentScore(sum(ok.values()), ok)


def mentions_paris(episode) -> float:
    """A plain-function component."""
    return float("paris" in episode.final_completion.lower())


def nan_score(episode) -> float:
    return float("nan")


def always_raises(episode) -> float:
    raise RuntimeError("judge backend unreachable")


def check_contains(answer, reference, episode) -> bool:
    """A TaskCompletion check function."""
    return str(reference) in answer


class KeywordScore:
    """A callable class that is not a RewardComponent, with an option."""

    range = (0.0, 1.0)

    def __init__(self, word: str = "yes"):
        self.word = word

    def __call__(self, episode) -> float:
        return float(self.word in episode.final_completion)
