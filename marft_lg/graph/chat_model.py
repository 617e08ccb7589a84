"""`TeamChatModel`: a LangChain chat model that sends each call to the adapter of the agent that made it.

The agent of a call is the LangGraph node that issued it (``langgraph_node`` in the run metadata,
namespaced ``"outer|inner"`` inside subgraphs), mapped through ``node_roles``. The model talks to a
`Team` / any `ChatEngine` in-process, or to an OpenAI-compatible server (``marft-lg serve`` or
vLLM) through `OpenAIEngineClient`. Token ids, log-probs and the adapter version the engine
returned ride along in ``AIMessage.response_metadata["marft"]`` so the tracer records exactly them.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.exceptions import OutputParserException
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableLambda
from langchain_core.runnables.config import var_child_runnable_config
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from pydantic import ConfigDict, Field, PrivateAttr

from marft_lg.constraints import constraint_for
from marft_lg.graph import routing
from marft_lg.graph.scope import route_of
from marft_lg.graph.token_stream import astream_text, stream_text
from marft_lg.serving.types import ChatRequest, Completion
from marft_lg.tool_calls import (
    add_system_text,
    choice_name,
    parse_completion,
    render_messages,
    tool_names,
    tools_active,
)
from marft_lg.tracing.attributes import RESPONSE_METADATA_KEY, agent_from_namespace, resolve_role
from marft_lg.tracing.llm_output import UNRESOLVED_MODEL
from marft_lg.tracing.messages import content_text, message_to_dict

logger = logging.getLogger("marft_lg.graph")


def _may_stream(handler: Any) -> bool:
    """Whether `handler` could be a LangChain streaming handler (has a ``tap_output_*`` method)."""
    return getattr(handler, "tap_output_iter", None) is not None or getattr(handler, "tap_output_aiter", None) is not None


class _CallCounter:
    """0, 1, 2, ... per key (a LangGraph task's checkpoint namespace); remembers the last `limit` keys."""

    def __init__(self, limit: int = 4096):
        self.limit = limit
        self._counts: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def next(self, key: str) -> int:
        with self._lock:
            index = self._counts.pop(key, 0)
            self._counts[key] = index + 1
            if len(self._counts) > self.limit:
                self._counts.popitem(last=False)
            return index


class UnmappedNodeError(ValueError):
    """A call came from a node that has no agent role while ``unmapped="error"``."""


class TeamChatModel(BaseChatModel):
    """Chat model over a Team (in-process) or an OpenAI-compatible server, routed per LangGraph node.

    Parameters: `team` (a `ChatEngine`) or `base_url` (+ `api_key`); `node_roles` ``{node: role}``
    (a node not in the table whose name is an engine agent uses that agent); `unmapped`: what calls
    from nodes without a role do: ``"base"`` (base model, adapters off) or ``"error"``; `versions`
    pins ``{role: ref}`` (or one alias for all roles); sampling defaults. Seeds: each call gets
    ``derive_seed(episode seed, node place, call index)`` where the episode seed is the wrapped
    invocation's `seed`, else this model's `seed`; so a seeded run is reproducible, wrapped or not.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    team: Any = Field(default=None, exclude=True)
    base_url: str | None = None
    api_key: str | None = Field(default=None, repr=False)
    node_roles: dict[str, str] | None = None
    unmapped: Literal["base", "error"] = "base"
    versions: dict[str, str] | str | None = None
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] | None = None
    seed: int | None = None
    model_name: str | None = None

    _client: Any = PrivateAttr(default=None)
    _calls: _CallCounter = PrivateAttr(default_factory=lambda: _CallCounter())
    _warned: set = PrivateAttr(default_factory=set)

    def _next_call_index(self, task_ns: str) -> int:
        """Call index within one LangGraph task when no wrapped episode tracks it."""
        # Read from pydantic's private dict: `self._calls` goes through BaseModel.__getattr__ (~6 µs a lookup).
        return self.__pydantic_private__["_calls"].next(task_ns)

    # -- identity ------------------------------------------------------------------------------
    @property
    def _llm_type(self) -> str:
        return "marft-team"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self._model_label(None), "base_url": self.base_url, "temperature": self.temperature,
                "top_p": self.top_p, "max_tokens": self.max_tokens}

    def _model_label(self, engine: Any) -> str:
        if self.model_name:
            return self.model_name
        engine = engine or self.team
        return str(getattr(engine, "model_name", None) or self.base_url or UNRESOLVED_MODEL)

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> dict[str, Any]:
        params: dict[str, Any] = {
            "ls_provider": "marft_lg",
            "ls_model_name": self._model_label(None),
            "ls_model_type": "chat",
            "ls_temperature": kwargs.get("temperature", self.temperature),
            "ls_max_tokens": kwargs.get("max_tokens", self.max_tokens),
        }
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    def _should_stream(self, *, async_api: bool, run_manager: Any = None, **kwargs: Any) -> bool:
        """LangChain's decision, minus its runtime-`Protocol` check for handlers that cannot stream.

        Before Python 3.12, ``isinstance(handler, _StreamingCallbackHandler)`` costs ~20 µs per handler
        and call (the tracer's handler is attached to every call); a handler without the protocol's
        ``tap_output_iter`` / ``tap_output_aiter`` can never pass it, so it is not asked.
        """
        if run_manager is not None and not any(_may_stream(h) for h in run_manager.handlers):
            run_manager = None
        return super()._should_stream(async_api=async_api, run_manager=run_manager, **kwargs)

    # -- routing -------------------------------------------------------------------------------
    def _engine(self, route: routing.EpisodeRoute | None) -> Any:
        engine = self._plain_engine(route)
        if route is not None and route.replay is not None:
            from marft_lg.serving.replay import ReplayEngine

            return ReplayEngine(engine, route.replay, route.replay_engine)
        return engine

    def _plain_engine(self, route: routing.EpisodeRoute | None) -> Any:
        if route is not None and route.engine_override is not None:
            return route.engine_override
        if route is not None and route.team is not None:
            return route.team
        if self.team is not None:
            return self.team
        if self.base_url:
            private = self.__pydantic_private__
            if private["_client"] is None:
                from marft_lg.graph.remote import RemoteEngine

                private["_client"] = RemoteEngine(self.base_url, api_key=self.api_key)
            return private["_client"]
        raise ValueError(
            "TeamChatModel has no engine: pass team=Team(...) or base_url='http://127.0.0.1:8000/v1', "
            "or run the graph through marft_lg.wrap(graph, team=...)"
        )

    def _resolve_agent(self, engine: Any, route: routing.EpisodeRoute | None, md: dict[str, Any]) -> tuple[str | None, str | None]:
        """(role of the action, engine agent that answers or None for the base model)."""
        node = md.get("langgraph_node")
        path = agent_from_namespace(md.get("langgraph_checkpoint_ns"), node) if node is not None else None
        table = {**(self.node_roles or {}), **((route.node_roles if route else None) or {})}
        try:
            known = list(engine.agents())
        except Exception:  # noqa: BLE001 - an engine that cannot list agents accepts any
            known = None
        if path is not None:
            role = resolve_role(path, table, md.get("lc_agent_name"), known)
            mapped = path in table or path.rsplit("|", 1)[-1] in table
            if mapped and known is not None and role not in known:
                raise UnmappedNodeError(
                    f"node_roles maps node {path!r} to role {role!r}, but the engine serves only {known}; "
                    "fix node_roles or add the role to the Team"
                )
            if role is not None:
                return role, role
        if self.unmapped == "error":
            where = f"node {path!r}" if path else "a call made outside any LangGraph node"
            raise UnmappedNodeError(
                f"{where} has no agent role (node_roles={table or {}}, engine agents={known}); map it with "
                "node_roles={node: role} or use unmapped='base' to answer with the base model"
            )
        self._warn_base_fallback(path, known)
        return path, None

    def _warn_base_fallback(self, path: str | None, known: list[str] | None) -> None:
        """One warning per node whose calls fall back to the base model, naming the fix."""
        warned = self.__pydantic_private__["_warned"]
        if path in warned:
            return
        warned.add(path)
        where = f"node {path!r}" if path else "calls made outside any LangGraph node"
        logger.warning(
            "marft_lg: %s has no agent role, so its calls are answered by the base model with no adapter "
            "(engine agents: %s). Map it with node_roles={%r: '<role>'} in wrap(...) or TeamChatModel(...), "
            "or the `node_roles` key of the config that builds the app.", where, known, path or "<node>")

    def _request(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None,
        run_manager: CallbackManagerForLLMRun | AsyncCallbackManagerForLLMRun | None,
        kwargs: dict[str, Any],
    ) -> tuple[Any, ChatRequest, dict[str, Any]]:
        if run_manager is not None:
            md = dict(run_manager.metadata or {})
        else:  # LangChain's implicit streaming path calls _stream without a run manager
            md = dict((var_child_runnable_config.get() or {}).get("metadata") or {})
        route = route_of(run_manager)
        engine = self._engine(route)
        role, agent = self._resolve_agent(engine, route, md)
        version = None
        if agent is not None:
            version = route.version_for(agent) if route is not None and route.versions is not None else None
            version = version or routing.pinned_version(self.versions, agent)
        ns = md.get("langgraph_checkpoint_ns") or ""
        if route is not None:
            call_index = route.next_call_index(ns)
        elif ns:
            call_index = self._next_call_index(ns)
        else:
            call_index = 0
        seed = kwargs.get("seed")
        episode_seed = route.seed if route is not None and route.seed is not None else self.seed
        if seed is None and episode_seed is not None:
            place = f"{agent_from_namespace(ns, md.get('langgraph_node'))}|{md.get('langgraph_step')}|{md.get('langgraph_path')}"
            seed = routing.derive_seed(episode_seed, place, call_index)
        chat = self._chat_messages(messages, kwargs)
        request = ChatRequest(
            messages=chat,
            agent=agent,
            version=version,
            max_tokens=int(kwargs.get("max_tokens", self.max_tokens)),
            temperature=float(kwargs.get("temperature", self.temperature)),
            top_p=float(kwargs.get("top_p", self.top_p)),
            stop=stop or kwargs.get("stop") or self.stop,
            seed=seed,
            constraint=constraint_for(kwargs.get("tools"), kwargs.get("tool_choice"), kwargs.get("parallel_tool_calls"),
                                      kwargs.get("response_format")),
        )
        info = {"role": role, "call_index": call_index, "tools": kwargs.get("tools"),
                "response_format": kwargs.get("response_format"), "engine": engine, "constraint": request.constraint}
        return engine, request, info

    @staticmethod
    def _chat_messages(messages: Sequence[BaseMessage], kwargs: dict[str, Any]) -> list[dict[str, Any]]:
        """LangChain messages -> the engine's chat messages, in the prompt format `marft-lg serve` uses too.

        Tool calls and tool results are rendered by `marft_lg.tool_calls.render_messages`
        (the bound tools' instruction included), so the same conversation gives the same prompt
        in-process and through the server's OpenAI ``tools`` field.
        """
        chat = render_messages([message_to_dict(m) for m in messages], kwargs.get("tools"),
                               kwargs.get("tool_choice"), kwargs.get("parallel_tool_calls"))
        fmt = kwargs.get("response_format")
        if fmt:
            schema = fmt.get("schema") if isinstance(fmt, dict) else None
            add_system_text(chat, "Answer with one JSON object only, no other text"
                            + (f", matching this JSON schema: {json.dumps(schema, ensure_ascii=False)}" if schema else "."))
        return chat

    def _message(self, completion: Completion, info: dict[str, Any], chunk: bool = False) -> AIMessage:
        tools = info.get("tools") or []
        parsed = parse_completion(completion.text, tool_names(tools)) if tools_active(tools) else None
        valid, invalid = (parsed.tool_calls, parsed.invalid_tool_calls) if parsed else ([], [])
        meta = {
            "prompt_token_ids": list(completion.prompt_token_ids),
            "completion_token_ids": list(completion.completion_token_ids),
            "logprobs": _behaviour_logprobs(completion, info.get("constraint")),
            "adapter_version": completion.adapter_version,
            "agent": completion.agent,
            "role": info.get("role"),
            "model": completion.model or self._model_label(info.get("engine")),
            "seed": info.get("seed"),
            "call_index": info.get("call_index"),
            "latency_s": completion.latency_s,
            "finish_reason": completion.finish_reason,
        }
        if info.get("constraint"):
            meta["constraint"] = info["constraint"]
        if invalid:
            meta["tool_call_errors"] = [tc["error"] for tc in invalid]
        response_metadata = {
            RESPONSE_METADATA_KEY: meta,
            "model_name": meta["model"],
            "finish_reason": completion.finish_reason,
            "model_provider": "marft_lg",
        }
        usage = {"input_tokens": completion.input_tokens, "output_tokens": completion.output_tokens,
                 "total_tokens": completion.input_tokens + completion.output_tokens}
        if chunk:
            chunks = [
                {"name": tc["name"], "args": json.dumps(tc["args"]), "id": tc["id"], "index": i, "type": "tool_call_chunk"}
                for i, tc in enumerate(valid)
            ]
            chunks += [
                {"name": tc["name"], "args": tc["args"], "id": tc["id"], "index": len(valid) + i, "type": "tool_call_chunk"}
                for i, tc in enumerate(invalid)
            ]
            return AIMessageChunk(content=completion.text, response_metadata=response_metadata,
                                  usage_metadata=usage, tool_call_chunks=chunks)
        return AIMessage(content=completion.text, response_metadata=response_metadata, usage_metadata=usage,
                         tool_calls=valid, invalid_tool_calls=invalid)

    # -- generation ------------------------------------------------------------------------------
    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        engine, request, info = self._request(messages, stop, run_manager, kwargs)
        info["seed"] = request.seed
        completion = engine.chat([request])[0]
        return ChatResult(generations=[ChatGeneration(message=self._message(completion, info))])

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        engine, request, info = self._request(messages, stop, run_manager, kwargs)
        info["seed"] = request.seed
        completion = (await engine.achat([request]))[0]
        return ChatResult(generations=[ChatGeneration(message=self._message(completion, info))])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        """Text chunks as the engine decodes them (`token_stream`), then one chunk with the metadata (token ids,
        log-probs, tool calls) and the rest of the text."""
        engine, request, info = self._request(messages, stop, run_manager, kwargs)
        info["seed"] = request.seed
        for piece in stream_text(engine, request):
            yield self._chunk(piece, info)

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        engine, request, info = self._request(messages, stop, run_manager, kwargs)
        info["seed"] = request.seed
        async for piece in astream_text(engine, request):
            yield self._chunk(piece, info)

    def _chunk(self, piece: str | Completion, info: dict[str, Any]) -> ChatGenerationChunk:
        """A streamed text piece, or the closing chunk of the finished completion (its text already streamed)."""
        if isinstance(piece, str):
            info["streamed"] = True
            return ChatGenerationChunk(message=AIMessageChunk(content=piece))
        message = self._message(piece, info, chunk=True)
        return ChatGenerationChunk(message=message.model_copy(update={"content": ""}) if info.get("streamed") else message)

    # -- tools and structured output --------------------------------------------------------
    def bind_tools(self, tools: Sequence[dict[str, Any] | type | Callable | BaseTool], *,
                   tool_choice: str | None = None, **kwargs: Any) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools; the model is shown their schemas, an example call each and the ``<tool_call>``
        format (`marft_lg.tool_calls`, the format `marft-lg serve` uses for OpenAI ``tools``).

        `tool_choice`: None/"auto", "any"/"required", a tool name (or OpenAI's ``{"type": "function",
        "function": {"name": ...}}``), or "none" (the tools are not shown and answers are not parsed);
        ``parallel_tool_calls=False`` asks for at most one call per answer. A forced choice ("any" or a name)
        is decoded under a grammar (`marft_lg.constraints`): the answer is always a well-formed call.
        """
        formatted = [convert_to_openai_tool(t) for t in tools]
        if isinstance(tool_choice, dict):
            tool_choice = choice_name(tool_choice)
        if tool_choice is True:
            tool_choice = "any"
        if tool_choice == "none":  # no instruction and no parsing: as if no tools were bound
            return super().bind(tool_choice="none", **kwargs)
        return super().bind(tools=formatted, tool_choice=tool_choice, **kwargs)

    def with_structured_output(self, schema: dict[str, Any] | type, *, include_raw: bool = False,
                               method: Literal["json_schema", "json_mode", "function_calling"] = "json_schema",
                               **kwargs: Any) -> Runnable[LanguageModelInput, Any]:
        """Answers parsed into `schema` (pydantic class, TypedDict or JSON schema).

        ``json_schema`` (default) decodes one JSON object under the schema's grammar and parses it;
        ``json_mode`` any JSON object; ``function_calling`` uses `bind_tools` with a forced tool call.
        A parse failure raises `OutputParserException` (or is returned under ``parsing_error``
        with ``include_raw=True``).
        """
        if method == "function_calling":
            return super().with_structured_output(schema, include_raw=include_raw, **kwargs)
        json_schema = convert_to_json_schema(schema) if method == "json_schema" else None
        llm = self.bind(response_format={"type": method, "schema": json_schema},
                        ls_structured_output_format={"kwargs": {"method": method}, "schema": json_schema})
        is_pydantic = isinstance(schema, type) and hasattr(schema, "model_validate")

        def parse(message: BaseMessage) -> Any:
            text = content_text(message.content)
            data = extract_json(text)
            if not is_pydantic:
                return data
            try:
                return schema.model_validate(data)
            except ValueError as exc:
                raise OutputParserException(
                    f"the model's JSON does not match {schema.__name__}: {exc}", llm_output=text
                ) from exc

        if not include_raw:
            return llm | RunnableLambda(parse, name="parse_structured_output")

        def parse_with_raw(message: BaseMessage) -> dict[str, Any]:
            try:
                return {"raw": message, "parsed": parse(message), "parsing_error": None}
            except Exception as exc:  # noqa: BLE001 - handed back to the caller, as LangChain does
                return {"raw": message, "parsed": None, "parsing_error": exc}

        return llm | RunnableLambda(parse_with_raw, name="parse_structured_output")


def _behaviour_logprobs(completion: Completion, constraint: dict[str, Any] | None) -> list[float] | None:
    """The completion's log-probs as the trainer may use them: under a constraint, only when the engine took them
    under the grammar's mask (vLLM returns raw ones; the trainer then recomputes them under the mask)."""
    if completion.logprobs is None or (constraint and not completion.extra.get("logprobs_masked")):
        return None
    return list(completion.logprobs)


def extract_json(text: str) -> Any:
    """The first JSON object (or array) in `text`; raises `OutputParserException` with the text otherwise."""
    decoder = json.JSONDecoder()
    for i, ch in enumerate(text):
        if ch in "{[":
            try:
                value, _ = decoder.raw_decode(text, i)
                return value
            except json.JSONDecodeError:
                continue
    snippet = text if len(text) < 200 else text[:200] + "..."
    raise OutputParserException(f"no JSON object found in the model's answer: {snippet!r}", llm_output=text)
