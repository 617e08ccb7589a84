"""The one engine that runs every trace format's declared mapping (`Format`): span attributes -> `SpanInfo`.

A format is data: how to recognise its spans, how to tell an LLM call from a tool call, and which attribute keys
fill which `SpanInfo` field with which converter (`Attr`). The engine applies a format to a span in a fixed order:

1. `fields`: read for every span (the graph context: node, step, task, session, ...);
2. `kind`: the span's kind from one attribute and a table (`Kind`), with an optional rule for the irregular cases;
3. `by_kind[kind]`: the fields of that kind (an LLM call's messages and tokens, a tool call's name and result);
4. `refine`: rules that look at the finished span and may change its kind or agent (few formats need one);
5. `final[kind]`: fields read by the span's final kind (after `refine`).

Adding an attribute is one `Attr` in the format's module; adding a format is one `Format` in `formats/__init__.py`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from marft_lg.trajectories.formats.base import OTHER, SpanInfo, base_info

Attrs = Mapping[str, Any]


@dataclass(frozen=True)
class Member:
    """A key inside the format's context document (OpenInference's `metadata` JSON), not a span attribute."""

    name: str


@dataclass(frozen=True)
class SpanName:
    """The span's own name, as a last candidate (`tool.name` or else the span name)."""


SPAN_NAME = SpanName()
Key = str | Member | SpanName


@dataclass(frozen=True)
class Attr:
    """One `SpanInfo` field from the first candidate key that holds a value, converted.

    `pick` says what "holds a value" means, as the emitters' conventions differ:
    - `"or"`: the first truthy value (Python's `a or b`; the last candidate's value when none is);
    - `"present"`: the first key present in the attributes, whatever its value;
    - `"not_none"`: the first candidate that is not None.
    `mode` says how the value lands: `"set"` overwrites; `"fill"` keeps a truthy value set before (an agent named by
    the graph context wins over one named by the call); `"replace"` overwrites only with a value that is not None.
    """

    field: str
    keys: tuple[Key, ...]
    convert: Callable[[Any], Any] | None = None
    pick: Literal["or", "present", "not_none"] = "or"
    mode: Literal["set", "fill", "replace"] = "set"

    def __post_init__(self) -> None:
        if self.field not in SpanInfo.__slots__:
            raise ValueError(f"Attr: SpanInfo has no field {self.field!r}")
        if isinstance(self.keys, str | Member | SpanName):
            object.__setattr__(self, "keys", (self.keys,))


@dataclass(frozen=True)
class Derive:
    """Several `SpanInfo` fields computed together (a message list and its completion): `compute(info, attrs,
    context)` returns their values in order; it may read the fields set before it."""

    fields: tuple[str, ...]
    compute: Callable[[SpanInfo, Attrs, Attrs], tuple[Any, ...]]

    def __post_init__(self) -> None:
        for name in self.fields:
            if name not in SpanInfo.__slots__:
                raise ValueError(f"Derive: SpanInfo has no field {name!r}")


@dataclass(frozen=True)
class Kind:
    """The span kind: `table[value of key]` (after `normalise`), else `default`; `rule(info, attrs, kind)` may
    decide otherwise (a feedback span, a LangGraph node's own span)."""

    key: str
    table: Mapping[str, str]
    normalise: Callable[[Any], Any] | None = None
    default: str = OTHER
    rule: Callable[[SpanInfo, Attrs, str], str] | None = None


Rule = Attr | Derive


@dataclass(frozen=True)
class Format:
    """One trace format, declared: `detect(attrs)` recognises its spans; the engine does the rest (see the module)."""

    name: str
    detect: Callable[[Attrs], bool]
    kind: Kind
    fields: tuple[Rule, ...] = ()
    by_kind: Mapping[str, tuple[Rule, ...]] = field(default_factory=dict)
    refine: tuple[Callable[[SpanInfo, Attrs], None], ...] = ()
    final: Mapping[str, tuple[Rule, ...]] = field(default_factory=dict)
    context: Callable[[Attrs], Attrs] | None = None  # the document `Member` keys read from

    def __post_init__(self) -> None:
        source, namespace = _Compiler(self).compile()
        exec(compile(source, f"<format {self.name}>", "exec"), namespace)  # noqa: S102 - our own generated code
        object.__setattr__(self, "source", source)
        object.__setattr__(self, "interpret", namespace["interpret"])

    source: str = field(init=False, repr=False)
    """The Python function the engine made of this declaration (what runs per span; read it to debug a mapping)."""

    interpret: Callable[[Any], SpanInfo] = field(init=False, repr=False)
    """`interpret(raw_span) -> SpanInfo` under this format."""


_MISSING = object()


class _Compiler:
    """Turns a `Format` into the source of one function: the rules in order, each key a dict look-up, each converter
    a call. Generated rather than interpreted rule by rule, so a declared format reads a span as fast as one written
    out by hand (mining reads ~10^5 spans a second per core)."""

    def __init__(self, fmt: Format):
        self.fmt = fmt
        self.names: dict[int, str] = {}
        self.namespace: dict[str, Any] = {"base_info": base_info, "_MISSING": _MISSING, "NAME": fmt.name}

    def ref(self, value: Any, prefix: str) -> str:
        """A name in the generated code for a constant or a callable of the declaration."""
        name = self.names.get(id(value))
        if name is None:
            name = self.names[id(value)] = f"{prefix}{len(self.names)}"
            self.namespace[name] = value
        return name

    def compile(self) -> tuple[str, dict[str, Any]]:
        fmt, kind = self.fmt, self.fmt.kind
        out = ["def interpret(raw):", "    a = raw.attributes", "    get = a.get", "    info = base_info(raw, NAME)"]
        if fmt.context is not None:
            out.append(f"    ctx = {self.ref(fmt.context, 'context')}(a)")
        out += self.rules(fmt.fields, "    ")
        value = f"get({self.ref(kind.key, 'k')})"
        if kind.normalise is not None:
            value = f"{self.ref(kind.normalise, 'c')}({value})"
        table, default = self.ref(kind.table, "table"), self.ref(kind.default, "k")
        out += ["    try:", f"        kind = {table}.get({value}, {default})",
                "    except TypeError:  # an unhashable value (a list sent as the operation name) names no kind",
                f"        kind = {default}"]
        if kind.rule is not None:
            out.append(f"    kind = {self.ref(kind.rule, 'rule')}(info, a, kind)")
        out.append("    info.kind = kind")
        out += self.branches(fmt.by_kind, "kind")
        for rule in fmt.refine:
            out.append(f"    {self.ref(rule, 'rule')}(info, a)")
        out += self.branches(fmt.final, "info.kind")
        out.append("    return info")
        return "\n".join(out) + "\n", self.namespace

    def branches(self, by_kind: Mapping[str, tuple[Rule, ...]], kind: str) -> list[str]:
        out: list[str] = []
        for value, rules in by_kind.items():
            if rules:
                out.append(f"    {'if' if not out else 'elif'} {kind} == {self.ref(value, 'k')}:")
                out += self.rules(rules, "        ")
        return out

    def rules(self, rules: tuple[Rule, ...], indent: str) -> list[str]:
        out: list[str] = []
        for rule in rules:
            if isinstance(rule, Derive):
                targets = ", ".join(f"info.{name}" for name in rule.fields)
                out.append(f"{indent}{targets}{',' if len(rule.fields) == 1 else ''} = "
                           f"{self.ref(rule.compute, 'derive')}(info, a, {'ctx' if self.fmt.context else 'None'})")
                continue
            lines = self.value(rule)
            target = f"info.{rule.field}"
            if rule.mode == "set" and len(lines) == 1:  # `v = <expression>`: straight into the field
                out.append(f"{indent}{target} = {lines[0][4:]}")
                continue
            out += [indent + line for line in lines]
            if rule.mode == "set":
                out.append(f"{indent}{target} = v")
            elif rule.mode == "fill":
                out.append(f"{indent}if not {target}: {target} = v")
            else:
                out.append(f"{indent}if v is not None: {target} = v")
        return out

    def get(self, key: Key, default: str = "") -> str:
        if isinstance(key, SpanName):
            return "info.name"
        where = "ctx.get" if isinstance(key, Member) else "get"
        return f"{where}({self.ref(key.name if isinstance(key, Member) else key, 'k')}{default})"

    def value(self, rule: Attr) -> list[str]:
        """Lines that leave the rule's value in `v`."""
        convert = f"{self.ref(rule.convert, 'c')}" if rule.convert is not None else ""
        keys = rule.keys
        if len(keys) == 1 or rule.pick == "or":  # `a or b`: the first truthy value, else the last one
            either = " or ".join(map(self.get, keys))
            return [f"v = {convert}({either})" if convert or len(keys) > 1 else f"v = {either}"]
        if rule.pick == "present":
            lines = [f"v = {self.get(keys[0], ', _MISSING')}"]
            for key in keys[1:]:
                lines.append(f"if v is _MISSING: v = {self.get(key, ', _MISSING')}")
            return [*lines, "if v is _MISSING: v = None", f"v = {convert}(v)"]
        lines = [f"v = {self.get(keys[0])}"]
        for key in keys[1:]:
            lines.append(f"if v is None: v = {self.get(key)}")
        return [*lines, f"v = {convert}(v)"]


def interned(value: Any) -> Any:
    """Text shared by many spans (names, agents, ids) as one copy; anything else as it is."""
    return sys.intern(value) if type(value) is str else value


def as_name(value: Any) -> str | None:
    """A name or id: None stays None, anything else becomes its (shared) text."""
    if value is None:
        return None
    return sys.intern(value if type(value) is str else str(value))
