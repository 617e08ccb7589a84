"""Span attribute names and compact encodings: the contract between tracing and mining.

GenAI semantic-convention names are used where the convention has one; everything the trainer
needs beyond it lives under ``marft.*``. Token ids and log-probs are stored compactly as base64 of
little-endian int32 / float32 so a 500-token completion costs ~2.7 kB, not ~6 kB of JSON.
"""

from __future__ import annotations

import base64
import json
import sys
from array import array
from binascii import b2a_base64
from collections.abc import Mapping, Sequence
from json.encoder import encode_basestring
from typing import Any

import numpy as np

# --- OpenTelemetry GenAI semantic conventions -------------------------------------------------
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"  # "invoke_workflow" | "invoke_agent" | "chat" | "execute_tool"
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_AGENT_NAME = "gen_ai.agent.name"
GEN_AI_CONVERSATION_ID = "gen_ai.conversation.id"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_SEED = "gen_ai.request.seed"
GEN_AI_REQUEST_STOP_SEQUENCES = "gen_ai.request.stop_sequences"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"  # the server's completion id: both sides record it (a join key)
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_INPUT_MESSAGES = "gen_ai.input.messages"  # JSON: [{"role":..., "parts":[{"type":"text","content":...}]}]
GEN_AI_OUTPUT_MESSAGES = "gen_ai.output.messages"
GEN_AI_SYSTEM_INSTRUCTIONS = "gen_ai.system_instructions"
GEN_AI_TOOL_NAME = "gen_ai.tool.name"
GEN_AI_TOOL_CALL_ID = "gen_ai.tool.call.id"
GEN_AI_TOOL_CALL_ARGUMENTS = "gen_ai.tool.call.arguments"
GEN_AI_TOOL_CALL_RESULT = "gen_ai.tool.call.result"
ERROR_TYPE = "error.type"

OP_WORKFLOW = "invoke_workflow"
OP_AGENT = "invoke_agent"
OP_CHAT = "chat"
OP_TOOL = "execute_tool"

# --- marft_lg attributes ---------------------------------------------------------------------
MARFT_EPISODE_ID = "marft.episode.id"
MARFT_SCENARIO_ID = "marft.scenario.id"
MARFT_EPISODE_METADATA = "marft.episode.metadata"  # JSON object
REPLAY_OF = "replay_of"  # episode metadata key of a counterfactual replay: the episode it re-ran (never mined)
MIRROR_OF = "mirror_of"  # episode metadata key of a shadow (mirrored) run: the live episode it mirrors
MARFT_AGENT_ROLE = "marft.agent.role"
MARFT_AGENT_NODE = "marft.agent.node"  # namespaced node, e.g. "research|researcher"
MARFT_LANGGRAPH_STEP = "marft.langgraph.step"
MARFT_LANGGRAPH_TRIGGERS = "marft.langgraph.triggers"  # JSON list
MARFT_LANGGRAPH_CHECKPOINT_NS = "marft.langgraph.checkpoint_ns"
MARFT_LANGGRAPH_TASK_ID = "marft.langgraph.task_id"
MARFT_ADAPTER_VERSION = "marft.adapter.version"
MARFT_PROMPT_TOKEN_IDS = "marft.prompt.token_ids"  # encode_ints
MARFT_COMPLETION_TOKEN_IDS = "marft.completion.token_ids"  # encode_ints
MARFT_COMPLETION_LOGPROBS = "marft.completion.logprobs"  # encode_floats
MARFT_LATENCY_S = "marft.latency_s"
MARFT_TOOL_CALLS = "marft.tool_calls"  # JSON list of {"name","args","id"} parsed from the completion
MARFT_FEEDBACK_NAME = "marft.feedback.name"
MARFT_FEEDBACK_VALUE = "marft.feedback.value"
MARFT_MIRROR_PAIR_ID = "marft.mirror.pair_id"
MARFT_MIRROR_SIDE = "marft.mirror.side"  # "live" | "shadow"
MARFT_OUTCOME = "marft.outcome"  # JSON: final graph output (opt-out like messages)
FEEDBACK_SPAN_NAME = "marft.feedback"
# Added by graph+tracing (additions only):
MARFT_ADAPTER_NAME = "marft.adapter.name"  # engine agent whose adapter answered; absent/"" = base model
MARFT_CALL_INDEX = "marft.call.index"  # n-th LLM call of this agent task (0-based), part of the seed derivation
MARFT_FEEDBACK_COMMENT = "marft.feedback.comment"
MARFT_FEEDBACK_METADATA = "marft.feedback.metadata"  # JSON object given to record_feedback(metadata=...)
MARFT_FEEDBACK_TIME = "marft.feedback.time"  # ISO-8601 UTC time the feedback was given
# what the feedback is about when the caller has no episode id: a LangGraph thread (and which of its episodes, by
# start: 0 the first, -1 the last), or a trace of the episode
MARFT_FEEDBACK_THREAD_ID = "marft.feedback.thread_id"
MARFT_FEEDBACK_TURN = "marft.feedback.turn"
MARFT_FEEDBACK_TRACE_ID = "marft.feedback.trace_id"
MARFT_EPISODE_SIDE_STATUS = "marft.mirror.shadow_status"  # on shadow roots: "ok" | "error" | "timeout"
# Server spans (serving/served_spans.py): what `marft-lg serve` sampled, joined to the app's LLM span by mining.
MARFT_SERVED = "marft.served"  # true on a span a marft_lg server recorded for a request it answered
MARFT_CHOICE_INDEX = "marft.choice.index"  # which of the request's `n` choices the span records
MARFT_TOOL_CHOICE = "marft.request.tool_choice"  # the request's tool_choice: "auto", "required", a tool name
# JSON (`marft_lg.constraints`): the grammar a completion was decoded under (a forced tool call, a JSON schema); its
# log-probs are then under the masked distribution, and the trainer re-applies the mask
MARFT_CONSTRAINT = "marft.request.constraint"
# AIMessage.response_metadata key under which TeamChatModel puts the engine's Completion fields
# (prompt_token_ids, completion_token_ids, logprobs, adapter_version, agent, model, seed, latency_s).
RESPONSE_METADATA_KEY = "marft"

_INT_PREFIX = "i32:"
_ARRAY_OK = array("i").itemsize == 4 and array("f").itemsize == 4
_BIG_ENDIAN = sys.byteorder == "big"
_FLOAT_PREFIX = "f32:"


def _packed(typecode: str, numpy_dtype: str, values: Sequence[Any]) -> bytes:
    """Little-endian 4-byte packing; `array` for plain lists (several times faster), numpy otherwise."""
    if _ARRAY_OK and type(values) is list:
        try:
            packed = array(typecode, values)
        except (TypeError, OverflowError):
            pass
        else:
            if _BIG_ENDIAN:
                packed.byteswap()
            return packed.tobytes()
    return np.asarray(values, dtype=numpy_dtype).tobytes()


def encode_ints(values: Sequence[int]) -> str:
    """Token ids -> ``"i32:<base64>"``."""
    return _INT_PREFIX + b2a_base64(_packed("i", "<i4", values), newline=False).decode("ascii")


def decode_ints(text: str | Sequence[int] | None) -> list[int] | None:
    """Inverse of `encode_ints`; also accepts a JSON list or a plain list (other emitters)."""
    if text is None:
        return None
    if not isinstance(text, str):
        return [int(v) for v in text]
    if text.startswith(_INT_PREFIX):
        return np.frombuffer(base64.b64decode(text[len(_INT_PREFIX):]), dtype="<i4").astype(int).tolist()
    return [int(v) for v in json.loads(text)]


def encode_floats(values: Sequence[float]) -> str:
    """Log-probs -> ``"f32:<base64>"`` (float32 keeps ~7 significant digits, ample for PPO ratios)."""
    return _FLOAT_PREFIX + b2a_base64(_packed("f", "<f4", values), newline=False).decode("ascii")


def decode_floats(text: str | Sequence[float] | None) -> list[float] | None:
    """Inverse of `encode_floats`; also accepts a JSON list or a plain list."""
    if text is None:
        return None
    if not isinstance(text, str):
        return [float(v) for v in text]
    if text.startswith(_FLOAT_PREFIX):
        return np.frombuffer(base64.b64decode(text[len(_FLOAT_PREFIX):]), dtype="<f4").astype(float).tolist()
    return [float(v) for v in json.loads(text)]


def to_genai_messages(messages: Sequence[dict[str, Any]]) -> str:
    """Chat messages (``{"role","content"}``) -> GenAI semconv JSON (role + parts)."""
    fast = _text_messages_json(messages)
    if fast is not None:
        return fast
    out = []
    for m in messages:
        parts: list[dict[str, Any]] = []
        if m.get("content"):
            parts.append({"type": "text", "content": m["content"]})
        for tc in m.get("tool_calls") or []:
            parts.append({"type": "tool_call", "id": tc.get("id"), "name": tc.get("name"), "arguments": tc.get("args")})
        if m.get("role") == "tool":
            parts = [{"type": "tool_call_response", "id": m.get("tool_call_id"), "response": m.get("content")}]
        out.append({"role": m.get("role", "user"), "parts": parts})
    return json.dumps(out, ensure_ascii=False)


def _text_messages_json(messages: Sequence[dict[str, Any]]) -> str | None:
    """`to_genai_messages` for plain text messages, built as text (the same bytes as `json.dumps`); None otherwise."""
    items = []
    for m in messages:
        role = m.get("role", "user")
        content = m.get("content")
        if type(role) is not str or role == "tool" or m.get("tool_calls") or not (content is None or type(content) is str):
            return None
        part = '{"type": "text", "content": ' + encode_basestring(content) + "}" if content else ""
        items.append('{"role": ' + encode_basestring(role) + ', "parts": [' + part + "]}")
    return "[" + ", ".join(items) + "]"


def from_genai_messages(text: str | list) -> list[dict[str, Any]]:
    """GenAI semconv JSON -> chat messages (``{"role","content"}`` plus tool calls)."""
    data = json.loads(text) if isinstance(text, str) else text
    out = []
    for m in data:
        content_parts, tool_calls, msg = [], [], {"role": m.get("role", "user")}
        for p in m.get("parts") or []:
            kind = p.get("type")
            if kind == "text":
                content_parts.append(str(p.get("content", "")))
            elif kind == "tool_call":
                tool_calls.append({"id": p.get("id"), "name": p.get("name"), "args": p.get("arguments")})
            elif kind == "tool_call_response":
                msg["tool_call_id"] = p.get("id")
                content_parts.append(p.get("response") if isinstance(p.get("response"), str) else json.dumps(p.get("response")))
        if "content" in m and not m.get("parts"):
            content_parts.append(str(m["content"]))
        msg["content"] = "".join(content_parts)
        if tool_calls:
            msg["tool_calls"] = tool_calls
        out.append(msg)
    return out


def resolve_role(node_path: str | None, node_roles: Mapping[str, str] | None, agent_name: str | None = None,
                 known: Sequence[str] | None = None) -> str | None:
    """The role of a call made in `node_path` (``outer|inner``): `node_roles` of the namespaced path, then of its
    bare node name; else the first of the agent the call runs in (LangChain's ``lc_agent_name``), the path and the
    bare name that is a role (`known`: the roles an engine serves; None: any). The one rule for the recorder and
    `TeamChatModel`'s routing; None when nothing names a role."""
    if node_path is None:
        return agent_name if agent_name and (known is None or agent_name in known) else None
    bare = node_path.rsplit("|", 1)[-1]
    if node_roles:
        if node_path in node_roles:
            return node_roles[node_path]
        if bare in node_roles:
            return node_roles[bare]
    for candidate in (agent_name, node_path, bare):
        if candidate and (known is None or candidate in known):
            return candidate
    return None


def agent_from_namespace(checkpoint_ns: str | None, node: str | None) -> str | None:
    """The agent a LangGraph call runs as: inside a subgraph, the namespace's node names joined
    (``"research:<task>|writer:<task>"`` -> ``"research|writer"``); at the top level, the node itself. The one rule
    for the recorder, the chat model's routing and every trace format."""
    if checkpoint_ns and "|" in checkpoint_ns:
        return "|".join(seg.split(":", 1)[0] for seg in checkpoint_ns.split("|") if seg)
    return node
