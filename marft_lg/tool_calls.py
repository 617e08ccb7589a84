"""The text format in which a served model calls tools: the prompt that teaches it, and its tolerant parser.

One module for both sides of marft_lg: `marft-lg serve` (OpenAI ``tools`` / ``tool_choice`` in,
``message.tool_calls`` out) and `TeamChatModel` (LangChain ``bind_tools``) render the same prompt
and parse completions with the same code, so a model trained through one behaves the same through
the other.

The model is told to answer with blocks (Hermes/Qwen/SmolLM style)::

    <tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>

The instruction lists each tool's JSON schema with a concrete example call built from that schema
(`example_call`), never a placeholder such as ``{...}`` that a small model would copy verbatim.
Earlier turns are rendered in the same format: an assistant message's ``tool_calls`` become blocks
appended to its text, tool results stay ``{"role": "tool", "content", "tool_call_id"}`` turns
(`render_messages`).

Well-formed blocks naming a bound tool become LangChain ``tool_calls``; anything else (bad JSON,
no name, unknown tool, a block cut off by max_tokens) becomes an ``invalid_tool_calls`` entry whose
``error`` says what was wrong and what the format is, so the graph can show it to the model instead
of crashing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FORMAT_HINT = f'{OPEN}{{"name": "<tool name>", "arguments": <JSON object of arguments, {{}} when none>}}{CLOSE}'
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)
_FENCE = re.compile(r"^```(?:json)?\s*|\s*```$")
_SCALAR_EXAMPLES = {"string": "...", "integer": 1, "number": 1.0, "boolean": True}
REQUIRED_CHOICES = ("required", "any")  # "any" is LangChain's word for OpenAI's "required"


# ---- tools and tool_choice -------------------------------------------------------------------
def tool_function(tool: dict[str, Any]) -> dict[str, Any]:
    """The function part of an OpenAI tool (``{"type": "function", "function": {...}}``) or a bare function."""
    fn = tool.get("function", tool) if isinstance(tool, dict) else None
    return fn if isinstance(fn, dict) else {}


def tool_names(tools: Sequence[dict[str, Any]] | None) -> list[str]:
    return [str(tool_function(t).get("name")) for t in tools or []]


def choice_name(tool_choice: Any) -> str | None:
    """A forced tool's name: ``"add"``, ``{"type": "function", "function": {"name": "add"}}`` or ``{"name": "add"}``."""
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else tool_choice.get("name")
        return name if isinstance(name, str) and name else None
    if isinstance(tool_choice, str) and tool_choice not in ("auto", "none", *REQUIRED_CHOICES):
        return tool_choice
    return None


def tools_active(tools: Sequence[dict[str, Any]] | None, tool_choice: Any = None) -> bool:
    """Whether the model is told about tools and its completion parsed for calls (not with ``tool_choice="none"``)."""
    return bool(tools) and tool_choice != "none"


# ---- example calls from JSON schemas ------------------------------------------------------------
def _resolve(schema: Any, root: dict[str, Any] | None) -> Any:
    ref = schema.get("$ref") if isinstance(schema, dict) else None
    if isinstance(ref, str) and ref.startswith("#/") and root is not None:
        node: Any = root
        for part in ref[2:].split("/"):
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            return node
    return schema


def example_value(schema: Any, root: dict[str, Any] | None = None) -> Any:
    """A value of the type a JSON schema asks for: string -> "...", integer -> 1, number -> 1.0,
    boolean -> true, array -> [], object -> {}, enum -> its first value (``const`` -> itself)."""
    schema = _resolve(schema, root)
    if not isinstance(schema, dict):
        return "..."
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    if "const" in schema:
        return schema["const"]
    for key in ("anyOf", "oneOf", "allOf"):
        options = [o for o in schema.get(key) or [] if _resolve(o, root) != {"type": "null"}]
        if options:
            return example_value(options[0], root)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if kind in _SCALAR_EXAMPLES:
        return _SCALAR_EXAMPLES[kind]
    if kind == "array":
        return []
    if kind == "object" or "properties" in schema:
        return {}
    return "..."


def example_arguments(parameters: Any) -> dict[str, Any]:
    """Example arguments for a function's ``parameters`` schema: its required properties only."""
    if not isinstance(parameters, dict):
        return {}
    props = parameters.get("properties") if isinstance(parameters.get("properties"), dict) else {}
    required = parameters.get("required")
    required = [r for r in required if isinstance(r, str)] if isinstance(required, list) else []
    return {name: example_value(props.get(name), parameters) for name in required}


def example_call(tool: dict[str, Any]) -> str:
    """A concrete, valid call of `tool` in the block format, e.g. for ``add(a: int, b: int)``::

        <tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>
    """
    fn = tool_function(tool)
    return render_tool_call(str(fn.get("name")), example_arguments(fn.get("parameters")))


def tools_instruction(tools: Sequence[dict[str, Any]], tool_choice: Any = None,
                      parallel_tool_calls: bool | None = None) -> str:
    """System-prompt text: each tool's schema (OpenAI function form) with an example call, and the rules."""
    lines = [
        "You can call tools. To call a tool, write a tool_call block as in the examples below: one JSON object "
        'with the tool\'s "name" and its "arguments" (a JSON object, {} when the tool takes none) between the '
        "tool_call tags.",
        "Available tools, each with an example call:",
    ]
    for tool in tools:
        fn = tool_function(tool)
        lines.append(json.dumps({k: fn.get(k) for k in ("name", "description", "parameters")}, ensure_ascii=False))
        lines.append(f"Example: {example_call(tool)}")
    if parallel_tool_calls is False:
        lines.append("Call at most one tool per answer.")
    else:
        lines.append("To call several tools, write one block per call.")
    forced = choice_name(tool_choice)
    if forced is not None:
        lines.append(f"You must call the tool {forced!r}.")
    elif tool_choice in REQUIRED_CHOICES:
        lines.append("You must call at least one tool.")
    return "\n".join(lines)


def tool_choice_instruction(tool_choice: Any) -> str | None:
    """The "you must call" line alone (for chat templates that render the tools themselves)."""
    forced = choice_name(tool_choice)
    if forced is not None:
        return f"You must call the tool {forced!r}."
    return "You must call at least one tool." if tool_choice in REQUIRED_CHOICES else None


# ---- rendering history ------------------------------------------------------------------------------
def render_tool_call(name: str, args: Any) -> str:
    return f"{OPEN}{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}{CLOSE}"


def call_name_args(call: dict[str, Any]) -> tuple[str, Any]:
    """(name, arguments) of a tool call in OpenAI form (``function.arguments`` a JSON string) or LangChain form (``args``)."""
    fn = call.get("function")
    if isinstance(fn, dict):
        name, args = fn.get("name"), fn.get("arguments")
    else:
        name, args = call.get("name"), call.get("args", call.get("arguments"))
    if isinstance(args, str):  # a string that is not JSON is shown to the model as it was
        with contextlib.suppress(json.JSONDecodeError):
            args = json.loads(args) if args.strip() else {}
    return str(name), ({} if args is None else args)


def text_of(content: Any) -> str:
    """Message content (a string, None, or a list of text parts) -> its text."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content if isinstance(content, list) else []:
        if isinstance(part, str):
            parts.append(part)
        elif isinstance(part, dict) and part.get("type") == "text":
            parts.append(str(part.get("text", "")))
    return "".join(parts)


def add_system_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """Append `text` to the leading system message (in place), or insert one."""
    if messages and isinstance(messages[0], dict) and messages[0].get("role") == "system":
        messages[0] = {**messages[0], "content": f"{text_of(messages[0].get('content'))}\n\n{text}".strip()}
    else:
        messages.insert(0, {"role": "system", "content": text})
    return messages


def render_messages(messages: Iterable[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None,
                    tool_choice: Any = None, parallel_tool_calls: bool | None = None) -> list[dict[str, Any]]:
    """Chat messages with tool traffic -> plain ``{"role", "content"}`` messages any chat template renders.

    An assistant message's ``tool_calls`` (OpenAI or LangChain form) become ``<tool_call>`` blocks
    after its text, except calls whose block the text already holds (the model's own raw answer);
    tool results stay ``{"role": "tool", "content", "tool_call_id"}``; ``name`` keys are dropped.
    With active tools (`tools_active`) `tools_instruction` is appended to the system message.
    """
    out: list[dict[str, Any]] = []
    for m in messages:
        if not isinstance(m, dict):
            out.append(m)  # the engine reports it
            continue
        d = dict(m)
        calls = d.pop("tool_calls", None)
        d.pop("name", None)
        if calls:
            text = text_of(d.get("content"))
            shown = [(c["name"], c["args"]) for c in parse_tool_calls(text)[0]] if OPEN in text else []
            blocks = []
            for call in calls:
                name, args = call_name_args(call) if isinstance(call, dict) else (str(call), {})
                if (name, args) in shown:
                    shown.remove((name, args))
                else:
                    blocks.append(render_tool_call(name, args))
            d["content"] = f"{text}\n{chr(10).join(blocks)}".strip() if blocks else text
        elif d.get("role") == "assistant" and d.get("content") is None:
            d["content"] = ""
        out.append(d)
    if tools_active(tools, tool_choice):
        add_system_text(out, tools_instruction(tools or [], tool_choice, parallel_tool_calls))
    return out


def template_supports_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders ``tools`` (transformers ``apply_chat_template(tools=...)``)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    return isinstance(template, str) and re.search(r"\btools\b", template) is not None


def template_messages(messages: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages -> the form transformers chat templates expect: tool-call arguments as objects."""
    out = []
    for m in messages:
        if isinstance(m, dict) and m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                name, args = call_name_args(call) if isinstance(call, dict) else (str(call), {})
                calls.append({"id": call.get("id") if isinstance(call, dict) else None, "type": "function",
                              "function": {"name": name, "arguments": args}})
            m = {**m, "tool_calls": calls, "content": text_of(m.get("content"))}
        out.append(m)
    return out


# ---- parsing ----------------------------------------------------------------------------------------------
def _call_id(index: int, body: str) -> str:
    return f"call_{index}_{hashlib.blake2b(body.encode('utf-8'), digest_size=4).hexdigest()}"


@dataclass
class ParsedCompletion:
    """A completion split into its text and its tool calls (LangChain shapes).

    `content` is the text with the valid blocks cut out (stripped; None when nothing is left, as
    OpenAI does); malformed blocks stay in it verbatim. `spans` are the (start, end) offsets of the
    valid blocks in the completion text.
    """

    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    invalid_tool_calls: list[dict[str, Any]] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)


def parse_completion(text: str, tool_names: Sequence[str] | None = None, *,
                     parallel_tool_calls: bool | None = None) -> ParsedCompletion:
    """Split a completion into text, valid ``tool_calls`` and ``invalid_tool_calls``.

    Ids are derived from the block text, so the same completion always yields the same ids. With
    ``parallel_tool_calls=False`` only the first valid call is made; later ones are reported invalid.
    """
    valid: list[dict[str, Any]] = []
    invalid: list[dict[str, Any]] = []
    spans: list[tuple[int, int]] = []
    for index, match in enumerate(_BLOCK.finditer(text)):
        raw = match.group(0)
        body = _FENCE.sub("", match.group(1).strip())
        call_id = _call_id(index, raw)
        if not raw.endswith(CLOSE):
            invalid.append(_invalid(call_id, None, body, f"tool call #{index + 1} is not closed with {CLOSE}"))
            continue
        try:
            data = json.loads(body)
        except json.JSONDecodeError as exc:
            invalid.append(_invalid(call_id, None, body, f"tool call #{index + 1} is not valid JSON ({exc.msg} at column {exc.colno})"))
            continue
        if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
            invalid.append(_invalid(call_id, None, body, f"tool call #{index + 1} has no \"name\" string"))
            continue
        name = data["name"]
        args = data.get("arguments", data.get("args", data.get("parameters", {})))
        if isinstance(args, str):
            with contextlib.suppress(json.JSONDecodeError):
                args = json.loads(args) if args.strip() else {}
        if args is None:
            args = {}
        if not isinstance(args, dict):
            invalid.append(_invalid(call_id, name, body, f"tool call #{index + 1} ({name}): \"arguments\" must be a JSON object"))
            continue
        if tool_names is not None and name not in tool_names:
            invalid.append(
                _invalid(call_id, name, body, f"tool call #{index + 1} names unknown tool {name!r}; available: {sorted(tool_names)}")
            )
            continue
        if parallel_tool_calls is False and valid:
            invalid.append(_invalid(call_id, name, body, f"tool call #{index + 1} ({name}) is one call too many: "
                                                         "parallel_tool_calls is false, only the first call is made"))
            continue
        valid.append({"name": name, "args": args, "id": call_id, "type": "tool_call"})
        spans.append(match.span())
    content, at = "", 0
    for start, end in [*spans, (len(text), len(text))] if spans else []:
        piece = text[at:start]
        if content.strip() and piece.strip():  # one separator where a block was cut out
            sep = "\n" if "\n" in content[len(content.rstrip()):] + piece[: len(piece) - len(piece.lstrip())] else " "
            content = content.rstrip() + sep + piece.lstrip()
        else:
            content += piece
        at = end
    content = content.strip() if spans else text
    return ParsedCompletion(content=content or None, tool_calls=valid, invalid_tool_calls=invalid, spans=spans)


def parse_tool_calls(
    text: str, tool_names: Sequence[str] | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Split a completion's tool-call blocks into (valid ``tool_calls``, ``invalid_tool_calls``)."""
    parsed = parse_completion(text, tool_names)
    return parsed.tool_calls, parsed.invalid_tool_calls


def _invalid(call_id: str, name: str | None, body: str, reason: str) -> dict[str, Any]:
    return {
        "name": name,
        "args": body,
        "id": call_id,
        "error": f"{reason}. Call tools as {FORMAT_HINT}",
        "type": "invalid_tool_call",
    }


def openai_tool_calls(calls: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """LangChain ``tool_calls`` -> OpenAI ``message.tool_calls`` (arguments as a JSON string)."""
    return [{"id": c["id"], "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["args"], ensure_ascii=False)}} for c in calls]


def openai_invalid_tool_calls(calls: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """LangChain ``invalid_tool_calls`` -> the server's ``message.invalid_tool_calls`` entries."""
    return [{"id": c["id"], "name": c["name"], "args": c["args"], "error": c["error"]} for c in calls]
