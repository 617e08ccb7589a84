"""The trainer's checks of the data it trains on, and what a failed check is.

Two checks run while an iteration's batch is built (`batch.build_batch`): a constrained action's recorded tokens
must be ones its grammar, rebuilt from the record, accepts (`grammar_rejected`), and an on-policy record of the
adapter weights being trained must get back the log-probs it recorded (`logprob_mismatch`). Either failure is a
named `DataProblem`; the action is left out of the update and counted (`on_data_mismatch: drop`), or training stops
(`error`). An iteration left with nothing to train is a `TrainingDataError`, never a silent no-op.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

GRAMMAR_REJECTED = "grammar_rejected"
LOGPROB_MISMATCH = "logprob_mismatch"
SHOWN = 3
"""Problems named one by one in a warning or an error; the rest are counted."""


class TrainingDataError(RuntimeError):
    """An iteration had no action to train (no scored episode, none of the trained agents', all failed the data
    checks), or its data failed a check under ``on_data_mismatch: error``; the message says which."""


@dataclass(frozen=True)
class DataProblem:
    """One action whose record failed a data check: which action, which check, and what differed."""

    kind: str
    episode_id: str
    order: int
    agent: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: episode {self.episode_id} action {self.order} ({self.agent}): {self.detail}"


def grammar_rejection(record: Any, label: str | None, index: int, tokenizer: Any = None) -> DataProblem:
    """The problem of a constrained record whose grammar rejected its completion token at `index`."""
    token = int(record.completion_ids[index])
    text = tokenizer.decode([token]) if tokenizer is not None else None
    shown = f"{token} ({text!r})" if text is not None else str(token)
    return DataProblem(GRAMMAR_REJECTED, record.episode_id, record.order, record.agent,
                       f"the grammar of {label} rebuilt from the record rejects completion token {index} = {shown}; "
                       "the record's constraint or tokens are not what the engine decoded under (a re-sorted schema, "
                       "another tokenizer, tokens re-tokenised from text)")


def logprob_mismatch(record: Any, recorded: torch.Tensor, recomputed: torch.Tensor,
                     tolerance: float) -> DataProblem | None:
    """The problem of an on-policy record whose recomputed log-probs differ from the recorded ones by more than
    `tolerance` at some token (None when they agree): the largest difference, the first token past the tolerance,
    and the likely cause."""
    diff = (recorded.float() - recomputed.float()).abs()
    bad = (diff > tolerance).nonzero()
    if not len(bad):
        return None
    first = int(bad[0, 0])
    cause = ("the prompt ids are not what the model saw (another chat template, a prompt rendered again) or the "
             "completion's tokens are shifted" if first == 0 else
             f"completion token {first} is not the one sampled there (a shifted or replaced token, a re-sorted "
             "schema's mask), or the weights are not the recorded version's")
    return DataProblem(LOGPROB_MISMATCH, record.episode_id, record.order, record.agent,
                       f"recomputed log-probs differ from the recorded ones by up to {float(diff.max()):.4g} "
                       f"(tolerance {tolerance:g}), first at token {first} of {len(diff)}; likely {cause}")


def problem_counts(problems: Sequence[DataProblem]) -> dict[str, int]:
    """``{kind: actions}`` of a batch's problems."""
    return dict(Counter(p.kind for p in problems))


def named(problems: Sequence[DataProblem], shown: int = SHOWN) -> str:
    """The first `shown` problems, one per line, and how many more there were."""
    lines = [f"  {p}" for p in problems[:shown]]
    if len(problems) > shown:
        lines.append(f"  ... and {len(problems) - shown} more")
    return "\n".join(lines)
