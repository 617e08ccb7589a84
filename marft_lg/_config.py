"""What every config loader shares: YAML read with line numbers, typed fields, one error type.

- `ConfigError` (a `ValueError`): a config that cannot be used. Its message is complete and names
  ``file:line: key: problem`` when the value came from a file, e.g.
  ``train.yaml:7: marft.learning_rate: expected a number, got str 'fast'``. The CLI prints it and exits 2.
  `ConfigNotFound` is also a `FileNotFoundError` (a config file or a path a config names is missing).
- `load_yaml(path)` -> `YamlDoc`: the parsed data plus the line of every key (PyYAML's compose step keeps
  the marks). Syntax errors name ``file:line:column``; non-UTF-8 bytes, duplicate keys, unsafe tags and
  bad explicit tags (``!!int abc``) are `ConfigError`s too, never a raw YAML or Python exception.
- `check_fields(cls, data, doc)`: a dataclass's keys and the types of their values, from the annotations
  (unknown keys get the closest known name; a single string is accepted where a list of strings is expected).
  Range checks stay in each dataclass's ``__post_init__``, which raises ``ConfigError(problem, key=...)``;
  `YamlDoc.locate` adds the file and line.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

KeyPath = tuple[Any, ...]


class ConfigError(ValueError):
    """A config key or value that cannot be used; the message says where (file:line: key) and what is wrong.

    `problem` is the message without the location; `path`, `line`, `column`, `key` (a dotted key path)
    say where, when known.
    """

    def __init__(self, problem: str, *, path: str | Path | None = None, line: int | None = None,
                 column: int | None = None, key: str | KeyPath | None = None):
        self.problem = problem
        self.path = None if path is None else str(path)
        self.line, self.column = line, column
        self.key = key if isinstance(key, tuple) else (() if key in (None, "") else (key,))
        super().__init__(self._message())

    @property
    def dotted_key(self) -> str:
        return dotted(self.key)

    def _message(self) -> str:
        where = ""
        if self.path is not None:
            where = self.path + (f":{self.line}" if self.line else "") + (f":{self.column}" if self.column else "")
        parts = [p for p in (where, self.dotted_key) if p]
        return ": ".join([*parts, self.problem])

    def __reduce__(self):  # picklable across processes (the keyword-only arguments)
        return (_rebuild, (type(self), self.problem, self.path, self.line, self.column, self.key))


def _rebuild(cls, problem, path, line, column, key):
    return cls(problem, path=path, line=line, column=column, key=key)


class ConfigNotFound(ConfigError, FileNotFoundError):
    """A config file, or a file a config names, does not exist."""


def dotted(key: KeyPath) -> str:
    out = ""
    for k in key:
        out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else str(k))
    return out


@dataclass
class YamlDoc:
    """Parsed YAML (`data`) plus where each key is: `lines[key_path] = (line, column)`, 1-based.

    `prefix` is the key path of `data` inside the file (`doc.at("marft")` is the `marft` section), so
    errors of a section still name the full key. A mapping built in Python has no file and no lines
    (`YamlDoc.of(data, source)`): its errors name `source` instead.
    """

    path: str | None
    data: Any
    lines: dict[KeyPath, tuple[int, int]] = field(default_factory=dict)
    prefix: KeyPath = ()

    @classmethod
    def of(cls, data: Any, source: str | Path | None = None) -> YamlDoc:
        return cls(None if source is None else str(source), data)

    def at(self, *keys: Any) -> YamlDoc:
        """The view of one nested value (a missing key gives None)."""
        data = self.data
        for k in keys:
            data = data.get(k) if isinstance(data, Mapping) else None
        return YamlDoc(self.path, data, self.lines, self.prefix + keys)

    def line_of(self, key: KeyPath = ()) -> tuple[int | None, int | None]:
        full = self.prefix + tuple(key)
        for n in range(len(full), 0, -1):  # the closest enclosing key that has a line
            mark = self.lines.get(tuple(_norm(k) for k in full[:n]))
            if mark is not None:
                return mark
        return None, None

    def error(self, problem: str, key: KeyPath | str = ()) -> ConfigError:
        key = (key,) if isinstance(key, str) else tuple(key)
        line, _ = self.line_of(key)
        return ConfigError(problem, path=self.path, line=line, key=self.prefix + key)

    def not_found(self, problem: str, key: KeyPath | str = ()) -> ConfigNotFound:
        key = (key,) if isinstance(key, str) else tuple(key)
        line, _ = self.line_of(key)
        return ConfigNotFound(problem, path=self.path, line=line, key=self.prefix + key)

    def locate(self, exc: ConfigError) -> ConfigError:
        """`exc` (raised without a file, e.g. by a ``__post_init__``) with this document's file and line added."""
        if exc.path is not None:
            return exc
        out = self.error(exc.problem, exc.key)
        out.__cause__ = exc.__cause__
        return out

    @property
    def source(self) -> str:
        """How errors name this document: the file, or `<dict>`."""
        return self.path or "<dict>"


def _norm(k: Any) -> Any:
    return k if isinstance(k, int) and not isinstance(k, bool) else str(k)


def read_text(path: str | Path, *, what: str = "config file") -> str:
    """A config file's text; a missing file is `ConfigNotFound`, a folder or non-UTF-8 bytes a `ConfigError`."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise ConfigNotFound(f"{what} {p} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"{what} {p} is a folder, not a file") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {p}: {exc.strerror or exc}") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise ConfigError(f"not UTF-8 text (byte {raw[exc.start]:#04x} at offset {exc.start})", path=p,
                          line=line) from None


def load_yaml(path: str | Path, *, what: str = "config file") -> YamlDoc:
    """Parse a YAML file (safe tags only) keeping the line of every key; every failure is a `ConfigError`."""
    p = Path(path)
    return parse_yaml(read_text(p, what=what), p)


def parse_yaml(text: str, path: str | Path | None = None) -> YamlDoc:
    source = "<text>" if path is None else str(path)
    loader = None
    try:
        loader = yaml.SafeLoader(text)
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = " ".join(str(p) for p in (exc.context, exc.problem) if p) or str(exc)
        raise ConfigError(f"not valid YAML: {problem}", path=source, line=None if mark is None else mark.line + 1,
                          column=None if mark is None else mark.column + 1) from None
    except yaml.reader.ReaderError as exc:  # a character YAML does not allow (control characters)
        line = text[:exc.position].count("\n") + 1 if isinstance(exc.position, int) else None
        char = chr(exc.character) if isinstance(exc.character, int) else exc.character
        raise ConfigError(f"not valid YAML: character {char!r} is not allowed ({exc.reason})", path=source,
                          line=line) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"not valid YAML: {exc}", path=source) from None
    except RecursionError:
        raise ConfigError("not valid YAML: nested too deeply", path=source) from None
    except (ValueError, TypeError, OverflowError, AttributeError) as exc:  # e.g. `!!int abc`, `!!float x`
        raise ConfigError(f"not valid YAML: a value cannot be read ({type(exc).__name__}: {exc})",
                          path=source) from None
    finally:
        if loader is not None:
            loader.dispose()
    lines: dict[KeyPath, tuple[int, int]] = {}
    if node is not None:
        try:
            _marks(node, (), lines, source)
        except RecursionError:
            raise ConfigError("not valid YAML: nested too deeply", path=source) from None
    return YamlDoc(source, data, lines)


def _marks(node: yaml.Node, key: KeyPath, out: dict[KeyPath, tuple[int, int]], source: str) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for knode, vnode in node.value:
            if knode.tag == "tag:yaml.org,2002:merge":
                continue
            name = knode.value if isinstance(knode, yaml.ScalarNode) else None
            if name is None:
                continue
            line = knode.start_mark.line + 1
            if name in seen and isinstance(knode, yaml.ScalarNode):
                raise ConfigError(f"duplicate key {name!r} (first at line {seen[name]})", path=source, line=line,
                                  key=key)
            seen[name] = line
            path = (*key, str(name))
            out.setdefault(path, (line, knode.start_mark.column + 1))
            _marks(vnode, path, out, source)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            path = (*key, i)
            out.setdefault(path, (item.start_mark.line + 1, item.start_mark.column + 1))
            _marks(item, path, out, source)


# --- typed fields -------------------------------------------------------------------------------------

_NONE = type(None)


def check_fields(cls: type, data: Any, doc: YamlDoc, *, what: str, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """`data`'s keys checked against dataclass `cls` (unknown keys, value types from the annotations).

    Returns the converted mapping (ints accepted for floats, a numeric string like ``5e-5`` read as a number,
    a single string accepted for a list of strings). Raises `ConfigError` naming the file, line and key.
    `skip`: fields whose values are checked by the caller.
    """
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise doc.error(f"expected a mapping of {what} settings, got {_kind(data)}")
    settings = [f for f in dataclasses.fields(cls) if f.init]
    known = [f.name for f in settings]
    for key in data:
        if not isinstance(key, str) or key not in known:
            hint = difflib.get_close_matches(str(key), known, n=1)
            tip = f"did you mean {hint[0]!r}?" if hint else f"known keys: {sorted(known)}"
            raise doc.error(f"unknown {what} key; {tip}", (key,))
    hints = typing.get_type_hints(cls)
    out = {}
    for key, value in data.items():
        out[key] = value if key in skip else convert(value, hints[key], doc, (key,))
    return out


def convert(value: Any, tp: Any, doc: YamlDoc, key: KeyPath) -> Any:
    """`value` as type `tp` (see `check_fields`), or a `ConfigError` at `key`."""
    ok, out = _convert(value, tp, doc, key)
    if not ok:
        raise doc.error(f"expected {describe(tp)}, got {_kind(value)}", key)
    return out


def _convert(value: Any, tp: Any, doc: YamlDoc, key: KeyPath) -> tuple[bool, Any]:
    if tp is Any or tp is object:
        return True, value
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        args = typing.get_args(tp)
        if value is None:
            return _NONE in args, None
        for arg in args:
            if arg is _NONE:
                continue
            ok, out = _convert(value, arg, doc, key)
            if ok:
                return True, out
        return False, None
    if tp is _NONE:
        return value is None, None
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        number = _number(value)
        if number is None:
            return False, None
        if not math.isfinite(number):
            raise doc.error(f"must be a finite number, got {value!r}", key)
        return True, number
    if tp is str:
        return isinstance(value, str), value
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        if isinstance(value, str) and item is str:
            value = [value]  # `phases: offline` is `phases: [offline]`
        if not isinstance(value, list):
            return False, None
        return True, [convert(v, item, doc, (*key, i)) for i, v in enumerate(value)]
    if origin is dict:
        kt, vt = typing.get_args(tp) or (Any, Any)
        if not isinstance(value, Mapping):
            return False, None
        out = {}
        for k, v in value.items():
            if kt is str and not isinstance(k, str):
                raise doc.error(f"keys must be text, got {_kind(k)}", (*key, k))
            out[k] = convert(v, vt, doc, (*key, k))
        return True, out
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if isinstance(value, tp):
            return True, value
        if not isinstance(value, Mapping):
            return False, None
        sub = YamlDoc(doc.path, value, doc.lines, doc.prefix + key)
        checked = check_fields(tp, value, sub, what=tp.__name__)
        missing = [f.name for f in dataclasses.fields(tp) if f.init and f.name not in checked
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise doc.error(f"missing {missing} (a {tp.__name__} needs {missing})", key)
        try:
            return True, tp(**checked)
        except ConfigError as exc:
            raise sub.locate(exc) from None
    if isinstance(tp, type):
        return isinstance(value, tp), value
    return True, value


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        try:
            return float(value)
        except OverflowError:
            return math.inf
    if isinstance(value, str):  # PyYAML reads `5e-5` (no dot) as text
        try:
            return float(value.strip().replace("_", ""))
        except ValueError:
            return None
    return None


def describe(tp: Any) -> str:
    """A type annotation in words (`float | None` -> 'a number or null')."""
    if tp is Any or tp is object:
        return "any value"
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        return " or ".join(describe(a) for a in typing.get_args(tp))
    if tp is _NONE:
        return "null"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "text"}
    if tp in names:
        return names[tp]
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        return f"a list of {_plural(item)}"
    if origin is dict:
        kt, vt = typing.get_args(tp) or (Any, Any)
        return "a mapping" if vt is Any else f"a mapping of {_plural(kt)} to {_plural(vt)}"
    if isinstance(tp, type):
        return f"a {tp.__name__} mapping" if dataclasses.is_dataclass(tp) else f"a {tp.__name__}"
    return str(tp)


def _plural(tp: Any) -> str:
    words = {str: "text", int: "integers", float: "numbers", bool: "booleans"}
    if tp in words:
        return words[tp]
    if typing.get_origin(tp) is dict:
        return "mappings"
    if typing.get_origin(tp) is list:
        return "lists"
    if dataclasses.is_dataclass(tp):
        return f"{tp.__name__} mappings"
    return describe(tp)


def _kind(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def unknown_keys(data: Iterable[Any], known: Iterable[Any]) -> str:
    """The keys of `data` not in `known`, as one sorted, comma-separated string of their reprs ("" when none): a
    YAML key may be null or a number, which neither sorts with strings nor reads well bare."""
    return ", ".join(sorted(map(repr, set(data) - set(known))))


# --- range checks for __post_init__ -----------------------------------------------------------------------

def check_range(name: str | KeyPath, value: Any, *, low: float | None = None, high: float | None = None,
                low_open: bool = False, high_open: bool = False, allow_none: bool = False) -> None:
    """Raise `ConfigError(key=name)` unless `value` is a finite number in the range (None when `allow_none`)."""
    if value is None and allow_none:
        return
    number = _number(value) if not isinstance(value, str) else None
    if number is None or not math.isfinite(number):
        raise ConfigError(f"expected a finite number, got {_kind(value)}", key=name)
    lo_bad = low is not None and (number <= low if low_open else number < low)
    hi_bad = high is not None and (number >= high if high_open else number > high)
    if lo_bad or hi_bad:
        parts = []
        if low is not None:
            parts.append(f"{'>' if low_open else '>='} {low:g}")
        if high is not None:
            parts.append(f"{'<' if high_open else '<='} {high:g}")
        raise ConfigError(f"must be {' and '.join(parts)}, got {value!r}", key=name)


def check_int(name: str | KeyPath, value: Any, *, low: int | None = None, allow_none: bool = False) -> None:
    """Raise `ConfigError(key=name)` unless `value` is an integer >= `low` (None when `allow_none`)."""
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"expected an integer, got {_kind(value)}", key=name)
    if low is not None and value < low:
        raise ConfigError(f"must be >= {low}" + (" or null" if allow_none else "") + f", got {value!r}", key=name)
