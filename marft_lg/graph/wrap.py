"""`wrap(graph, team=...)`: the user's compiled LangGraph app, routed to a Team and traced per episode.

The wrapped app is a LangChain `Runnable`, as the compiled graph is: every entry point (``invoke``,
``ainvoke``, ``stream`` / ``astream`` in any stream mode, ``batch`` / ``abatch``,
``astream_events``, ``astream_log``) and everything derived from it (``with_config``,
``with_retry``, ``with_listeners``, ``|``) runs the graph with the wrapper's `EpisodeTracer` in the
run's callbacks, and each graph run is one episode. Entry points take per-run keywords
(`episode_id`, `scenario_id`, `seed`, `versions`, `metadata`), which travel in the run's config
metadata. Nothing about the run itself changes: the tracer only observes, routing only applies to
`TeamChatModel` calls. State, history and drawing (``get_state``, ``update_state``, ``get_graph``...)
are the graph's own.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from langchain_core.runnables import Runnable, RunnableConfig
from opentelemetry.sdk.trace.export import SpanExporter

from marft_lg.graph.agents import prebuilt_agent_roles
from marft_lg.graph.capture import EpisodeCapture
from marft_lg.graph.interrupts import ResumePolicy
from marft_lg.graph.scope import RUN_KEY, EpisodeTracer, run_options, with_handler
from marft_lg.graph.shadow import ShadowMirror
from marft_lg.tracing import propagation
from marft_lg.tracing.sink import RecordSink, make_record_sink

Versions = Mapping[str, str] | str | None


class WrappedGraph(Runnable):
    """A compiled graph plus routing and tracing; see `wrap`."""

    def __init__(self, graph: Any, *, team: Any = None, sink: RecordSink, trace_dir: str | os.PathLike | None = None,
                 node_roles: Mapping[str, str] | None = None,
                 capture_messages: bool = True, redact: Callable[[str], str] | None = None,
                 shadow: Any = None, mirror: ShadowMirror | None = None, workflow_name: str | None = None,
                 serve_http: bool = False, recursion_limit: int | None = None, resume: Any = None,
                 episodes: str = "turn", conversation_idle_s: float | None = None):
        self.graph = graph
        self.recursion_limit = check_recursion_limit(recursion_limit)
        self.resume = ResumePolicy.of(resume)
        self.team = team
        self.sink = sink
        self.server = None
        if serve_http and team is not None:
            from marft_lg.serving.http.local_server import LocalServer

            self.server = LocalServer(team, sink, capture_messages=capture_messages,
                                      engine_for=lambda ctx: self.tracer.replay_engine(ctx.episode_id))
        self.trace_dir = Path(trace_dir) if trace_dir is not None else None
        self._node_roles = {**prebuilt_agent_roles(graph), **dict(node_roles or {})} or None
        self.shadow = shadow
        self.mirror = mirror
        self.workflow_name = workflow_name or getattr(graph, "name", None) or "LangGraph"
        self.tracer = EpisodeTracer(sink=sink, graph=graph, team=team, node_roles=self._node_roles,
                                    capture_messages=capture_messages, redact=redact,
                                    workflow_name=self.workflow_name, shadow=shadow, mirror=mirror,
                                    redirect=self.server.redirect if self.server is not None else None,
                                    episodes=episodes, conversation_idle_s=conversation_idle_s)
        self.last_episode_id: str | None = None
        propagation.install()

    @property
    def node_roles(self) -> dict[str, str] | None:
        """``{node path: role}``: the prebuilt agents' nodes, then the caller's mapping."""
        return self._node_roles

    @node_roles.setter
    def node_roles(self, value: Mapping[str, str] | None) -> None:
        self._node_roles = self.tracer.node_roles = dict(value) if value else None

    def __repr__(self) -> str:
        return f"WrappedGraph({self.workflow_name!r}, trace_dir={str(self.trace_dir)!r})"

    def __call__(self) -> Any:
        """The traced compiled graph (a LangGraph ``Pregel``), as a zero-argument graph factory.

        This is what lets a ``langgraph.json`` name the wrapped app: the LangGraph API server calls
        it and runs the graph it returns, whose own config carries the tracer.
        """
        return self.graph.with_config({"callbacks": [self.tracer]})

    # -- the graph's own surface ---------------------------------------------------------------
    @property
    def name(self) -> str | None:  # type: ignore[override]
        return getattr(self.graph, "name", None)

    @property
    def InputType(self) -> Any:  # noqa: N802 - Runnable's name
        return self.graph.InputType

    @property
    def OutputType(self) -> Any:  # noqa: N802 - Runnable's name
        return self.graph.OutputType

    def get_input_schema(self, config: RunnableConfig | None = None) -> Any:
        return self.graph.get_input_schema(config)

    def get_output_schema(self, config: RunnableConfig | None = None) -> Any:
        return self.graph.get_output_schema(config)

    @property
    def config_specs(self) -> Any:
        return self.graph.config_specs

    def get_graph(self, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        return self.graph.get_graph(config, **kwargs)

    @property
    def checkpointer(self) -> Any:
        return getattr(self.graph, "checkpointer", None)

    def get_state(self, config: RunnableConfig, **kwargs: Any) -> Any:
        return self.graph.get_state(config, **kwargs)

    async def aget_state(self, config: RunnableConfig, **kwargs: Any) -> Any:
        return await self.graph.aget_state(config, **kwargs)

    def get_state_history(self, config: RunnableConfig, **kwargs: Any) -> Iterator[Any]:
        return self.graph.get_state_history(config, **kwargs)

    def aget_state_history(self, config: RunnableConfig, **kwargs: Any) -> AsyncIterator[Any]:
        return self.graph.aget_state_history(config, **kwargs)

    def update_state(self, config: RunnableConfig, values: Any, as_node: str | None = None, **kwargs: Any) -> Any:
        return self.graph.update_state(config, values, as_node, **kwargs)

    async def aupdate_state(self, config: RunnableConfig, values: Any, as_node: str | None = None,
                            **kwargs: Any) -> Any:
        return await self.graph.aupdate_state(config, values, as_node, **kwargs)

    def get_subgraphs(self, **kwargs: Any) -> Iterator[tuple[str, Any]]:
        return self.graph.get_subgraphs(**kwargs)

    # -- tracing ---------------------------------------------------------------------------------
    @property
    def trace_files(self) -> list:
        """Files the JSONL exporter has written so far."""
        return [f for e in self.sink.exporters for f in getattr(e.inner, "files", [])]

    @property
    def export_failures(self) -> int:
        """How many span export batches failed (the app is never interrupted by them)."""
        return self.sink.export_failures

    @property
    def shadow_stats(self) -> dict[str, int]:
        """Mirroring counters: sampled, submitted, completed, failed, timed_out, dropped."""
        return dict(self.mirror.stats) if self.mirror else {}

    @contextmanager
    def capture(self) -> Iterator[EpisodeCapture]:
        """``with app.capture() as captured: app.invoke(...)``; then ``captured.dataset()`` holds the episodes run
        inside the block (shadow runs included), built from the app's own records instead of its trace files."""
        with self.sink.tap() as spans:
            yield EpisodeCapture(spans)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Export every finished span now (the exporter also flushes on its own and at exit)."""
        return self.sink.flush(int(timeout_s * 1000))

    def wait_for_shadows(self, timeout_s: float | None = None) -> bool:
        """Block until queued mirrored runs finished or timed out (for tests and graceful shutdown)."""
        return self.mirror.wait_idle(timeout_s) if self.mirror else True

    def close(self) -> None:
        """Stop the shadow workers and flush and shut down the private tracer provider."""
        if self.mirror:
            self.mirror.close()
        if self.server is not None:
            self.server.close()
        self.sink.shutdown()

    # -- the per-run config: the one place a run gets its episode options and the tracer --------------
    def _config(self, config: RunnableConfig | None, episode_id: str | None = None, scenario_id: str | None = None,
                seed: int | None = None, versions: Versions = None,
                metadata: Mapping[str, Any] | None = None, input: Any = None) -> dict[str, Any]:
        cfg: dict[str, Any] = dict(config or {})
        if self.recursion_limit is not None:
            cfg.setdefault("recursion_limit", self.recursion_limit)
        md = dict(cfg.get("metadata") or {})
        opts = {**dict(md.get(RUN_KEY) or {}), **run_options(episode_id, scenario_id, seed, versions, metadata)}
        configurable = dict(cfg.get("configurable") or {})
        if "episode_id" not in opts and md.get("episode_id") is None:  # a resume continues its thread's episode
            prior = self.tracer.continuation(configurable.get("thread_id"), input)
            if prior is not None:
                opts["episode_id"] = prior.episode_id
        opts.setdefault("episode_id", str(md.get("episode_id") or uuid.uuid4().hex))
        md[RUN_KEY] = opts
        cfg["metadata"] = md
        if configurable.get("thread_id") is None and _has_checkpointer(self.graph):
            configurable["thread_id"] = opts["episode_id"]  # a checkpointed graph needs one: the episode's own
            cfg["configurable"] = configurable
        if self.mirror is not None:
            limit = {"recursion_limit": cfg["recursion_limit"]} if "recursion_limit" in cfg else {}
            self.tracer.remember_config(opts["episode_id"], {**dict(config or {}), **limit})
        self.last_episode_id = opts["episode_id"]
        return with_handler(cfg, self.tracer)

    # -- entry points -------------------------------------------------------------------------------
    def replay(self, plan: Any, input: Any, *, episode_id: str, scenario_id: str | None = None,
               seed: int | None = None, versions: Versions = None, metadata: Mapping[str, Any] | None = None) -> Any:
        """Run `input` as a counterfactual replay of `plan` (`serving.replay.ReplayPlan`): the calls before its step
        answered from the record, the step sampled from its reference, the rest as usual. The episode is traced like
        any other, with the plan (and at its end whether the upstream held) in its metadata."""
        self.tracer.expect_replay(episode_id, plan)
        try:
            return self.invoke(input, episode_id=episode_id, scenario_id=scenario_id, seed=seed, versions=versions,
                               metadata=metadata)
        finally:
            self.tracer._replays.pop(episode_id, None)

    @property
    def replay_reference(self) -> Any:
        """The engine replays sample their step from when their plan's reference is ``"engine"``."""
        return self.tracer.reference_engine

    @replay_reference.setter
    def replay_reference(self, engine: Any) -> None:
        self.tracer.reference_engine = engine

    def invoke(self, input: Any, config: RunnableConfig | None = None, *, episode_id: str | None = None,
               scenario_id: str | None = None, seed: int | None = None, versions: Versions = None,
               metadata: Mapping[str, Any] | None = None, **kwargs: Any) -> Any:
        """Run one episode (same result as ``graph.invoke``)."""
        cfg = self._config(config, episode_id, scenario_id, seed, versions, metadata, input)
        return self.graph.invoke(input, cfg, **kwargs)

    async def ainvoke(self, input: Any, config: RunnableConfig | None = None, *, episode_id: str | None = None,
                      scenario_id: str | None = None, seed: int | None = None, versions: Versions = None,
                      metadata: Mapping[str, Any] | None = None, **kwargs: Any) -> Any:
        """Async twin of `invoke`."""
        cfg = self._config(config, episode_id, scenario_id, seed, versions, metadata, input)
        return await self.graph.ainvoke(input, cfg, **kwargs)

    def stream(self, input: Any, config: RunnableConfig | None = None, *, episode_id: str | None = None,
               scenario_id: str | None = None, seed: int | None = None, versions: Versions = None,
               metadata: Mapping[str, Any] | None = None, **kwargs: Any) -> Iterator[Any]:
        """Stream one episode (same chunks as ``graph.stream``, any `stream_mode`); it ends with the stream."""
        cfg = self._config(config, episode_id, scenario_id, seed, versions, metadata, input)
        yield from self.graph.stream(input, cfg, **kwargs)

    async def astream(self, input: Any, config: RunnableConfig | None = None, *, episode_id: str | None = None,
                      scenario_id: str | None = None, seed: int | None = None, versions: Versions = None,
                      metadata: Mapping[str, Any] | None = None, **kwargs: Any) -> AsyncIterator[Any]:
        """Async twin of `stream`."""
        cfg = self._config(config, episode_id, scenario_id, seed, versions, metadata, input)
        async for chunk in self.graph.astream(input, cfg, **kwargs):
            yield chunk

    def interrupted(self, episode_id: str) -> list[dict[str, Any]] | None:
        """The interrupts episode `episode_id` is paused at (``[{"id", "value"}]``; a resume on its thread continues
        it), or None when it is not paused."""
        return self.tracer.paused(episode_id)

    def transform(self, input: Iterator[Any], config: RunnableConfig | None = None, **kwargs: Any) -> Iterator[Any]:
        """A ``|`` sequence streams through here: the collected input is one episode."""
        final = _collect(input)
        yield from self.stream(final, config, **kwargs)

    async def atransform(self, input: AsyncIterator[Any], config: RunnableConfig | None = None,
                         **kwargs: Any) -> AsyncIterator[Any]:
        final = await _acollect(input)
        async for chunk in self.astream(final, config, **kwargs):
            yield chunk

    async def astream_events(self, input: Any, config: RunnableConfig | None = None, *, episode_id: str | None = None,
                             scenario_id: str | None = None, seed: int | None = None, versions: Versions = None,
                             metadata: Mapping[str, Any] | None = None, **kwargs: Any) -> AsyncIterator[Any]:
        """The graph's own event stream (``version="v2"``) for one episode."""
        cfg = self._config(config, episode_id, scenario_id, seed, versions, metadata, input)
        async for event in self.graph.astream_events(input, cfg, **kwargs):
            yield event

    async def astream_log(self, input: Any, config: RunnableConfig | None = None, *, episode_id: str | None = None,
                          scenario_id: str | None = None, seed: int | None = None, versions: Versions = None,
                          metadata: Mapping[str, Any] | None = None, **kwargs: Any) -> AsyncIterator[Any]:
        """The graph's run log patches for one episode."""
        cfg = self._config(config, episode_id, scenario_id, seed, versions, metadata, input)
        async for patch in self.graph.astream_log(input, cfg, **kwargs):
            yield patch

    def _batch_configs(self, inputs: Sequence[Any], config: RunnableConfig | Sequence[RunnableConfig] | None,
                       episode_ids: Sequence[str] | None, scenario_ids: Sequence[str | None] | None,
                       seeds: Sequence[int | None] | None, versions: Versions,
                       metadata: Mapping[str, Any] | None) -> list[dict[str, Any]]:
        n = len(inputs)
        configs = list(config) if isinstance(config, Sequence) else [config] * n
        if len(configs) != n:
            raise ValueError(f"batch: {len(configs)} configs for {n} inputs")
        return [self._config(configs[i], episode_ids[i] if episode_ids else None,
                             scenario_ids[i] if scenario_ids else None, seeds[i] if seeds else None, versions, metadata,
                             inputs[i])
                for i in range(n)]

    def batch(self, inputs: Sequence[Any], config: RunnableConfig | Sequence[RunnableConfig] | None = None, *,
              return_exceptions: bool = False, episode_ids: Sequence[str] | None = None,
              scenario_ids: Sequence[str | None] | None = None, seeds: Sequence[int | None] | None = None,
              versions: Versions = None, metadata: Mapping[str, Any] | None = None, **kwargs: Any) -> list[Any]:
        """One episode per input, run concurrently; per-input ids/scenarios/seeds as parallel lists."""
        if not inputs:
            return []
        configs = self._batch_configs(inputs, config, episode_ids, scenario_ids, seeds, versions, metadata)
        return self.graph.batch(list(inputs), configs, return_exceptions=return_exceptions, **kwargs)

    async def abatch(self, inputs: Sequence[Any], config: RunnableConfig | Sequence[RunnableConfig] | None = None, *,
                     return_exceptions: bool = False, episode_ids: Sequence[str] | None = None,
                     scenario_ids: Sequence[str | None] | None = None, seeds: Sequence[int | None] | None = None,
                     versions: Versions = None, metadata: Mapping[str, Any] | None = None, **kwargs: Any) -> list[Any]:
        """Async twin of `batch`."""
        if not inputs:
            return []
        configs = self._batch_configs(inputs, config, episode_ids, scenario_ids, seeds, versions, metadata)
        return await self.graph.abatch(list(inputs), configs, return_exceptions=return_exceptions, **kwargs)


def check_recursion_limit(value: Any, where: str = "recursion_limit") -> int | None:
    """`value` as LangGraph's recursion limit: None, or a whole number >= 1 (`ValueError` naming `where`)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where} must be a whole number >= 1 (LangGraph steps per run), got {value!r}")
    return value


def _has_checkpointer(graph: Any) -> bool:
    """Whether runs of `graph` need a thread id: compiled with a checkpointer saver (not None/False/True)."""
    saver = getattr(graph, "checkpointer", None)
    return saver is not None and not isinstance(saver, bool)


def _collect(chunks: Iterator[Any]) -> Any:
    final: Any = None
    for i, chunk in enumerate(chunks):
        final = chunk if i == 0 else final + chunk
    return final


async def _acollect(chunks: AsyncIterator[Any]) -> Any:
    final: Any = None
    i = 0
    async for chunk in chunks:
        final = chunk if i == 0 else final + chunk
        i += 1
    return final


def wrap(
    graph: Any,
    *,
    team: Any = None,
    trace_dir: str | os.PathLike | None = "traces",
    node_roles: Mapping[str, str] | None = None,
    capture_messages: bool = True,
    redact: Callable[[str], str] | None = None,
    otlp_endpoint: str | None = None,
    exporters: Sequence[SpanExporter] = (),
    shadow: Any = None,
    sample_rate: float = 0.0,
    shadow_timeout_s: float = 120.0,
    shadow_queue_size: int = 16,
    shadow_seed: int | None = None,
    service_name: str = "marft_lg",
    max_file_bytes: int = 64 * 2**20,
    serve_http: bool = False,
    recursion_limit: int | None = None,
    resume: Any = None,
    episodes: str = "turn",
    conversation_idle_s: float | None = None,
) -> WrappedGraph:
    """Route and trace a compiled LangGraph app.

    team: a `Team` (any `ChatEngine`) that `TeamChatModel` calls go to. trace_dir: where the
    OTLP/JSON-lines files go (None: no file). node_roles: ``{node: role}``. capture_messages: record
    prompts, completions, tool arguments/results and the final output (False keeps token ids and
    log-probs only). redact: ``str -> str`` applied to every recorded text. otlp_endpoint: also export
    to this OTLP/HTTP collector. exporters: extra `SpanExporter`s. shadow: a ``{role: ref}`` map, an
    alias name, or another engine; with probability `sample_rate` each episode (`invoke`, `ainvoke`,
    `stream`, `astream`, and each input of `batch`/`abatch`) is re-run on it in the background (the
    shadow runs the whole graph with ``invoke``) and both episodes are tagged as a mirrored pair.
    serve_http: serve `team` on a loopback OpenAI server in this process and send the episodes' HTTP chat calls
    for its roles there (an app on `ChatOpenAI` / `openai` runs unchanged on the team's adapters, with each run's
    version pins and seeds); what that server samples is recorded beside the app's spans.
    resume: how the project's runners answer the app's `interrupt()` when no person is there (`ResumePolicy`, a
    callable ``payload -> value``, or ``{"value": ...}`` / ``{"call": "module:attr"}``); None: such runs stay paused.
    episodes: ``"turn"`` (each run on a thread is an episode; a resume continues the paused one) or
    ``"conversation"`` (every run on a thread continues its episode; `conversation_idle_s` starts a new one after
    that many idle seconds).

    A run that stops at `interrupt()` is recorded as paused (episode metadata ``paused``, ``interrupts``); the
    ``Command(resume=...)`` run on the same thread continues that episode (``resumes`` in its metadata).

    Every entry point of a graph compiled with a checkpointer gets the episode id as its thread id when the run's
    config names none. The app's HTTP calls made inside an episode carry W3C trace context and baggage
    (`marft_lg.tracing.propagation`), so a `marft-lg serve` answering them records its side joined to the app's.
    """
    if shadow is None and sample_rate > 0:
        raise ValueError("wrap: sample_rate > 0 needs shadow=<{role: ref} map, alias or engine> to mirror to")
    if shadow is not None and not isinstance(shadow, Mapping | str) and not hasattr(shadow, "chat"):
        raise TypeError(f"wrap: shadow must be a {{role: ref}} map, an alias name or a ChatEngine, got {type(shadow).__name__}")
    if shadow is not None and isinstance(shadow, Mapping | str) and team is None:
        raise ValueError("wrap: a version map or alias as shadow needs team=... (the Team that serves both versions)")
    sink = make_record_sink(trace_dir, otlp_endpoint=otlp_endpoint, exporters=exporters, service_name=service_name,
                            max_file_bytes=max_file_bytes)
    mirror = (ShadowMirror(sample_rate, queue_size=shadow_queue_size, timeout_s=shadow_timeout_s, seed=shadow_seed)
              if shadow is not None and sample_rate > 0 else None)
    return WrappedGraph(graph, team=team, sink=sink, trace_dir=trace_dir, node_roles=node_roles,
                        capture_messages=capture_messages, redact=redact, shadow=shadow, mirror=mirror,
                        serve_http=serve_http, recursion_limit=recursion_limit, resume=resume, episodes=episodes,
                        conversation_idle_s=conversation_idle_s)
