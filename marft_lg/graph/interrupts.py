"""Human-in-the-loop runs: a LangGraph run that stops at `interrupt()` is paused, not finished, and the run that
resumes its thread (``Command(resume=...)``) continues the same episode.

`ResumePolicy` is how the project's own runners (`marft-lg run`, on-policy training, compare, attribute, Ray
rollout workers) answer an interrupt when no person is there: a fixed value, or a callable ``payload -> value``
(for a simulated approver). `EpisodeSpan` is the setting for runs on one thread that are not resumes: each is an
episode of its own (``"turn"``, the default), or every run of a thread continues one episode
(``"conversation"``), optionally cut after an idle window.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

EPISODE_SPANS = ("turn", "conversation")
MISSING = object()


def resume_value(inputs: Any) -> Any:
    """The resume value when `inputs` resumes a paused thread (a LangGraph ``Command(resume=...)``), else
    `MISSING`."""
    resume = getattr(inputs, "resume", MISSING)
    if resume is MISSING or resume is None or not hasattr(inputs, "goto"):
        return MISSING
    return resume


def interrupt_payloads(error: BaseException) -> list[dict[str, Any]] | None:
    """``[{"id", "value"}]`` of the interrupts a LangGraph `GraphInterrupt` carries; None for any other error."""
    try:
        from langgraph.errors import GraphInterrupt
    except ImportError:  # pragma: no cover - graph code runs with LangGraph installed
        return None
    if not isinstance(error, GraphInterrupt):
        return None
    found = error.args[0] if error.args else ()
    if not isinstance(found, Sequence) or isinstance(found, str | bytes):
        found = [found]
    return [{"id": str(getattr(i, "id", "")), "value": getattr(i, "value", i)} for i in found]


@dataclass(frozen=True)
class ResumePolicy:
    """How a runner answers an app's `interrupt()`: ``value`` (given as is), or ``call(payload) -> value`` (a callable
    or a ``module:attr`` reference, loaded once). ``max_resumes`` bounds the resumes of one episode; a run still
    paused after them is counted as paused."""

    value: Any = None
    call: Callable[[Any], Any] | str | None = None
    max_resumes: int = 8

    def __post_init__(self) -> None:
        if isinstance(self.max_resumes, bool) or not isinstance(self.max_resumes, int) or self.max_resumes < 1:
            raise ValueError(f"resume: max_resumes must be a whole number >= 1, got {self.max_resumes!r}")
        if self.call is not None and not callable(self.call) and not isinstance(self.call, str):
            raise TypeError(f"resume: call must be a callable or a 'module:attr' string, got {type(self.call).__name__}")
        if self.call is None and self.value is None:
            raise ValueError("resume: give a value (what every interrupt is answered with) or call (payload -> value)")

    @classmethod
    def of(cls, spec: Any, where: str = "resume") -> ResumePolicy | None:
        """A policy from a config value: None; a `ResumePolicy`; a callable; or a mapping with ``value`` or ``call``
        (``module:attr``) and optionally ``max_resumes``. Errors name `where`."""
        if spec is None or isinstance(spec, ResumePolicy):
            return spec
        if callable(spec):
            return cls(call=spec)
        if not isinstance(spec, Mapping) or not ({"value", "call"} & set(spec)) or set(spec) - {
                "value", "call", "max_resumes"}:
            raise ValueError(f"{where} must be a mapping with 'value' (the answer to every interrupt) or 'call' "
                             f"('module:attr' of a function payload -> answer), and optionally 'max_resumes'; "
                             f"got {spec!r}")
        try:
            return cls(value=spec.get("value"), call=spec.get("call"), max_resumes=spec.get("max_resumes", 8))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: {exc}") from exc

    def loaded(self, *, base_dir: Any = None, source: Any = None, what: str = "resume.call") -> ResumePolicy:
        """This policy with a ``module:attr`` `call` loaded (relative to `base_dir`; errors name `what`, `source`)."""
        if not isinstance(self.call, str):
            return self
        from marft_lg.loading import load_object

        fn = load_object(self.call, base_dir=base_dir, what=what, source=source)
        if not callable(fn):
            raise TypeError(f"{what}: {self.call!r} is a {type(fn).__name__}, not a function")
        return ResumePolicy(call=fn, max_resumes=self.max_resumes)

    def _function(self) -> Callable[[Any], Any] | None:
        if isinstance(self.call, str):
            object.__setattr__(self, "call", self.loaded().call)
        return self.call  # type: ignore[return-value]

    def answer(self, payload: Any) -> Any:
        """The resume value for one interrupt's payload."""
        fn = self._function()
        return fn(payload) if fn is not None else self.value

    def command(self, interrupts: Sequence[Mapping[str, Any]]) -> Any:
        """The ``Command(resume=...)`` answering `interrupts` (one value, or ``{interrupt id: value}`` for several)."""
        from langgraph.types import Command

        if len(interrupts) == 1:
            return Command(resume=self.answer(interrupts[0]["value"]))
        return Command(resume={i["id"]: self.answer(i["value"]) for i in interrupts})


def policy_from_flags(value: str | None, call: str | None, max_resumes: int = 8) -> ResumePolicy | None:
    """The policy of the commands' ``--resume-value`` (JSON, else the text as is) and ``--resume-with``
    (``module:attr``) flags; None when neither is given."""
    if value is None and call is None:
        return None
    if value is not None and call is not None:
        raise ValueError("--resume-value and --resume-with are two ways of answering an interrupt: give one")
    if call is not None:
        return ResumePolicy(call=call, max_resumes=max_resumes)
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = value
    return ResumePolicy(value=parsed, max_resumes=max_resumes)


def check_episode_span(value: Any, where: str = "episodes") -> str:
    """`value` as an `EPISODE_SPANS` name (`ValueError` naming `where`)."""
    if value not in EPISODE_SPANS:
        raise ValueError(f"{where} must be one of {list(EPISODE_SPANS)}, got {value!r}")
    return str(value)


def jsonable(value: Any) -> Any:
    """`value` as plain JSON data for an episode's metadata (anything else as its text)."""
    try:
        return json.loads(json.dumps(value, default=str))
    except (TypeError, ValueError):
        return str(value)
