"""`AppSpec`: how marft_lg builds the team and the wrapped app it runs episodes through, from any config.

train.yaml, job.yaml, the `compare` flags, a Ray rollout worker and the demo each produce one `AppSpec` and call
`build_team()` (its `TeamSpec` half, which is all `marft-lg serve` needs) and `build_app(team, trace_dir)`; nothing
else builds a team and an app.

What the app may be (the `app` setting, ``module:attr`` / ``file.py:attr``, or the object itself):

- a factory whose first parameter is required, ``f(llm) -> graph``: it is given a `TeamChatModel` on the team
  (with the `chat_model` settings);
- a factory callable with no argument, a compiled graph, or a `WrappedGraph`: the app as its authors wrote it. Its
  agents keep their own chat models and settings; calls a `ChatOpenAI` (or the `openai` client) makes for one of
  the team's roles (``model="<role>"``) reach the team through a loopback server in this process
  (`wrap(..., serve_http=True)`), with each episode's version pins and seeds, whatever URL the app was built with.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from marft_lg._config import ConfigError, unknown_keys
from marft_lg.loading import load_object
from marft_lg.serving.team_factory import TeamSpec


@dataclass
class AppSpec(TeamSpec):
    """Everything that builds a team (`TeamSpec`) and its wrapped app (see the module docstring)."""

    app: Any = None
    """``module:attr`` / ``file.py:attr`` (loaded relative to `base_dir`), or the factory, graph or wrapped app."""
    node_roles: dict[str, str] | None = None
    chat_model: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the `TeamChatModel` an ``f(llm)`` factory is given (``max_tokens``, ``temperature``...)."""
    what: str = "app"
    """The setting's name in error messages (``online.app``, ``--app``)."""
    recursion_limit: int | None = None
    """LangGraph's step limit for each episode (`wrap(..., recursion_limit=)`); None keeps LangGraph's own."""
    resume: Any = None
    """How runs answer the app's `interrupt()` (`wrap(..., resume=)`): ``{"value": ...}``, ``{"call": "module:attr"}``
    (loaded relative to `base_dir`), a callable or a `ResumePolicy`; None: a run that stops there stays paused."""

    # -- the app ------------------------------------------------------------------------------------------------
    def load_app(self) -> Any:
        """The object `app` names (`LoadError` naming the config and line when it cannot be loaded)."""
        if self.app is None:
            raise ConfigError(f"{self._where()}: no app given; name the LangGraph app as module:attr or file.py:attr")
        if not isinstance(self.app, str):
            return self.app
        return load_object(self.app, base_dir=self.base_dir, what=self.what, source=self.source)

    def check_app(self) -> str:
        """Load the app, build its graph once (an ``f(llm)`` factory on a `TeamChatModel` without a team, which
        nothing calls) and check `node_roles` against its nodes, so that a bad setting fails before any work: a
        `ConfigError` naming the config. Returns what the app is (``llm factory``, ``factory``, ``graph``, ``wrapped``)."""
        from marft_lg.graph.wrap import WrappedGraph

        obj = self.load_app()
        kind = app_kind(obj, self._where())
        graph = app_graph(obj, lambda: self.team_chat_model(None), self._where())
        if isinstance(graph, WrappedGraph):
            graph = graph.graph
        check_node_roles(graph, self.node_roles, self._where())
        return kind

    def _where(self) -> str:
        spec = self.app if isinstance(self.app, str) else type(self.app).__name__
        return f"{self.source or 'config'}: {self.what} {spec!r}"

    # -- building -----------------------------------------------------------------------------------------------
    def build_app(self, team: Any, trace_dir: str | Path | None, *, capture_messages: bool = True) -> Any:
        """The app as a `WrappedGraph` on `team`, traced into `trace_dir` (see the module docstring)."""
        from marft_lg.graph.wrap import WrappedGraph, check_recursion_limit, wrap

        graph = app_graph(self.load_app(), lambda: self.team_chat_model(team), self._where())
        node_roles, limit, episodes = dict(self.node_roles or {}), self.recursion_limit, "turn"
        resume = self.resume_policy()
        if isinstance(graph, WrappedGraph):
            node_roles = {**(graph.node_roles or {}), **node_roles}
            limit = graph.recursion_limit if limit is None else limit
            resume = graph.resume if resume is None else resume
            episodes = graph.tracer.episodes
            capture_messages, graph = graph.tracer.capture_messages, graph.graph
        check_node_roles(graph, node_roles, self._where())
        try:
            limit = check_recursion_limit(limit)
        except ValueError as exc:
            raise ConfigError(f"{self.source or 'config'}: {exc}") from None
        return wrap(graph, team=team, trace_dir=trace_dir, node_roles=node_roles or None,
                    capture_messages=capture_messages, serve_http=True, recursion_limit=limit, resume=resume,
                    episodes=episodes)

    def resume_policy(self) -> Any:
        """`resume` as a `ResumePolicy` (its ``call`` loaded now), None when not set; a `ConfigError` naming the
        config when it is malformed or its function cannot be loaded."""
        from marft_lg.graph.interrupts import ResumePolicy

        where = f"{self.source or 'config'}: resume"
        try:
            policy = ResumePolicy.of(self.resume, where)
        except (TypeError, ValueError) as exc:
            raise ConfigError(str(exc)) from None
        try:
            return None if policy is None else policy.loaded(base_dir=self.base_dir, source=self.source)
        except TypeError as exc:
            raise ConfigError(f"{where}: {exc}") from None

    def team_chat_model(self, team: Any) -> Any:
        from marft_lg.graph.chat_model import TeamChatModel

        return TeamChatModel(team=team, **self.chat_model)


def app_kind(obj: Any, where: str = "app") -> str:
    """``wrapped``, ``graph``, ``llm factory`` (first parameter required) or ``factory`` (callable with none)."""
    from marft_lg.graph.wrap import WrappedGraph

    if isinstance(obj, WrappedGraph):
        return "wrapped"
    if hasattr(obj, "invoke"):
        return "graph"
    if callable(obj):
        return "llm factory" if _wants_llm(obj) else "factory"
    raise ConfigError(f"{where} is a {type(obj).__name__}, not a compiled LangGraph graph, a wrapped app or a factory "
                      "of one (f(llm) -> graph, or f() -> graph)")


def app_graph(obj: Any, llm: Any, where: str = "app") -> Any:
    """The compiled graph (or wrapped app) `obj` stands for: a factory is called, given ``llm()`` if it takes one."""
    kind = app_kind(obj, where)
    if kind in ("wrapped", "graph"):
        return obj
    graph = obj(llm()) if kind == "llm factory" else obj()
    if not hasattr(graph, "invoke"):
        raise ConfigError(f"{where} returned a {type(graph).__name__}, not a compiled LangGraph graph")
    return graph


def _wants_llm(factory: Any) -> bool:
    """Whether a factory's first parameter must be given (then it is the chat model)."""
    try:
        params = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):  # no signature to read: the historical contract, f(llm)
        return True
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return bool(params) and params[0].kind in positional and params[0].default is inspect.Parameter.empty


def node_names(graph: Any) -> set[str] | None:
    """Every name a `node_roles` key may use for a node of `graph`: top-level nodes, and each subgraph node as
    ``outer|inner`` and by its bare name. None when the graph cannot list its nodes."""
    try:
        names = {n for n in graph.nodes if not n.startswith("__")}
        for ns, sub in graph.get_subgraphs(recurse=True):
            for node in sub.nodes:
                if not node.startswith("__"):
                    names.update((f"{ns}|{node}", node))
            names.update(part for part in ns.split("|") if part)
    except Exception:  # noqa: BLE001 - not a LangGraph graph: nothing to check against
        return None
    return names


def check_node_roles(graph: Any, node_roles: Mapping[str, str] | None, where: str = "app") -> None:
    """A `node_roles` key that names no node of the app is a typo that would leave an agent untrained: refused."""
    names = node_names(graph) if node_roles else None
    if not names:
        return
    unknown = unknown_keys(node_roles, names)
    if unknown:
        raise ConfigError(f"{where}: node_roles names {unknown}, which {'are' if ', ' in unknown else 'is'} not a "
                          f"node of the app (its nodes: {sorted(names)})")
