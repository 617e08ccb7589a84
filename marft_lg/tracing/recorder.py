"""A LangChain callback handler that turns one graph run into OpenTelemetry spans.

It sees every chat model, tool and chain callback of the run (whatever the chat model class), so
apps that call `ChatOpenAI` against `marft-lg serve` are traced as well as `TeamChatModel` ones:
``invoke_workflow`` (root, made by `EpisodeRecorder.start`) > ``invoke_agent {node}`` per LangGraph
task > ``chat {model}`` per LLM call / ``execute_tool {tool}`` per tool call.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii
from typing import Any

from langchain_core.callbacks import BaseCallbackHandler

from marft_lg.tracing import attributes as A
from marft_lg.tracing.llm_output import record_response
from marft_lg.tracing.messages import (
    content_text,
    genai_text_messages_json,
    messages_to_dicts,
    redact_messages,
    redact_value,
    to_jsonable,
)
from marft_lg.tracing.records import (
    KIND_CLIENT,
    KIND_INTERNAL,
    STATUS_ERROR,
    STATUS_OK,
    AttrGroup,
    SpanRecord,
    new_trace_id,
)


@dataclass
class EpisodeInfo:
    """What every span of one episode carries, plus the capture settings."""

    episode_id: str
    scenario_id: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    conversation_id: str | None = None
    node_roles: dict[str, str] | None = None
    capture_messages: bool = True
    redact: Callable[[str], str] | None = None
    mirror_pair_id: str | None = None
    mirror_side: str | None = None
    workflow_name: str = "LangGraph"


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=to_jsonable)


def _is_control_flow(error: BaseException) -> bool:
    """LangGraph interrupts / parent commands travel as exceptions but are not failures."""
    try:
        from langgraph.errors import GraphBubbleUp
    except ImportError:  # pragma: no cover
        return False
    return isinstance(error, GraphBubbleUp)


class EpisodeRecorder(BaseCallbackHandler):
    """Callback handler for one episode; thread-safe (parallel `Send` tasks call it from many threads).

    Spans are `SpanRecord`s (plain data): a callback fills in attributes and, when the span ends,
    hands the record to the sink's queue; OTLP/JSON encoding and file writes happen in batches in
    the sink's writer, not here.
    """

    run_inline = True
    raise_error = False

    def __init__(self, sink: Any, info: EpisodeInfo, root: SpanRecord):
        self.sink = sink
        self.info = info
        self.root = root
        self._trace_id = root.trace_id
        self._submit = sink.submit
        self._lock = threading.Lock()
        self._parent: dict[int, SpanRecord] = {}  # run id (as int: cheaper to hash) -> span its children hang under
        self._own: dict[int, SpanRecord] = {}  # run id -> span this recorder opened for it
        self._tasks: dict[str, SpanRecord] = {}  # langgraph checkpoint ns -> invoke_agent span
        self._t0: dict[int, float] = {}
        self._attr_cache: dict[str, AttrGroup] = {}
        self.n_chat = 0
        self.n_errors = 0
        self.finished = False
        self.root_ended = False

    # -- lifecycle ---------------------------------------------------------------------------
    @classmethod
    def start(cls, sink: Any, info: EpisodeInfo) -> EpisodeRecorder:
        """Open the episode's ``invoke_workflow`` root span and return the recorder for its callbacks."""
        attrs: dict[str, Any] = {
            A.GEN_AI_OPERATION_NAME: A.OP_WORKFLOW,
            A.GEN_AI_PROVIDER_NAME: "langgraph",
            A.GEN_AI_AGENT_NAME: info.workflow_name,
            A.MARFT_EPISODE_ID: info.episode_id,
            A.GEN_AI_CONVERSATION_ID: info.conversation_id or info.episode_id,
        }
        if info.scenario_id is not None:
            attrs[A.MARFT_SCENARIO_ID] = str(info.scenario_id)
        if info.metadata:
            attrs[A.MARFT_EPISODE_METADATA] = _json(info.metadata)
        if info.mirror_pair_id:
            attrs[A.MARFT_MIRROR_PAIR_ID] = info.mirror_pair_id
            attrs[A.MARFT_MIRROR_SIDE] = info.mirror_side or "live"
        root = SpanRecord(new_trace_id(), 0, f"{A.OP_WORKFLOW} {info.workflow_name}", KIND_INTERNAL, attrs)
        return cls(sink, info, root)

    def finish(self, *, error: BaseException | None = None, outcome: Any = None, has_outcome: bool = False) -> None:
        """Close spans left open (error status when the run failed), then the root span (once)."""
        with self._lock:
            if self.finished:
                return
            self.finished = True
        leftovers = []
        while True:  # popitem is atomic: a span a late callback closes meanwhile is never ended twice
            try:
                leftovers.append(self._own.popitem()[1])
            except KeyError:
                break
        for span in leftovers:
            if error is not None:
                span.set_status(STATUS_ERROR, f"episode failed: {type(error).__name__}")
            self._end(span)
        try:
            if error is not None and not _is_control_flow(error):
                self.root.record_exception(error)
                self.root.attributes[A.ERROR_TYPE] = type(error).__qualname__
                self.root.set_status(STATUS_ERROR, f"{type(error).__name__}: {error}")
            elif error is None:
                self.root.set_status(STATUS_OK)
                if has_outcome and self.info.capture_messages:
                    self.root.attributes[A.MARFT_OUTCOME] = _outcome_json(outcome, self.info.redact)
        finally:
            self.end_root()

    def add_metadata(self, extra: Mapping[str, Any]) -> None:
        """Merge `extra` into the episode's metadata before its root span ends (what is known only at the end)."""
        self.info.metadata.update(extra)
        self.root.attributes[A.MARFT_EPISODE_METADATA] = _json(self.info.metadata)

    def end_root(self) -> None:
        """End the root span and queue it for export (once)."""
        with self._lock:
            if self.root_ended:
                return
            self.root_ended = True
        self._end(self.root)

    def span_of(self, run_id: int) -> SpanRecord | None:
        """The span this recorder opened for run `run_id` (as an int) and has not ended, if any."""
        return self._own.get(run_id)

    # -- helpers ------------------------------------------------------------------------------
    def _end(self, span: SpanRecord) -> None:
        span.end_ns = time.time_ns()
        self._submit(span)

    def _parent_span(self, parent_run_id: int | None, metadata: Mapping[str, Any] | None) -> SpanRecord:
        span = self._parent.get(parent_run_id) if parent_run_id is not None else None
        if span is None and metadata:
            span = self._tasks.get(metadata.get("langgraph_checkpoint_ns", ""))
        return span or self.root

    def _graph_attrs(self, md: Mapping[str, Any]) -> tuple[dict[str, Any], AttrGroup | None]:
        """Episode + LangGraph task attributes, computed once per task (all its calls share them).

        Returns a copy to add span attributes to, and the task's `AttrGroup` (encoded once per task).
        """
        node = md.get("langgraph_node")
        if node is None:
            return {A.MARFT_EPISODE_ID: self.info.episode_id}, None
        ns = md.get("langgraph_checkpoint_ns") or ""
        cached = self._attr_cache.get(ns)
        if cached is not None:
            return dict(cached.attrs), cached
        attrs: dict[str, Any] = {A.MARFT_EPISODE_ID: self.info.episode_id}
        path = A.agent_from_namespace(ns, node)
        attrs[A.GEN_AI_AGENT_NAME] = path
        attrs[A.MARFT_AGENT_NODE] = path
        attrs[A.MARFT_AGENT_ROLE] = A.resolve_role(path, self.info.node_roles, md.get("lc_agent_name"))
        if md.get("langgraph_step") is not None:
            attrs[A.MARFT_LANGGRAPH_STEP] = int(md["langgraph_step"])
        if md.get("langgraph_triggers") is not None:
            attrs[A.MARFT_LANGGRAPH_TRIGGERS] = _json_str_list(md["langgraph_triggers"])
        if ns:
            attrs[A.MARFT_LANGGRAPH_CHECKPOINT_NS] = ns
            last = ns.rsplit("|", 1)[-1]
            if ":" in last:
                attrs[A.MARFT_LANGGRAPH_TASK_ID] = last.split(":", 1)[1]
        group = self._attr_cache[ns] = AttrGroup(attrs)
        return dict(attrs), group

    def _open(self, run_id: int, name: str, parent: SpanRecord, kind: int, attrs: dict[str, Any],
              group: AttrGroup | None = None) -> SpanRecord:
        span = SpanRecord(self._trace_id, parent.span_id, name, kind, attrs)
        span.group = group
        self._own[run_id] = span
        self._parent[run_id] = span
        return span

    def _close(self, run_id: int, error: BaseException | None = None) -> SpanRecord | None:
        span = self._own.pop(run_id, None)  # dict operations are atomic: no lock needed on the hot path
        self._parent.pop(run_id, None)
        self._t0.pop(run_id, None)
        if span is None:
            return None
        if error is not None and not _is_control_flow(error):
            self.n_errors += 1
            span.record_exception(error)
            span.attributes[A.ERROR_TYPE] = type(error).__qualname__
            span.set_status(STATUS_ERROR, f"{type(error).__name__}: {error}")
        elif error is None:
            span.set_status(STATUS_OK)
        self._end(span)
        return span

    # -- chains: the graph and its node tasks -----------------------------------------------
    def on_chain_start(self, serialized, inputs, *, run_id, parent_run_id=None, tags=None, metadata=None, **kwargs):
        run_id, parent_run_id = run_id.int, parent_run_id.int if parent_run_id is not None else None
        md = metadata or {}
        node = md.get("langgraph_node")
        ns = md.get("langgraph_checkpoint_ns") or ""
        is_task = (
            node is not None
            and kwargs.get("name") == node
            and not str(node).startswith("__")
            and ns.rsplit("|", 1)[-1].startswith(f"{node}:")
            and ns not in self._tasks
        )
        parent = self._parent_span(parent_run_id, None)
        if not is_task:
            self._parent[run_id] = parent
            return
        attrs, group = self._graph_attrs(md)
        attrs[A.GEN_AI_OPERATION_NAME] = A.OP_AGENT
        span = self._open(run_id, f"{A.OP_AGENT} {attrs[A.MARFT_AGENT_NODE]}", parent, KIND_INTERNAL, attrs, group)
        self._tasks[ns] = span

    def on_chain_end(self, outputs, *, run_id, **kwargs):
        run_id = run_id.int
        if run_id in self._own:
            self._close(run_id)
        else:
            self._parent.pop(run_id, None)

    def on_chain_error(self, error, *, run_id, **kwargs):
        run_id = run_id.int
        if run_id in self._own:
            self._close(run_id, error)
        else:
            self._parent.pop(run_id, None)

    # -- chat model calls ---------------------------------------------------------------------
    def on_chat_model_start(self, serialized, messages, *, run_id, parent_run_id=None, tags=None, metadata=None, **kwargs):
        run_id, parent_run_id = run_id.int, parent_run_id.int if parent_run_id is not None else None
        md = metadata or {}
        params = kwargs.get("invocation_params") or {}
        model = (
            md.get("ls_model_name")
            or params.get("model")
            or params.get("model_name")
            or kwargs.get("name")
            or (serialized or {}).get("name")
            or "unknown"
        )
        attrs, group = self._graph_attrs(md)
        attrs[A.GEN_AI_OPERATION_NAME] = A.OP_CHAT
        attrs[A.GEN_AI_PROVIDER_NAME] = str(md.get("ls_provider") or params.get("_type") or "langchain")
        attrs[A.GEN_AI_REQUEST_MODEL] = str(model)
        attrs[A.GEN_AI_CONVERSATION_ID] = self.info.conversation_id or self.info.episode_id
        for key, ls_key, attr in _SAMPLING:
            value = params.get(key)
            if value is None:
                value = md.get(ls_key)
            if type(value) is float or type(value) is int or (isinstance(value, int | float) and not isinstance(value, bool)):
                attrs[attr] = value
        stop = params.get("stop") or md.get("ls_stop")
        if stop:
            attrs[A.GEN_AI_REQUEST_STOP_SEQUENCES] = [stop] if isinstance(stop, str) else [str(s) for s in stop]
        if self.info.capture_messages and messages:
            text = genai_text_messages_json(messages[0]) if self.info.redact is None else None
            if text is None:
                text = A.to_genai_messages(redact_messages(messages_to_dicts(messages[0]), self.info.redact))
            attrs[A.GEN_AI_INPUT_MESSAGES] = text
        parent = self._parent_span(parent_run_id, md)
        self._open(run_id, f"{A.OP_CHAT} {model}", parent, KIND_CLIENT, attrs, group)
        self._t0[run_id] = time.perf_counter()
        self.n_chat += 1

    def on_llm_start(self, serialized, prompts, *, run_id, parent_run_id=None, tags=None, metadata=None, **kwargs):
        msgs = [[{"role": "user", "content": p}] for p in prompts[:1]]
        self.on_chat_model_start(
            serialized, msgs, run_id=run_id, parent_run_id=parent_run_id, tags=tags, metadata=metadata, **kwargs
        )

    def on_llm_end(self, response, *, run_id, **kwargs):
        run_id = run_id.int
        span = self._own.get(run_id)
        if span is None:
            return
        t0 = self._t0.get(run_id)
        if t0 is not None:
            span.attributes[A.MARFT_LATENCY_S] = time.perf_counter() - t0
        record_response(span, response, capture_messages=self.info.capture_messages, redact=self.info.redact)
        self._close(run_id)

    def on_llm_error(self, error, *, run_id, **kwargs):
        run_id = run_id.int
        self._close(run_id, error)

    # -- tools --------------------------------------------------------------------------------
    def on_tool_start(self, serialized, input_str, *, run_id, parent_run_id=None, tags=None, metadata=None, **kwargs):
        run_id, parent_run_id = run_id.int, parent_run_id.int if parent_run_id is not None else None
        md = metadata or {}
        tool = kwargs.get("name") or (serialized or {}).get("name") or "tool"
        attrs, group = self._graph_attrs(md)
        attrs[A.GEN_AI_OPERATION_NAME] = A.OP_TOOL
        attrs[A.GEN_AI_TOOL_NAME] = str(tool)
        if kwargs.get("tool_call_id"):
            attrs[A.GEN_AI_TOOL_CALL_ID] = str(kwargs["tool_call_id"])
        if self.info.capture_messages:
            args = kwargs.get("inputs")
            attrs[A.GEN_AI_TOOL_CALL_ARGUMENTS] = _json(redact_value(args if args is not None else input_str, self.info.redact))
        self._open(run_id, f"{A.OP_TOOL} {tool}", self._parent_span(parent_run_id, md), KIND_INTERNAL, attrs, group)

    def on_tool_end(self, output, *, run_id, **kwargs):
        run_id = run_id.int
        span = self._own.get(run_id)
        if span is None:
            return
        if self.info.capture_messages:
            result = content_text(output.content) if hasattr(output, "content") else output
            span.attributes[A.GEN_AI_TOOL_CALL_RESULT] = _json(redact_value(_plain(result), self.info.redact))
        if getattr(output, "status", None) == "error":
            span.set_status(STATUS_ERROR, "tool returned an error result")
            span.attributes[A.ERROR_TYPE] = "ToolError"
            span = self._own.pop(run_id, None)
            self._parent.pop(run_id, None)
            if span is not None:
                self._end(span)
            return
        self._close(run_id)

    def on_tool_error(self, error, *, run_id, **kwargs):
        run_id = run_id.int
        self._close(run_id, error)


_SAMPLING = (
    ("temperature", "ls_temperature", A.GEN_AI_REQUEST_TEMPERATURE),
    ("top_p", "ls_top_p", A.GEN_AI_REQUEST_TOP_P),
    ("max_tokens", "ls_max_tokens", A.GEN_AI_REQUEST_MAX_TOKENS),
    ("seed", "ls_seed", A.GEN_AI_REQUEST_SEED),
)


def _json_str_list(values: Any) -> str:
    """``json.dumps(list(values))``, built directly when every item is a string (LangGraph triggers are)."""
    items = list(values)
    if all(type(v) is str for v in items):
        return "[" + ", ".join(map(encode_basestring_ascii, items)) + "]"
    return json.dumps(items)


def _outcome_json(outcome: Any, redact: Callable[[str], str] | None) -> str:
    """The final graph output as JSON text (redacted); without a hook no round trip is needed."""
    if redact is None:
        return _json(outcome)
    return _json(redact_value(_plain(outcome), redact))


def _plain(value: Any) -> Any:
    """A graph output -> JSON-compatible data (messages become chat dicts)."""
    return json.loads(_json(value))
