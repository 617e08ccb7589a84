"""What the server sampled, as spans: the record mining trusts over anything a client kept.

For every chat request `marft-lg serve` answers, one span per choice (``chat <model>``, kind SERVER) holds the
prompt token ids the server rendered (tool definitions and tool-call turns included), the completion's token ids
and log-probs, the adapter version that answered, the tool calls parsed from the completion (unknown tools,
malformed calls and arguments that break the tool's schema with their error), the request's messages and
sampling. A request carrying W3C trace context (a wrapped app's calls do: `tracing.propagation`) gets a span that
is a child of the app's LLM span, and its baggage gives the episode id; mining merges the two
(`trajectories.assembly`). Without trace context the span is the root of a trace of its own, and still an action.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from marft_lg.constraints import constraint_key
from marft_lg.serving.types import ChatRequest, Completion
from marft_lg.tool_calls import call_name_args, choice_name, parse_completion, text_of
from marft_lg.tracing import attributes as A
from marft_lg.tracing import propagation
from marft_lg.tracing.records import KIND_SERVER, STATUS_OK, SpanRecord, new_trace_id


@dataclass(frozen=True)
class CallContext:
    """The caller's trace context and baggage on one request: the app span to hang under, the episode, the
    episode's version pins and the call's seed (used when the request's own fields say nothing)."""

    parent: tuple[int, int] | None = None
    episode_id: str | None = None
    versions: Mapping[str, str] | str | None = None
    seed: int | None = None

    @classmethod
    def from_headers(cls, headers: Mapping[str, str]) -> CallContext:
        """Read ``traceparent`` and ``baggage`` (whose ``marft.parent``, the wrapped app's span, wins over a
        ``traceparent`` the app's own instrumentation sent); anything malformed is ignored."""
        baggage = propagation.parse_baggage(headers.get(propagation.BAGGAGE))
        seed = baggage.get(propagation.SEED_KEY, "")
        parent = (propagation.parse_traceparent(baggage.get(propagation.PARENT_KEY))
                  or propagation.parse_traceparent(headers.get(propagation.TRACEPARENT)))
        return cls(parent=parent,
                   episode_id=baggage.get(propagation.EPISODE_KEY) or None,
                   versions=propagation.decode_versions(baggage.get(propagation.VERSIONS_KEY)),
                   seed=int(seed) if seed.lstrip("-").isdigit() and abs(int(seed)) < 2**62 else None)

    def version_for(self, role: str | None) -> str | None:
        """The version this episode pins for `role` (an alias pins every role)."""
        if role is None or not self.versions:
            return None
        return self.versions if isinstance(self.versions, str) else self.versions.get(role)


class ServedRecorder:
    """Turns answered requests into server spans and hands them to a `RecordSink` (a file of its own for
    `marft-lg serve`; the wrapped app's sink for the loopback server of an on-policy or comparison run)."""

    def __init__(self, sink: Any, *, capture_messages: bool = True, owns_sink: bool = False):
        self.sink = sink
        self.capture_messages = capture_messages
        self._owns_sink = owns_sink

    def record(self, ctx: CallContext, messages: Sequence[Any], opts: Mapping[str, Any],
               requests: Sequence[ChatRequest], completions: Sequence[Completion], response_id: str,
               start_ns: int) -> None:
        """One span per choice; never raises (a record that cannot be made must not fail the answer)."""
        trace_id, parent_id = ctx.parent if ctx.parent else (new_trace_id(), 0)
        prompt = _genai_input(messages) if self.capture_messages else None
        for index, (request, completion) in enumerate(zip(requests, completions, strict=True)):
            span = SpanRecord(trace_id, parent_id, f"{A.OP_CHAT} {opts.get('model')}", KIND_SERVER,
                              self._attributes(ctx, opts, request, completion, response_id, index, prompt))
            span.start_ns = start_ns
            span.set_status(STATUS_OK)
            span.end_ns = time.time_ns()
            self.sink.submit(span)

    def _attributes(self, ctx: CallContext, opts: Mapping[str, Any], request: ChatRequest, c: Completion,
                    response_id: str, index: int, prompt: str | None) -> dict[str, Any]:
        attrs: dict[str, Any] = {
            A.GEN_AI_OPERATION_NAME: A.OP_CHAT, A.GEN_AI_PROVIDER_NAME: "marft_lg", A.MARFT_SERVED: True,
            A.GEN_AI_REQUEST_MODEL: str(opts.get("model")), A.GEN_AI_RESPONSE_MODEL: c.model,
            A.GEN_AI_RESPONSE_ID: response_id, A.MARFT_CHOICE_INDEX: index,
            A.MARFT_ADAPTER_NAME: c.agent or "",
            A.MARFT_PROMPT_TOKEN_IDS: A.encode_ints(c.prompt_token_ids),
            A.MARFT_COMPLETION_TOKEN_IDS: A.encode_ints(c.completion_token_ids),
            A.GEN_AI_RESPONSE_FINISH_REASONS: [c.finish_reason],
            A.GEN_AI_USAGE_INPUT_TOKENS: c.input_tokens, A.GEN_AI_USAGE_OUTPUT_TOKENS: c.output_tokens,
            A.GEN_AI_REQUEST_TEMPERATURE: request.temperature, A.GEN_AI_REQUEST_TOP_P: request.top_p,
            A.GEN_AI_REQUEST_MAX_TOKENS: request.max_tokens, A.MARFT_LATENCY_S: c.latency_s,
        }
        if c.agent is not None:
            attrs[A.MARFT_AGENT_ROLE] = c.agent
        if c.adapter_version is not None:
            attrs[A.MARFT_ADAPTER_VERSION] = c.adapter_version
        if ctx.episode_id:
            attrs[A.MARFT_EPISODE_ID] = ctx.episode_id
        if request.seed is not None:
            attrs[A.GEN_AI_REQUEST_SEED] = int(request.seed)
        constraint = opts.get("constraint")
        if constraint:
            attrs[A.MARFT_CONSTRAINT] = constraint_key(constraint)
        if not constraint or c.extra.get("logprobs_masked"):  # raw log-probs of a constrained row: the trainer
            attrs[A.MARFT_COMPLETION_LOGPROBS] = A.encode_floats(c.logprobs)  # recomputes them under the mask
        choice = opts.get("tool_choice")
        if opts.get("tool_names") is not None and choice is not None:
            attrs[A.MARFT_TOOL_CHOICE] = choice if isinstance(choice, str) else (choice_name(choice) or "")
        calls = tool_calls_of(c.text, opts)
        if calls:
            attrs[A.MARFT_TOOL_CALLS] = json.dumps(calls, ensure_ascii=False, default=str)
        if prompt is not None:
            attrs[A.GEN_AI_INPUT_MESSAGES] = prompt
            out: dict[str, Any] = {"role": "assistant", "content": c.text}
            valid = [tc for tc in calls if not tc.get("error")]
            if valid:
                out["tool_calls"] = valid
            attrs[A.GEN_AI_OUTPUT_MESSAGES] = A.to_genai_messages([out])
        return attrs

    def close(self) -> None:
        if self._owns_sink:
            self.sink.shutdown()


def tool_calls_of(text: str, opts: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The completion's tool calls as the response reported them, each invalid one with its ``error``; a valid call
    whose arguments break its tool's JSON schema gets an ``error`` here too (the app may still have run it)."""
    names = opts.get("tool_names")
    if names is None:
        return []
    parsed = parse_completion(text, names, parallel_tool_calls=opts.get("parallel_tool_calls"))
    schemas = {t["function"]["name"]: t["function"].get("parameters") for t in opts.get("tools") or ()}
    calls = []
    for tc in parsed.tool_calls:
        error = schema_error(tc["args"], schemas.get(tc["name"]))
        calls.append({"id": tc["id"], "name": tc["name"], "args": tc["args"], "error": error})
    calls += [{"id": tc["id"], "name": tc["name"], "args": tc["args"], "error": tc["error"]}
              for tc in parsed.invalid_tool_calls]
    return calls


def schema_error(args: Any, schema: Any) -> str | None:
    """Why `args` break the tool's JSON schema (its first problem), or None (also for a schema that is not one)."""
    if not isinstance(schema, dict) or not schema:
        return None
    try:
        from jsonschema import Draft202012Validator
        from jsonschema.exceptions import SchemaError

        validator = Draft202012Validator(schema)
        error = next(iter(validator.iter_errors(args)), None)
    except (SchemaError, TypeError, ValueError, RecursionError):
        return None
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path)
    return f"arguments do not match the tool's schema{f' at {where}' if where else ''}: {error.message}"[:500]


def _genai_input(messages: Sequence[Any]) -> str:
    """OpenAI chat messages (as the request sent them) -> GenAI semconv JSON, tool calls and results included."""
    out = []
    for m in messages:
        if not isinstance(m, dict):
            continue
        msg: dict[str, Any] = {"role": str(m.get("role") or "user"), "content": text_of(m.get("content"))}
        calls = []
        for tc in m.get("tool_calls") or ():
            if isinstance(tc, dict):
                name, args = call_name_args(tc)
                calls.append({"id": tc.get("id"), "name": name, "args": args})
        if calls:
            msg["tool_calls"] = calls
        if m.get("tool_call_id") is not None:
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return A.to_genai_messages(out)
