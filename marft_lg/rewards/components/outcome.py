"""Outcome components: did the team answer correctly (TaskCompletion), how far did it get (GoalProgress),
and what did a human or an external check say (Feedback)."""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from marft_lg.rewards.answers import MATCH_MODES, answers_match, candidate_answers
from marft_lg.rewards.base import ComponentScore, RewardComponent, action_list, answer_order
from marft_lg.rewards.registry import load_object, register_component
from marft_lg.trajectories.dataset import Episode


@register_component("task_completion")
@dataclass
class TaskCompletion(RewardComponent):
    r"""1.0 when the answer matches the scenario's reference, else 0.0 (or a user check's score in [0, 1]).

    The answer is the completion of the last action by an answer agent (the paper's `with_answer`
    flag; None takes the composite's `answer_agents`, then the last action), or the episode outcome
    when `source="outcome"`. Its ``\boxed{}`` content is compared when present, else the whole text
    and, with `last_number_fallback`, its last number. `check` is ``fn(answer, reference, episode)``
    (or ``"pkg.mod:fn"``) returning a bool or a float in [0, 1]; it replaces the built-in matching.
    """

    name = "task_completion"
    range = (0.0, 1.0)

    match: str = "auto"
    check: str | Callable[..., Any] | None = None
    source: str = "action"
    outcome_key: str | None = None
    answer_agents: list[str] | None = None
    boxed: bool = True
    last_number_fallback: bool = True
    tolerance: float = 1e-6

    def __post_init__(self) -> None:
        if self.match not in MATCH_MODES:
            raise ValueError(f"task_completion: unknown match {self.match!r}; use one of {list(MATCH_MODES)}")
        if self.source not in ("action", "outcome"):
            raise ValueError(f"task_completion: source must be 'action' or 'outcome', got {self.source!r}")
        self._check = load_object(self.check) if isinstance(self.check, str) else self.check

    def needs(self) -> set[str]:
        """A reference answer, unless a `check` judges the answer (`rewards.requirements`)."""
        return set() if self._check is not None else {"reference"}

    def __call__(self, episode: Episode) -> ComponentScore:
        order = answer_order(episode, self.answer_agents)
        if self.source == "outcome":
            answer, attribute_to = outcome_text(episode, self.outcome_key), None
        else:
            answer = "" if order is None else str(_action_by_order(episode, order).get("completion") or "")
            attribute_to = order
        reference = _reference(episode)
        if self._check is not None:
            value = float(self._check(answer, reference, episode))
        else:
            if reference is None:
                sid = episode.info.get("scenario_id")
                raise ValueError(f"task_completion needs a reference answer: episode {episode.episode_id!r} "
                                 f"(scenario {sid!r}) has none; pass scenarios with 'reference' set, put "
                                 "'reference' in the episode metadata, or give task_completion a 'check' function")
            candidates = candidate_answers(answer, boxed=self.boxed, last_number_fallback=self.last_number_fallback)
            value = float(any(answers_match(c, reference, mode=self.match, tolerance=self.tolerance)
                              for c in candidates))
        return ComponentScore(value, {attribute_to: value} if attribute_to is not None else {})


@register_component("goal_progress")
@dataclass
class GoalProgress(RewardComponent):
    """Fraction of the scenario's checkpoints met; partial credit for runs that got part of the way.

    A checkpoint is met when, anywhere in the episode: ``"tool:NAME"`` — tool NAME was called without
    error; ``"agent:NAME"`` — agent NAME acted; ``"re:PATTERN"`` — the regex matches a completion,
    a tool result or a text the app produced in its outcome (`produced_outcome`: never the input it
    echoes back); anything else — that text appears (case-insensitively) there.
    Each checkpoint's share goes to the first action that met it. `check` is
    ``fn(checkpoint, episode) -> bool`` (or an import path) replacing the built-in rules.
    """

    name = "goal_progress"
    range = (0.0, 1.0)

    check: str | Callable[..., Any] | None = None
    empty_value: float = 0.0

    def __post_init__(self) -> None:
        self._check = load_object(self.check) if isinstance(self.check, str) else self.check

    def __call__(self, episode: Episode) -> ComponentScore:
        checkpoints = list((episode.scenario or {}).get("checkpoints") or [])
        if episode.scenario is None:
            raise ValueError(f"goal_progress needs the episode's scenario (checkpoints); episode "
                             f"{episode.episode_id!r} has scenario {episode.info.get('scenario_id')!r} "
                             "which was not given: pass --scenarios / scenarios=")
        if not checkpoints:
            return ComponentScore(float(self.empty_value))
        share = 1.0 / len(checkpoints)
        met, per_action = 0, {}
        produced = None if self._check is not None else list(_leaf_texts(produced_outcome(episode)))
        for cp in checkpoints:
            if produced is None:
                ok, order = bool(self._check(cp, episode)), None
            else:
                ok, order = _checkpoint_met(str(cp), episode, produced)
            if ok:
                met += 1
                if order is not None:
                    per_action[order] = per_action.get(order, 0.0) + share
        return ComponentScore(met * share, per_action)


@register_component("feedback")
@dataclass
class Feedback(RewardComponent):
    """The value recorded with `record_feedback(episode_id, key, value)` (e.g. a user's thumbs-up).

    `low`/`high` declare its range; `default` is used when the episode has none (None: error).
    """

    name = "feedback"

    key: str = "score"
    low: float = 0.0
    high: float = 1.0
    default: float | None = None

    @property
    def range(self) -> tuple[float, float]:  # type: ignore[override]
        return (self.low, self.high)

    def needs(self) -> set[str]:
        """Users' feedback recorded after the run, unless a `default` scores episodes without it."""
        return {"feedback"} if self.default is None else set()

    def __call__(self, episode: Episode) -> float:
        fb = episode.info.get("feedback") or {}
        if self.key in fb and fb[self.key] is not None:
            return float(fb[self.key])
        if self.default is None:
            raise ValueError(f"feedback: episode {episode.episode_id!r} has no feedback {self.key!r} "
                             f"(has {sorted(fb)}); set a 'default' to score episodes without it")
        return float(self.default)


@register_component("interrupt_feedback")
@dataclass
class InterruptFeedback(RewardComponent):
    """What a person answered at an `interrupt()` (the ``Command(resume=...)`` value), credited to the action they
    saw: the last LLM call before the interrupt (the draft), not the last agent to answer.

    A resume value (or its `field`, when it is a dict) found in `values` scores that value (``{approved: 1,
    rejected: 0}``); `call` (``fn(resume, interrupt_value, episode)`` or ``"pkg.mod:fn"``) scores anything else,
    None meaning "no verdict"; with `edit`, a text the person sent back instead (or the dict's `edit_field`) is an
    edit of the draft and scores how much of it was kept (difflib ratio: 1 untouched). The draft is the seen
    action's completion, or the interrupt payload's `draft_key`. An episode answered several times scores the mean.
    An episode with no usable verdict (never resumed, or an answer nothing maps) is an error: unscored, never 0.
    """

    name = "interrupt_feedback"

    values: dict[str, float] | None = None
    field: str | None = None
    call: str | Callable[..., Any] | None = None
    edit: bool = True
    edit_field: str | None = None
    draft_key: str | None = None
    low: float = 0.0
    high: float = 1.0

    def __post_init__(self) -> None:
        if self.values is not None and not isinstance(self.values, dict):
            raise TypeError(f"interrupt_feedback: values must be a mapping of resume value -> reward, got "
                            f"{type(self.values).__name__}")
        if not self.low < self.high:
            raise ValueError(f"interrupt_feedback: low must be < high, got {self.low}, {self.high}")
        self._call = load_object(self.call, what="interrupt_feedback call") if isinstance(self.call, str) else self.call
        if self.values is None and self._call is None and not self.edit:
            raise ValueError("interrupt_feedback: give values, a call or edit: true; nothing maps a resume to a reward")

    @property
    def range(self) -> tuple[float, float]:  # type: ignore[override]
        return (self.low, self.high)

    def needs(self) -> set[str]:
        """A person's (or a stand-in's) answer at the interrupt."""
        return {"resume"}

    def options(self) -> dict[str, Any]:
        out = super().options()
        if callable(self.call):
            out["call"] = f"{self.call.__module__}:{self.call.__qualname__}"
        return out

    def __call__(self, episode: Episode) -> ComponentScore:
        meta = episode.info.get("metadata") or {}
        interrupts = [i for i in meta.get("interrupts") or [] if isinstance(i, dict)]
        resumes = list(meta.get("resumes") or [])
        if not interrupts or not resumes:
            raise ValueError(f"interrupt_feedback: episode {episode.episode_id!r} has "
                             f"{'no interrupt' if not interrupts else 'no resume (still paused)'}: no verdict to score")
        scores: list[tuple[float, int | None]] = []
        for interrupt, resume in _answered(interrupts, resumes):
            seen = _seen_action(episode, interrupt)
            score = self._verdict(resume, interrupt.get("value"), episode, seen)
            if score is not None:
                scores.append((score, seen))
        if not scores:
            raise ValueError(f"interrupt_feedback: no resume of episode {episode.episode_id!r} maps to a reward "
                             f"(resumes {resumes!r}); add it to 'values', or give a 'call'")
        share = 1.0 / len(scores)
        per_action: dict[int, float] = {}
        for score, order in scores:
            if order is not None:
                per_action[order] = per_action.get(order, 0.0) + score * share
        return ComponentScore(sum(v for v, _ in scores) * share, per_action)

    def _verdict(self, resume: Any, payload: Any, episode: Episode, seen: int | None) -> float | None:
        key = resume.get(self.field) if isinstance(resume, dict) and self.field else resume
        if self.values is not None and isinstance(key, str | int | float | bool) and str(key) in self.values:
            return float(self.values[str(key)])
        if self._call is not None:
            out = self._call(resume, payload, episode)
            if out is not None:
                return float(out)
        if self.edit:
            edited = resume.get(self.edit_field) if isinstance(resume, dict) and self.edit_field else resume
            if isinstance(edited, str):
                draft = (payload.get(self.draft_key) if isinstance(payload, dict) and self.draft_key else None)
                if draft is None and seen is not None:
                    draft = next((a.get("completion") for a in episode.actions if a.get("order") == seen), None)
                if isinstance(draft, str):
                    ratio = difflib.SequenceMatcher(None, draft, edited, autojunk=False).ratio()
                    return self.low + (self.high - self.low) * ratio
        return None


def _answered(interrupts: list[dict[str, Any]], resumes: list[Any]) -> list[tuple[dict[str, Any], Any]]:
    """(interrupt, its answer) pairs: a resume keyed by interrupt ids answers those; else the i-th resume answers
    the i-th interrupt still open."""
    by_id = {str(i.get("id")): i for i in interrupts}
    pairs, open_ = [], list(interrupts)
    for resume in resumes:
        if isinstance(resume, dict) and resume and all(str(k) in by_id for k in resume):
            for k, v in resume.items():
                pairs.append((by_id[str(k)], v))
                if by_id[str(k)] in open_:
                    open_.remove(by_id[str(k)])
        elif open_:
            pairs.append((open_.pop(0), resume))
    return pairs


def _seen_action(episode: Episode, interrupt: dict[str, Any]) -> int | None:
    """`order` of the action a person saw at `interrupt`: the last of the calls made before it (``after_calls``,
    recorded by `wrap`), else the last action."""
    orders = sorted(int(a["order"]) for a in episode.actions if a.get("order") is not None)
    if not orders:
        return None
    n = interrupt.get("after_calls")
    if isinstance(n, int) and n > 0:
        before = [o for o in orders if o < n]
        return before[-1] if before else orders[0]
    return orders[-1]


def outcome_text(episode: Episode, key: str | None = None) -> str:
    """The episode's final output as text: `key` of the outcome JSON, else the last message or the JSON of what
    the app produced (`produced_outcome`), so an echoed question never stands in for the answer."""
    data = _parsed_outcome(episode)
    if key is not None:
        for part in key.split("."):
            data = data.get(part) if isinstance(data, dict) else None
        return "" if data is None else (data if isinstance(data, str) else json.dumps(data))
    data = produced_outcome(episode)
    if data is None:
        return ""
    if isinstance(data, str):
        return data
    if isinstance(data, dict) and isinstance(data.get("messages"), list) and data["messages"]:
        last = data["messages"][-1]
        return str(last.get("content", "")) if isinstance(last, dict) else str(last)
    return json.dumps(data, ensure_ascii=False)


def produced_outcome(episode: Episode) -> Any:
    """The episode's outcome less the input it echoes (the scenario's `inputs`): what the app itself produced.

    A graph's final state repeats its input keys, so a check on the whole outcome is met by the question.
    Dropped: a top-level key holding its input value as given, the items of a list under an input key (e.g.
    `messages`) whose text is an input item's, and a whole outcome equal to an input value (then None).
    """
    data = _parsed_outcome(episode)
    inputs = (episode.scenario or {}).get("inputs")
    if data is None or not inputs:
        return data
    inputs = _as_json(inputs if isinstance(inputs, dict) else {"": inputs})
    if not isinstance(data, dict):
        return None if data in inputs.values() else data
    produced = {}
    for key, value in data.items():
        given = inputs.get(key)
        if key in inputs and value == given:
            continue
        if isinstance(value, list) and isinstance(given, list):
            echoed = [_item_text(item) for item in given]
            value = [item for item in value if _item_text(item) not in echoed]
        produced[key] = value
    return produced


def _parsed_outcome(episode: Episode) -> Any:
    raw = episode.info.get("outcome")
    if raw is None or not isinstance(raw, str):
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def _as_json(value: Any) -> Any:
    """`value` as the recorder writes an outcome (messages as chat dicts, tuples as lists), for comparing."""
    from marft_lg.tracing.messages import to_jsonable

    return json.loads(json.dumps(value, ensure_ascii=False, default=to_jsonable))


def _item_text(item: Any) -> Any:
    """A message's text whichever way it is written: a chat dict, a ``(role, text)`` pair or the text."""
    if isinstance(item, dict) and "content" in item:
        return item["content"]
    if isinstance(item, list) and len(item) == 2 and isinstance(item[0], str):
        return item[1]
    return item


def _leaf_texts(value: Any) -> Iterator[str]:
    """Every string (and number) inside an outcome, each checked on its own so JSON escaping never hides a match."""
    if isinstance(value, dict):
        for v in value.values():
            yield from _leaf_texts(v)
    elif isinstance(value, list):
        for v in value:
            yield from _leaf_texts(v)
    elif value is not None:
        yield value if isinstance(value, str) else json.dumps(value)


def _reference(episode: Episode) -> Any:
    if episode.scenario is not None and episode.scenario.get("reference") is not None:
        return episode.scenario["reference"]
    meta = episode.info.get("metadata") or {}
    return meta.get("reference") if isinstance(meta, dict) else None


def _action_by_order(episode: Episode, order: int) -> dict[str, Any]:
    return next(a for a in episode.actions if int(a["order"]) == order)


def _checkpoint_met(cp: str, episode: Episode, produced: list[str]) -> tuple[bool, int | None]:
    kind, _, arg = cp.partition(":")
    if kind == "tool" and arg:
        for a in episode.actions:
            if any(tc.get("name") == arg and not tc.get("error") for tc in action_list(a.get("tool_calls"))):
                return True, int(a["order"])
        return False, None
    if kind == "agent" and arg:
        for a in episode.actions:
            if a.get("agent") == arg:
                return True, int(a["order"])
        return False, None
    if kind == "re" and arg:
        found = re.compile(arg, re.IGNORECASE).search
    else:
        needle = cp.lower()

        def found(text: str) -> bool:
            return needle in text.lower()

    for a in episode.actions:
        texts = [str(a.get("completion") or "")]
        texts += [str(tc.get("result") or "") for tc in action_list(a.get("tool_calls"))]
        if any(found(t) for t in texts):
            return True, int(a["order"])
    if any(found(t) for t in produced):
        return True, None
    return False, None


__all__ = ["Feedback", "GoalProgress", "TaskCompletion", "outcome_text", "produced_outcome"]
