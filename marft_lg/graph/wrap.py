"""`wrap(graph, team=...)`: the user's compiled LangGraph app, routed to a Team and traced per episode.

The wrapped graph has the same interface (`invoke`, `ainvoke`, `stream`, `astream`, `batch`,
`abatch`, other attributes passed through) plus per-invocation keywords: `episode_id`,
`scenario_id`, `seed`, `versions`, `metadata`. Each invocation is one episode: a root
``invoke_workflow`` span and a callback recorder that sees every chat model, tool and node.
Nothing about the run itself changes: the recorder only observes, routing only applies to
`TeamChatModel` calls.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from langchain_core.callbacks import BaseCallbackManager
from opentelemetry.sdk.trace.export import SpanExporter

from marft_lg.graph import routing
from marft_lg.graph.shadow import ShadowJob, ShadowMirror
from marft_lg.tracing.recorder import EpisodeInfo, EpisodeRecorder
from marft_lg.tracing.sink import RecordSink, make_record_sink

_SENTINEL = object()
logger = logging.getLogger("marft_lg.graph")


def _with_callback(config: dict[str, Any], handler: EpisodeRecorder) -> dict[str, Any]:
    callbacks = config.get("callbacks")
    if callbacks is None:
        config["callbacks"] = [handler]
    elif isinstance(callbacks, BaseCallbackManager):
        manager = callbacks.copy()
        manager.add_handler(handler, inherit=True)
        config["callbacks"] = manager
    else:
        config["callbacks"] = [*callbacks, handler]
    return config


class WrappedGraph:
    """A compiled graph plus routing and tracing; see `wrap`."""

    def __init__(self, graph: Any, *, team: Any = None, sink: RecordSink, trace_dir: str | os.PathLike | None = None,
                 node_roles: Mapping[str, str] | None = None,
                 capture_messages: bool = True, redact: Callable[[str], str] | None = None,
                 shadow: Any = None, mirror: ShadowMirror | None = None, workflow_name: str | None = None):
        self.graph = graph
        self.team = team
        self.sink = sink
        self.trace_dir = Path(trace_dir) if trace_dir is not None else None
        self.node_roles = dict(node_roles) if node_roles else None
        self.capture_messages = capture_messages
        self.redact = redact
        self.shadow = shadow
        self.mirror = mirror
        self.workflow_name = workflow_name or getattr(graph, "name", None) or "LangGraph"
        self.last_episode_id: str | None = None

    # -- passthrough -------------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        if name == "graph":
            raise AttributeError(name)
        return getattr(self.graph, name)

    def __repr__(self) -> str:
        return f"WrappedGraph({self.workflow_name!r}, trace_dir={str(self.trace_dir)!r})"

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
        self.sink.shutdown()

    # -- episodes -------------------------------------------------------------------------------
    def _begin(self, config: Mapping[str, Any] | None, *, episode_id: str | None, scenario_id: str | None,
               seed: int | None, versions: Mapping[str, str] | str | None, metadata: Mapping[str, Any] | None,
               pair: tuple[str, str] | None = None, engine_override: Any = None):
        episode_id = str(episode_id) if episode_id is not None else uuid.uuid4().hex
        config = dict(config or {})
        meta = dict(metadata or {})
        if seed is not None:
            meta.setdefault("seed", seed)
        if pair is not None:
            meta["mirror_pair_id"], meta["mirror_side"] = pair
        thread_id = (config.get("configurable") or {}).get("thread_id")
        info = EpisodeInfo(
            episode_id=episode_id,
            scenario_id=scenario_id,
            metadata=meta,
            conversation_id=str(thread_id) if thread_id is not None else None,
            node_roles=self.node_roles,
            capture_messages=self.capture_messages,
            redact=self.redact,
            mirror_pair_id=pair[0] if pair else None,
            mirror_side=pair[1] if pair else None,
            workflow_name=self.workflow_name,
        )
        recorder = EpisodeRecorder.start(self.sink, info)
        route = routing.EpisodeRoute(episode_id=episode_id, team=self.team, node_roles=self.node_roles,
                                     versions=dict(versions) if isinstance(versions, Mapping) else versions,
                                     seed=seed, engine_override=engine_override)
        routing.register(route)
        config["metadata"] = {**(config.get("metadata") or {}), routing.METADATA_KEY: episode_id}
        _with_callback(config, recorder)
        self.last_episode_id = episode_id
        return config, recorder

    @staticmethod
    def _end(recorder: EpisodeRecorder, error: BaseException | None = None, outcome: Any = _SENTINEL) -> None:
        """Close the episode; a failure here (e.g. a raising redaction hook) is logged, never raised."""
        routing.unregister(recorder.info.episode_id)
        try:
            recorder.finish(error=error, outcome=None if outcome is _SENTINEL else outcome,
                            has_outcome=outcome is not _SENTINEL)
        except Exception:  # noqa: BLE001
            logger.exception("marft_lg: closing the trace of episode %s failed; the app's result is unaffected",
                             recorder.info.episode_id)
            recorder.end_root()

    def _mirror_pair(self, episode_id: str | None) -> tuple[str, str] | None:
        if self.mirror is None or not self.mirror.sample():
            return None
        return uuid.uuid4().hex, str(episode_id) if episode_id is not None else uuid.uuid4().hex

    def _submit_shadow(self, pair: tuple[str, str], live_episode: str, input: Any, config: Mapping[str, Any] | None,
                       kw: dict[str, Any], is_async: bool) -> None:
        """Queue the same input on the candidate; never raises into the live path."""
        try:
            shadow_input = copy.deepcopy(input)
        except Exception:  # noqa: BLE001 - uncopyable input: share it (graphs do not mutate their input)
            shadow_input = input
        cfg = {k: v for k, v in dict(config or {}).items() if k not in ("callbacks", "run_id")}
        configurable = dict(cfg.get("configurable") or {})
        if "thread_id" in configurable:
            configurable["thread_id"] = f"{configurable['thread_id']}:shadow:{pair[0]}"
            configurable.pop("checkpoint_id", None)
        if configurable:
            cfg["configurable"] = configurable
        versions = kw.get("versions")
        engine_override = None
        if isinstance(self.shadow, Mapping):
            versions = {**(versions if isinstance(versions, Mapping) else {}), **self.shadow}
        elif isinstance(self.shadow, str):
            versions = self.shadow
        else:
            engine_override = self.shadow
        state: dict[str, Any] = {}

        def run() -> None:
            config2, recorder = self._begin(
                cfg, episode_id=f"{live_episode}-shadow", scenario_id=kw.get("scenario_id"), seed=kw.get("seed"),
                versions=versions, metadata={**(kw.get("metadata") or {}), "mirror_of": live_episode},
                pair=(pair[0], "shadow"), engine_override=engine_override,
            )
            state["recorder"] = recorder
            try:
                if is_async:
                    out = asyncio.run(self.graph.ainvoke(shadow_input, config2))
                else:
                    out = self.graph.invoke(shadow_input, config2)
            except BaseException as exc:
                self._end(recorder, exc)
                raise
            self._end(recorder, outcome=out)

        def on_timeout() -> None:
            recorder = state.get("recorder")
            if recorder is not None:
                self._end(recorder, TimeoutError(f"shadow run exceeded {self.mirror.timeout_s}s"))

        try:
            self.mirror.submit(ShadowJob(pair_id=pair[0], run=run, on_timeout=on_timeout))
        except Exception:  # noqa: BLE001
            self.mirror._count("dropped")

    # -- the graph interface ---------------------------------------------------------------------
    def invoke(self, input: Any, config: Mapping[str, Any] | None = None, *, episode_id: str | None = None,
               scenario_id: str | None = None, seed: int | None = None, versions: Mapping[str, str] | str | None = None,
               metadata: Mapping[str, Any] | None = None, **kwargs: Any) -> Any:
        """Run one episode (same result as ``graph.invoke``)."""
        kw = {"scenario_id": scenario_id, "seed": seed, "versions": versions, "metadata": metadata}
        pair = self._mirror_pair(episode_id)
        if pair is not None:
            episode_id = pair[1]
        cfg, recorder = self._begin(config, episode_id=episode_id, pair=(pair[0], "live") if pair else None, **kw)
        try:
            out = self.graph.invoke(input, cfg, **kwargs)
        except BaseException as exc:
            self._end(recorder, exc)
            raise
        finally:
            if pair is not None:
                self._submit_shadow(pair, recorder.info.episode_id, input, config, kw, is_async=False)
        self._end(recorder, outcome=out)
        return out

    async def ainvoke(self, input: Any, config: Mapping[str, Any] | None = None, *, episode_id: str | None = None,
                      scenario_id: str | None = None, seed: int | None = None,
                      versions: Mapping[str, str] | str | None = None, metadata: Mapping[str, Any] | None = None,
                      **kwargs: Any) -> Any:
        """Async twin of `invoke`."""
        kw = {"scenario_id": scenario_id, "seed": seed, "versions": versions, "metadata": metadata}
        pair = self._mirror_pair(episode_id)
        if pair is not None:
            episode_id = pair[1]
        cfg, recorder = self._begin(config, episode_id=episode_id, pair=(pair[0], "live") if pair else None, **kw)
        try:
            out = await self.graph.ainvoke(input, cfg, **kwargs)
        except BaseException as exc:
            self._end(recorder, exc)
            raise
        finally:
            if pair is not None:
                self._submit_shadow(pair, recorder.info.episode_id, input, config, kw, is_async=True)
        self._end(recorder, outcome=out)
        return out

    def _values_mode(self, kwargs: dict[str, Any]) -> bool:
        mode = kwargs.get("stream_mode", getattr(self.graph, "stream_mode", "values"))
        return mode == "values" and not kwargs.get("subgraphs")

    def stream(self, input: Any, config: Mapping[str, Any] | None = None, *, episode_id: str | None = None,
               scenario_id: str | None = None, seed: int | None = None, versions: Mapping[str, str] | str | None = None,
               metadata: Mapping[str, Any] | None = None, **kwargs: Any) -> Iterator[Any]:
        """Stream one episode (same chunks as ``graph.stream``); the episode ends with the stream."""
        kw = {"scenario_id": scenario_id, "seed": seed, "versions": versions, "metadata": metadata}
        pair = self._mirror_pair(episode_id)
        if pair is not None:
            episode_id = pair[1]
        cfg, recorder = self._begin(config, episode_id=episode_id, pair=(pair[0], "live") if pair else None, **kw)
        last = _SENTINEL
        try:
            for chunk in self.graph.stream(input, cfg, **kwargs):
                last = chunk
                yield chunk
        except BaseException as exc:
            self._end(recorder, None if isinstance(exc, GeneratorExit) else exc)
            raise
        finally:
            if pair is not None:
                self._submit_shadow(pair, recorder.info.episode_id, input, config, kw, is_async=False)
        self._end(recorder, outcome=last if self._values_mode(kwargs) else _SENTINEL)

    async def astream(self, input: Any, config: Mapping[str, Any] | None = None, *, episode_id: str | None = None,
                      scenario_id: str | None = None, seed: int | None = None,
                      versions: Mapping[str, str] | str | None = None, metadata: Mapping[str, Any] | None = None,
                      **kwargs: Any) -> AsyncIterator[Any]:
        """Async twin of `stream`."""
        kw = {"scenario_id": scenario_id, "seed": seed, "versions": versions, "metadata": metadata}
        pair = self._mirror_pair(episode_id)
        if pair is not None:
            episode_id = pair[1]
        cfg, recorder = self._begin(config, episode_id=episode_id, pair=(pair[0], "live") if pair else None, **kw)
        last = _SENTINEL
        try:
            async for chunk in self.graph.astream(input, cfg, **kwargs):
                last = chunk
                yield chunk
        except BaseException as exc:
            self._end(recorder, None if isinstance(exc, GeneratorExit) else exc)
            raise
        finally:
            if pair is not None:
                self._submit_shadow(pair, recorder.info.episode_id, input, config, kw, is_async=True)
        self._end(recorder, outcome=last if self._values_mode(kwargs) else _SENTINEL)

    def batch(self, inputs: Sequence[Any], config: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None, *,
              episode_ids: Sequence[str] | None = None, scenario_ids: Sequence[str | None] | None = None,
              seeds: Sequence[int | None] | None = None, versions: Mapping[str, str] | str | None = None,
              metadata: Mapping[str, Any] | None = None, return_exceptions: bool = False,
              max_concurrency: int | None = None) -> list[Any]:
        """One episode per input, run concurrently; per-input ids/scenarios/seeds as parallel lists."""
        n = len(inputs)
        configs = list(config) if isinstance(config, Sequence) else [config] * n
        if max_concurrency is None and configs and configs[0]:
            max_concurrency = configs[0].get("max_concurrency")

        def one(i: int) -> Any:
            try:
                return self.invoke(inputs[i], configs[i], episode_id=episode_ids[i] if episode_ids else None,
                                   scenario_id=scenario_ids[i] if scenario_ids else None,
                                   seed=seeds[i] if seeds else None, versions=versions, metadata=metadata)
            except Exception as exc:
                if return_exceptions:
                    return exc
                raise

        if n == 0:
            return []
        with ThreadPoolExecutor(max_workers=max_concurrency or min(n, 8)) as pool:
            return list(pool.map(one, range(n)))

    async def abatch(self, inputs: Sequence[Any], config: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
                     *, episode_ids: Sequence[str] | None = None, scenario_ids: Sequence[str | None] | None = None,
                     seeds: Sequence[int | None] | None = None, versions: Mapping[str, str] | str | None = None,
                     metadata: Mapping[str, Any] | None = None, return_exceptions: bool = False,
                     max_concurrency: int | None = None) -> list[Any]:
        """Async twin of `batch`."""
        n = len(inputs)
        configs = list(config) if isinstance(config, Sequence) else [config] * n
        gate = asyncio.Semaphore(max_concurrency or max(n, 1))

        async def one(i: int) -> Any:
            async with gate:
                return await self.ainvoke(inputs[i], configs[i], episode_id=episode_ids[i] if episode_ids else None,
                                          scenario_id=scenario_ids[i] if scenario_ids else None,
                                          seed=seeds[i] if seeds else None, versions=versions, metadata=metadata)

        return list(await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=return_exceptions))


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
    return WrappedGraph(graph, team=team, sink=sink, trace_dir=trace_dir, node_roles=node_roles, capture_messages=capture_messages,
                        redact=redact, shadow=shadow, mirror=mirror)
