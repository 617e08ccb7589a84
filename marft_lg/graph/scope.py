"""The per-run scope of a wrapped graph: one episode per graph run, found from the run's own config.

`EpisodeTracer` is a LangChain callback handler that lives as long as the wrapped app. It rides in
the callbacks of every run's config (put there by `WrappedGraph`, or by the graph's own config when
a LangGraph server runs it), so whatever entry point starts the run (``invoke``, ``stream``,
``astream_events``, ``batch``, a ``with_config`` binding, a ``|`` sequence, the LangGraph API
server) the graph's run is the first run this handler sees: it opens the episode there, hands every
callback of the run to that episode's `EpisodeRecorder`, and closes it when the run ends.

The run's options travel as plain data in ``config["metadata"]["marft_lg"]`` (episode id, scenario
id, seed, version pins, mirror pair); a LangGraph server run may give ``episode_id`` /
``scenario_id`` / ``seed`` as plain run metadata instead. `TeamChatModel` finds its episode's
`EpisodeRoute` through its run manager's handlers, so routing never goes through process-global
state and concurrent runs cannot cross.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler, BaseCallbackManager

from marft_lg.graph.interrupts import MISSING, check_episode_span, interrupt_payloads, jsonable, resume_value
from marft_lg.graph.routing import EpisodeRoute, derive_seed
from marft_lg.graph.shadow import ShadowJob, ShadowMirror
from marft_lg.tracing import propagation
from marft_lg.tracing.attributes import MIRROR_OF, agent_from_namespace
from marft_lg.tracing.recorder import EpisodeInfo, EpisodeRecorder

RUN_KEY = "marft_lg"  # config["metadata"][RUN_KEY]: this run's options (plain, serialisable data)
_SENTINEL = object()
logger = logging.getLogger("marft_lg.graph")


@dataclass
class _Episode:
    recorder: EpisodeRecorder
    route: EpisodeRoute
    root_run: int
    inputs: Any
    options: dict[str, Any]
    pair: tuple[str, str] | None
    thread_id: str | None
    is_async: bool
    baggage: dict[str, str]
    interrupts: list[dict[str, Any]] = field(default_factory=list)
    """The interrupts this run stopped at (`interrupt()`): the run ends paused, its thread's next resume continues it."""
    continues: _Thread | None = None


@dataclass
class _Thread:
    """The episode of a thread that a later run on it continues: one paused at an interrupt (continued by the
    resume), or, with ``episodes="conversation"``, the thread's last one."""

    episode_id: str
    scenario_id: str | None
    seed: int | None
    versions: Any
    metadata: dict[str, Any]
    paused: bool
    interrupts: list[dict[str, Any]]
    ended: float
    calls: int = 0
    """LLM calls the episode has made so far (all its runs): an interrupt's ``after_calls``."""


MAX_THREADS = 10_000  # threads remembered for their next run (oldest forgotten first)


def run_options(episode_id: str | None = None, scenario_id: str | None = None, seed: int | None = None,
                versions: Mapping[str, str] | str | None = None, metadata: Mapping[str, Any] | None = None,
                mirror: tuple[str, str] | None = None) -> dict[str, Any]:
    """The plain-data options of one run, as they go into ``config["metadata"]["marft_lg"]``."""
    out: dict[str, Any] = {}
    if episode_id is not None:
        out["episode_id"] = str(episode_id)
    if scenario_id is not None:
        out["scenario_id"] = str(scenario_id)
    if seed is not None:
        out["seed"] = int(seed)
    if versions is not None:
        out["versions"] = versions if isinstance(versions, str) else dict(versions)
    if metadata:
        out["metadata"] = dict(metadata)
    if mirror is not None:
        out["mirror"] = list(mirror)
    return out


def with_handler(config: dict[str, Any], handler: BaseCallbackHandler) -> dict[str, Any]:
    """`config` with `handler` added to its callbacks (once), whatever form they take."""
    callbacks = config.get("callbacks")
    if callbacks is None:
        config["callbacks"] = [handler]
    elif isinstance(callbacks, BaseCallbackManager):
        if handler not in callbacks.handlers:
            manager = callbacks.copy()
            manager.add_handler(handler, inherit=True)
            config["callbacks"] = manager
    elif handler not in callbacks:
        config["callbacks"] = [*callbacks, handler]
    return config


class EpisodeTracer(BaseCallbackHandler):
    """Opens an episode at each graph run it sees first, forwards the run's callbacks to it, closes it."""

    run_inline = True
    raise_error = False

    def __init__(self, *, sink: Any, graph: Any, team: Any = None, node_roles: Mapping[str, str] | None = None,
                 capture_messages: bool = True, redact: Callable[[str], str] | None = None,
                 workflow_name: str = "LangGraph", shadow: Any = None, mirror: ShadowMirror | None = None,
                 redirect: Callable[[Any], None] | None = None, episodes: str = "turn",
                 conversation_idle_s: float | None = None):
        self.episodes = check_episode_span(episodes)
        self.conversation_idle_s = conversation_idle_s
        self._threads: OrderedDict[str, _Thread] = OrderedDict()  # thread id -> the episode its next run continues
        self._threads_lock = threading.Lock()  # episodes of many threads end at once (a runner's concurrent jobs)
        self.redirect = redirect  # where the episodes' HTTP chat calls go instead (a loopback server), if anywhere
        self.sink = sink
        self.graph = graph
        self.team = team
        self.node_roles = dict(node_roles) if node_roles else None
        self.capture_messages = capture_messages
        self.redact = redact
        self.workflow_name = workflow_name
        self.shadow = shadow
        self.mirror = mirror
        self._runs: dict[int, _Episode] = {}  # run id (as int) -> the episode it belongs to
        self._episodes: dict[str, _Episode] = {}  # episode id -> its open episode
        self._configs: dict[str, dict[str, Any]] = {}  # episode id -> the caller's config (for its shadow run)
        self._replays: dict[str, Any] = {}  # episode id -> the `ReplayPlan` its run is about to replay
        self.replay_states: dict[str, Any] = {}  # episode id -> its running replay's `ReplayState`
        self.reference_engine: Any = None  # what a replay's step is sampled from when its reference is "engine"

    # -- lookups ------------------------------------------------------------------------------
    def route_for(self, run_id: UUID | int | None) -> EpisodeRoute | None:
        """The route of the episode that run `run_id` belongs to (None outside any episode)."""
        if run_id is None:
            return None
        episode = self._runs.get(run_id if isinstance(run_id, int) else run_id.int)
        return episode.route if episode is not None else None

    def continuation(self, thread_id: Any, inputs: Any) -> _Thread | None:
        """The episode a run of `inputs` on `thread_id` continues: the thread's paused one when `inputs` resumes it;
        with ``episodes="conversation"`` the thread's last one (within `conversation_idle_s`); else None."""
        with self._threads_lock:
            prior = self._threads.get(str(thread_id)) if thread_id is not None else None
        if prior is None:
            return None
        if prior.paused and resume_value(inputs) is not MISSING:
            return prior
        if self.episodes == "conversation" and (self.conversation_idle_s is None
                                                or time.monotonic() - prior.ended <= self.conversation_idle_s):
            return prior
        return None

    def paused(self, episode_id: str) -> list[dict[str, Any]] | None:
        """The interrupts episode `episode_id` is paused at (``[{"id", "value"}]``), None when it is not paused."""
        with self._threads_lock:
            remembered = list(self._threads.values())
        for t in reversed(remembered):
            if t.episode_id == episode_id:
                return list(t.interrupts) if t.paused else None
        return None

    def expect_replay(self, episode_id: str, plan: Any) -> None:
        """The run about to start as `episode_id` replays `plan` (a `serving.replay.ReplayPlan`)."""
        self._replays[episode_id] = plan

    def replay_engine(self, episode_id: str | None) -> Any:
        """The `ReplayEngine` over the team for a running replay's HTTP calls (None: not a replay)."""
        state = self.replay_states.get(episode_id) if episode_id else None
        if state is None or self.team is None:
            return None
        from marft_lg.serving.replay import ReplayEngine

        return ReplayEngine(self.team, state, self.reference_engine)

    def remember_config(self, episode_id: str, config: Mapping[str, Any]) -> None:
        """Keep the caller's config of a run about to start, for a mirrored re-run of it."""
        self._configs[episode_id] = {k: v for k, v in config.items() if k not in ("callbacks", "run_id")}

    # -- the episode's lifetime ----------------------------------------------------------------
    def _begin(self, run_id: int, inputs: Any, md: Mapping[str, Any]) -> _Episode:
        opts = dict(md.get(RUN_KEY) or {})
        thread_id = md.get("thread_id")
        prior = self.continuation(thread_id, inputs)
        given = opts.get("episode_id") or md.get("episode_id")
        if prior is not None and given is not None and str(given) != prior.episode_id:
            prior = None  # the caller named another episode: a new one
        episode_id = str(given or (prior.episode_id if prior else None) or md.get("run_id") or uuid.uuid4().hex)
        scenario_id = opts.get("scenario_id", md.get("scenario_id"))
        seed = opts.get("seed", md.get("seed"))
        seed = int(seed) if isinstance(seed, int | float | str) and str(seed).lstrip("-").isdigit() else None
        meta = dict(opts.get("metadata") or {})
        if prior is not None:  # a continued episode keeps what its first run was given, and records the resume
            scenario_id = prior.scenario_id if scenario_id is None else scenario_id
            seed = prior.seed if seed is None else seed
            opts.setdefault("versions", prior.versions)
            meta = {**prior.metadata, **meta}
            resume = resume_value(inputs)
            if resume is not MISSING:
                meta["resumes"] = [*prior.metadata.get("resumes", []), jsonable(resume)]
        if seed is not None:
            meta.setdefault("seed", seed)
        mirror = opts.get("mirror")
        pair = (str(mirror[0]), str(mirror[1])) if mirror else None
        if pair is None and self.mirror is not None and self.mirror.sample():
            pair = (uuid.uuid4().hex, "live")
        if pair is not None:
            meta["mirror_pair_id"], meta["mirror_side"] = pair
        plan = self._replays.pop(episode_id, None)
        if plan is not None:
            meta.update(plan.metadata)
        info = EpisodeInfo(
            episode_id=episode_id, scenario_id=str(scenario_id) if scenario_id is not None else None, metadata=meta,
            conversation_id=str(thread_id) if thread_id is not None else None, node_roles=self.node_roles,
            capture_messages=self.capture_messages, redact=self.redact,
            mirror_pair_id=pair[0] if pair else None, mirror_side=pair[1] if pair else None,
            workflow_name=self.workflow_name,
        )
        engine_override = None
        if pair is not None and pair[1] == "shadow" and not isinstance(self.shadow, Mapping | str | None):
            engine_override = self.shadow
        versions = opts.get("versions")
        route = EpisodeRoute(episode_id=episode_id, team=self.team, node_roles=self.node_roles,
                             versions=versions if isinstance(versions, str | None) else dict(versions),
                             seed=seed, engine_override=engine_override)
        if plan is not None:
            from marft_lg.serving.replay import ReplayState

            route.replay, route.replay_engine = ReplayState(plan), self.reference_engine
            self.replay_states[episode_id] = route.replay
        try:
            asyncio.get_running_loop()
            is_async = True
        except RuntimeError:
            is_async = False
        baggage = {propagation.EPISODE_KEY: episode_id}
        if route.versions:
            baggage[propagation.VERSIONS_KEY] = propagation.encode_versions(route.versions)
        episode = _Episode(EpisodeRecorder.start(self.sink, info), route, run_id, inputs, opts, pair,
                           str(thread_id) if thread_id is not None else None, is_async, baggage, continues=prior)
        self._episodes[episode_id] = episode
        return episode

    def _enter_outbound(self, episode: _Episode, run_id: UUID, md: Mapping[str, Any] | None, chat: bool) -> None:
        """Make the span just opened for `run_id` what this context's HTTP calls carry (`tracing.propagation`):
        its trace context, the episode's baggage and a seed per call derived as `TeamChatModel` derives its own."""
        recorder = episode.recorder
        span = recorder.root if run_id.int == episode.root_run else recorder.span_of(run_id.int)
        if span is None:
            return
        route = episode.route
        seed = None if route.seed is None else _call_seeds(route, md or {}, once=chat)
        propagation.enter(propagation.Outbound(span.trace_id, span, propagation.current(), episode.baggage, seed,
                                               self.redirect))

    def _finish(self, episode: _Episode, error: BaseException | None = None, outcome: Any = _SENTINEL) -> None:
        """Close the episode (never raises into the app), then queue its mirrored run if it was sampled."""
        recorder = episode.recorder
        self._episodes.pop(recorder.info.episode_id, None)
        if episode.route.replay is not None:  # whether the replay held its upstream: known only now
            self.replay_states.pop(recorder.info.episode_id, None)
            recorder.add_metadata(episode.route.replay.outcome())
        if isinstance(error, GeneratorExit):  # the caller stopped reading a stream: not a failure
            error = None
        if error is not None and interrupt_payloads(error) is not None:  # the root itself stopped at an interrupt
            self._note_interrupt(episode, error)
            error = None
        self._remember_thread(episode, error)
        try:
            recorder.finish(error=error, outcome=None if outcome is _SENTINEL else outcome,
                            has_outcome=outcome is not _SENTINEL)
        except Exception:  # noqa: BLE001
            logger.exception("marft_lg: closing the trace of episode %s failed; the app's result is unaffected",
                             recorder.info.episode_id)
            recorder.end_root()
        config = self._configs.pop(recorder.info.episode_id, None)
        if episode.pair is not None and episode.pair[1] == "live" and self.mirror is not None:
            self._submit_shadow(episode, config)

    @staticmethod
    def _note_interrupt(episode: _Episode, error: BaseException) -> None:
        """Keep the interrupts a run of `episode` raised (a subgraph's bubbles up through its parents: once each)."""
        seen = {i["id"] for i in episode.interrupts}
        for i in interrupt_payloads(error) or []:
            if i["id"] not in seen:
                seen.add(i["id"])
                episode.interrupts.append({"id": i["id"], "value": jsonable(i["value"])})

    def _remember_thread(self, episode: _Episode, error: BaseException | None) -> None:
        """Mark a run that stopped at an interrupt as paused (its metadata and the thread's next resume), and keep
        the thread's episode for a conversation-long one; a continued episode that ends says it is no longer paused."""
        info, prior = episode.recorder.info, episode.continues
        paused = bool(episode.interrupts) and error is None
        calls = (prior.calls if prior else 0) + episode.recorder.n_chat
        if paused:  # each interrupt says how many LLM calls came before it: what the person saw is the last of them
            interrupts = [*(prior.metadata.get("interrupts", []) if prior else []),
                          *({**i, "after_calls": calls} for i in episode.interrupts)]
            episode.recorder.add_metadata({"paused": True, "interrupts": interrupts})
        elif prior is not None and prior.paused:
            episode.recorder.add_metadata({"paused": False})
        if episode.thread_id is None:
            return
        keep = paused or self.episodes == "conversation"
        entry = _Thread(info.episode_id, info.scenario_id, episode.route.seed, episode.options.get("versions"),
                        dict(info.metadata), paused, list(episode.interrupts) if paused else [], time.monotonic(),
                        calls)
        with self._threads_lock:
            if not keep:
                self._threads.pop(episode.thread_id, None)
                return
            self._threads[episode.thread_id] = entry
            self._threads.move_to_end(episode.thread_id)
            while len(self._threads) > MAX_THREADS:
                self._threads.popitem(last=False)

    def _submit_shadow(self, episode: _Episode, config: dict[str, Any] | None) -> None:
        """Queue the same input on the candidate; never raises into the live path."""
        pair_id = episode.pair[0]
        live_id = episode.recorder.info.episode_id
        try:
            shadow_input = copy.deepcopy(episode.inputs)
        except Exception:  # noqa: BLE001 - uncopyable input: share it (graphs do not mutate their input)
            shadow_input = episode.inputs
        cfg = dict(config or {})
        configurable = dict(cfg.get("configurable") or {})
        thread_id = configurable.get("thread_id", episode.thread_id)
        if thread_id is not None:
            configurable["thread_id"] = f"{thread_id}:shadow:{pair_id}"
            configurable.pop("checkpoint_id", None)
        if configurable:
            cfg["configurable"] = configurable
        opts = episode.options
        versions = opts.get("versions")
        if isinstance(self.shadow, Mapping):
            versions = {**(versions if isinstance(versions, Mapping) else {}), **self.shadow}
        elif isinstance(self.shadow, str):
            versions = self.shadow
        shadow_id = f"{live_id}-shadow"
        shadow_opts = run_options(shadow_id, episode.recorder.info.scenario_id, opts.get("seed"), versions,
                                  {**(opts.get("metadata") or {}), MIRROR_OF: live_id}, (pair_id, "shadow"))
        cfg["metadata"] = {**(cfg.get("metadata") or {}), RUN_KEY: shadow_opts}
        with_handler(cfg, self)
        is_async = episode.is_async

        def run() -> None:
            if is_async:
                asyncio.run(self.graph.ainvoke(shadow_input, cfg))
            else:
                self.graph.invoke(shadow_input, cfg)

        def on_timeout() -> None:
            stuck = self._episodes.get(shadow_id)
            if stuck is not None:
                self._finish(stuck, TimeoutError(f"shadow run exceeded {self.mirror.timeout_s}s"))

        try:
            self.mirror.submit(ShadowJob(pair_id=pair_id, run=run, on_timeout=on_timeout))
        except Exception:  # noqa: BLE001
            self.mirror._count("dropped")

    # -- callbacks: route each to its episode's recorder ---------------------------------------------
    def _child(self, run_id: UUID, parent_run_id: UUID | None) -> _Episode | None:
        episode = self._runs.get(parent_run_id.int) if parent_run_id is not None else None
        if episode is not None:
            self._runs[run_id.int] = episode
        return episode

    def on_chain_start(self, serialized, inputs, *, run_id, parent_run_id=None, tags=None, metadata=None, **kwargs):
        episode = self._child(run_id, parent_run_id)
        if episode is None:  # the first run of this callback tree is the graph's: a new episode
            episode = self._begin(run_id.int, inputs, metadata or {})
            self._runs[run_id.int] = episode
        episode.recorder.on_chain_start(serialized, inputs, run_id=run_id, parent_run_id=parent_run_id, tags=tags,
                                        metadata=metadata, **kwargs)
        if run_id.int == episode.root_run or episode.recorder.span_of(run_id.int) is not None:
            self._enter_outbound(episode, run_id, metadata, chat=False)

    def _end_chain(self, run_id: UUID, error: BaseException | None, outputs: Any, kwargs: dict[str, Any]) -> None:
        episode = self._runs.pop(run_id.int, None)
        if episode is None:
            return
        if error is None:
            episode.recorder.on_chain_end(outputs, run_id=run_id, **kwargs)
        else:
            if run_id.int != episode.root_run and interrupt_payloads(error) is not None:
                self._note_interrupt(episode, error)
            episode.recorder.on_chain_error(error, run_id=run_id, **kwargs)
        if run_id.int == episode.root_run:
            self._finish(episode, error, outputs if error is None else _SENTINEL)

    def on_chain_end(self, outputs, *, run_id, **kwargs):
        self._end_chain(run_id, None, outputs, kwargs)

    def on_chain_error(self, error, *, run_id, **kwargs):
        self._end_chain(run_id, error, None, kwargs)

    def on_chat_model_start(self, serialized, messages, *, run_id, parent_run_id=None, **kwargs):
        episode = self._child(run_id, parent_run_id)
        if episode is not None:
            episode.recorder.on_chat_model_start(serialized, messages, run_id=run_id, parent_run_id=parent_run_id,
                                                 **kwargs)
            self._enter_outbound(episode, run_id, kwargs.get("metadata"), chat=True)

    def on_llm_start(self, serialized, prompts, *, run_id, parent_run_id=None, **kwargs):
        episode = self._child(run_id, parent_run_id)
        if episode is not None:
            episode.recorder.on_llm_start(serialized, prompts, run_id=run_id, parent_run_id=parent_run_id, **kwargs)
            self._enter_outbound(episode, run_id, kwargs.get("metadata"), chat=True)

    def on_llm_end(self, response, *, run_id, **kwargs):
        episode = self._runs.pop(run_id.int, None)
        if episode is not None:
            episode.recorder.on_llm_end(response, run_id=run_id, **kwargs)

    def on_llm_error(self, error, *, run_id, **kwargs):
        episode = self._runs.pop(run_id.int, None)
        if episode is not None:
            episode.recorder.on_llm_error(error, run_id=run_id, **kwargs)

    def on_tool_start(self, serialized, input_str, *, run_id, parent_run_id=None, **kwargs):
        episode = self._child(run_id, parent_run_id)
        if episode is not None:
            episode.recorder.on_tool_start(serialized, input_str, run_id=run_id, parent_run_id=parent_run_id, **kwargs)

    def on_tool_end(self, output, *, run_id, **kwargs):
        episode = self._runs.pop(run_id.int, None)
        if episode is not None:
            episode.recorder.on_tool_end(output, run_id=run_id, **kwargs)

    def on_tool_error(self, error, *, run_id, **kwargs):
        episode = self._runs.pop(run_id.int, None)
        if episode is not None:
            episode.recorder.on_tool_error(error, run_id=run_id, **kwargs)

    def on_retriever_start(self, serialized, query, *, run_id, parent_run_id=None, **kwargs):
        self._child(run_id, parent_run_id)  # no span, but its children stay in the episode

    def on_retriever_end(self, documents, *, run_id, **kwargs):
        self._runs.pop(run_id.int, None)

    def on_retriever_error(self, error, *, run_id, **kwargs):
        self._runs.pop(run_id.int, None)


def _call_seeds(route: EpisodeRoute, md: Mapping[str, Any], *, once: bool) -> Callable[[], int]:
    """The seeds of the HTTP calls made under one span, derived when a call is made (nothing is computed for the
    calls that never leave the process): `once`, one seed for the span's call (a retried request keeps it); else
    one per call of the node's own code (a raw client), in the order they are made."""
    ns = md.get("langgraph_checkpoint_ns") or ""
    node, step, path = md.get("langgraph_node"), md.get("langgraph_step"), md.get("langgraph_path")
    made: list[int] = []

    def seed() -> int:
        if once and made:
            return made[0]
        value = derive_seed(route.seed, f"{agent_from_namespace(ns, node)}|{step}|{path}",
                            route.next_call_index("http|" + ns))
        made.append(value)
        return value

    return seed


def route_of(run_manager: Any) -> EpisodeRoute | None:
    """The `EpisodeRoute` of the run a chat model call belongs to, from the call's own callbacks.

    With a run manager: its handlers and run id. Without one (LangChain's ``stream`` calls
    ``_stream`` bare): the node's child config, whose callback manager names the node's run.
    """
    if run_manager is not None:
        handlers, run_id = run_manager.handlers, run_manager.run_id
        parent = getattr(run_manager, "parent_run_id", None)
    else:
        from langchain_core.runnables.config import var_child_runnable_config

        callbacks = (var_child_runnable_config.get() or {}).get("callbacks")
        if not isinstance(callbacks, BaseCallbackManager):
            return None
        handlers, run_id, parent = callbacks.handlers, None, callbacks.parent_run_id
    for handler in handlers:
        if isinstance(handler, EpisodeTracer):
            route = handler.route_for(run_id) or handler.route_for(parent)
            if route is not None:
                return route
    return None
