"""One loader for the objects configs name by import path, and the `node_roles` check of configs that build apps.

A spec is ``package.module:attr``, ``package.module:attr.sub`` or ``path/to/file.py:attr``:

- a relative file path is taken relative to `base_dir` (the folder of the config file that names it),
  else the working directory;
- `base_dir` (for a module) or the file's own folder (for a file) is put first on the import path while
  the module is imported, so ``app: myapp:build_graph`` next to ``train.yaml`` needs no ``PYTHONPATH`` and a
  file's sibling modules import; afterwards that folder stays on the import path, last, so imports a
  function makes later still resolve without shadowing anything installed;
- a file is imported once per process (by its resolved path), so loading it again gives the same objects.

Every failure is one `LoadError` (a `ConfigError`, hence a `ValueError`) whose message names the spec, the config file when known,
and what was missing (the spec's shape, the file, the module, or the attribute), e.g.::

    train.yaml: cannot load online.app 'myapp:buld': module 'myapp' has no attribute 'buld'; did you mean 'build'?
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import importlib
import importlib.util
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from marft_lg._config import ConfigError

FILE_MODULE_PREFIX = "_marft_file_"
"""Module names given to files loaded by path (``_marft_file_<stem>_<hash of the path>``)."""

_LOCK = threading.RLock()


class LoadError(ConfigError):
    """A ``module:attr`` / ``file.py:attr`` spec that cannot be loaded (a `ConfigError`, so a `ValueError`).

    `spec` is the spec, `source` the config file that named it (or None), `missing` what was wrong:
    ``"spec"`` (not an import path), ``"file"``, ``"module"``, ``"attribute"``, or ``"import"`` (the
    module exists but raised while it was imported).
    """

    def __init__(self, message: str, *, spec: str, source: str | None = None, missing: str = "spec"):
        super().__init__(message)  # the message already names the source
        self.spec = spec
        self.source = source
        self.missing = missing

    def __reduce__(self):
        return (_load_error, (self.problem, self.spec, self.source, self.missing))


def _load_error(message: str, spec: str, source: str | None, missing: str) -> LoadError:
    return LoadError(message, spec=spec, source=source, missing=missing)


def is_import_path(text: Any) -> bool:
    """True for text shaped like ``module:attr`` (it may still fail to load)."""
    return isinstance(text, str) and ":" in text and not text.startswith(":") and not text.endswith(":")


def load_object(spec: str, *, base_dir: str | Path | None = None, what: str = "object",
                source: str | Path | None = None) -> Any:
    """The object `spec` names (see the module docstring).

    `base_dir`: folder that relative files resolve against and that is on the import path while the module
    is imported (default: the folder of `source`, else none: the working directory resolves files).
    `what`: what the object is for, in error messages (``"online.app"``, ``"--app"``). `source`: the config
    file that holds the spec, named in error messages.
    """
    src = None if source is None else str(source)
    if base_dir is None and source is not None:
        base_dir = Path(source).expanduser().resolve().parent

    def fail(problem: str, missing: str) -> LoadError:
        where = f"{src}: " if src else ""
        return LoadError(f"{where}cannot load {what} {spec!r}: {problem}", spec=str(spec), source=src, missing=missing)

    if not isinstance(spec, str):
        raise fail(f"expected a string 'package.module:name' or 'path/to/file.py:name', got {type(spec).__name__}",
                   "spec")
    target, sep, attr = spec.strip().rpartition(":")
    if not sep or not target or not attr:
        raise fail("not an import path; write 'package.module:name' or 'path/to/file.py:name'", "spec")
    parts = attr.split(".")
    if not all(p.isidentifier() for p in parts):
        raise fail(f"{attr!r} is not an attribute name (after the ':' comes a name like build_graph or Class.method)",
                   "spec")
    base = None if base_dir is None else Path(base_dir).expanduser().resolve()
    if target.endswith(".py"):
        module, label = _import_file(target, base, fail)
    else:
        if not all(p.isidentifier() for p in target.split(".")):
            raise fail(f"{target!r} is neither a module name (package.module) nor a Python file (ending in .py)",
                       "spec")
        module, label = _import_module(target, base, fail), f"module {target!r}"
    obj: Any = module
    for i, part in enumerate(parts):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            owner = label if i == 0 else f"{label} attribute {'.'.join(parts[:i])!r}"
            names = [n for n in dir(obj) if not n.startswith("_")]
            hint = difflib.get_close_matches(part, names, n=1)
            raise fail(f"{owner} has no attribute {part!r}" + (f"; did you mean {hint[0]!r}?" if hint else ""),
                       "attribute") from None
    return obj


def _import_file(target: str, base: Path | None, fail: Any) -> tuple[Any, str]:
    path = Path(target).expanduser()
    if not path.is_absolute():
        path = (base or Path.cwd()) / path
    path = path.resolve()
    if not path.is_file():
        where = f" (relative paths are taken from {base})" if base is not None and not Path(target).is_absolute() else ""
        raise fail(f"file {path} does not exist{where}", "file")
    name = f"{FILE_MODULE_PREFIX}{_safe(path.stem)}_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}"
    label = f"file {str(path)!r}"
    with _LOCK:
        module = sys.modules.get(name)
        if module is not None:
            return module, label
        mod_spec = importlib.util.spec_from_file_location(name, path)
        if mod_spec is None or mod_spec.loader is None:
            raise fail(f"{path} cannot be imported as a Python module", "file")
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[name] = module
        try:
            with _on_path(path.parent):
                mod_spec.loader.exec_module(module)
        except BaseException as exc:
            sys.modules.pop(name, None)
            if not isinstance(exc, Exception):
                raise
            raise fail(_import_problem(exc, str(path)), _missing_kind(exc, None)) from exc
    return module, label


def _import_module(target: str, base: Path | None, fail: Any) -> Any:
    with _LOCK:
        try:
            with _on_path(base):
                return importlib.import_module(target)
        except Exception as exc:
            missing = _missing_kind(exc, target)
            if missing == "module":
                where = f" (looked in {base} and on sys.path)" if base is not None else ""
                raise fail(f"no module named {target!r}{where}; is the package installed, or on PYTHONPATH?",
                           "module") from exc
            raise fail(_import_problem(exc, target), missing) from exc


def _missing_kind(exc: BaseException, target: str | None) -> str:
    """'module' when the module named in the spec itself (or a parent package) is what was not found."""
    if isinstance(exc, ModuleNotFoundError) and target is not None:
        name = exc.name or ""
        if name and (target == name or target.startswith(name + ".")):
            return "module"
    return "import"


def _import_problem(exc: BaseException, what: str) -> str:
    if isinstance(exc, ModuleNotFoundError):
        return f"importing {what} failed: it imports {exc.name!r}, which is not installed or not on the import path"
    if isinstance(exc, SyntaxError):
        return f"{exc.filename or what}:{exc.lineno}: syntax error: {exc.msg}"
    return f"importing {what} raised {type(exc).__name__}: {exc}"


def _safe(stem: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in stem)


@contextlib.contextmanager
def _on_path(folder: Path | None) -> Iterator[None]:
    """`folder` first on sys.path inside the block; afterwards last (added once) so later imports still find it."""
    if folder is None:
        yield
        return
    entry = str(folder)
    sys.path.insert(0, entry)
    importlib.invalidate_caches()
    try:
        yield
    finally:
        sys.path.remove(entry)  # the entry inserted above (the first equal one)
        if entry not in sys.path:
            sys.path.append(entry)


# --- agent roles and the {role: model} mapping ------------------------------------------------------------

def role_problem(role: Any) -> str | None:
    """Why `role` cannot name an agent (None when it can): the one rule for configs, command-line flags and `Team`.
    A role is a non-empty name without '@' (``role@version``), '.' or '/' (registry paths), or whitespace (it is a
    folder name, an OpenAI `model` and a flag's item: ``--agents 'a b'`` is a typo, not a role)."""
    if not isinstance(role, str) or not role or any(c in role for c in "@./") or any(c.isspace() for c in role):
        return f"invalid agent role {role!r}: use a non-empty name without '@', '.', '/' or whitespace"
    return None


def check_roles(roles: Any, key: str = "agents") -> list[str]:
    """A list of agent roles, each valid and named once; a `ConfigError` keyed at the bad entry otherwise."""
    roles = list(roles)
    for i, role in enumerate(roles):
        problem = role_problem(role)
        if problem:
            raise ConfigError(problem, key=(key, i))
    dup = sorted({r for r in roles if roles.count(r) > 1})
    if dup:
        raise ConfigError(f"duplicate agent roles {dup}; list each role once", key=key)
    return roles


def check_model_mapping(model: Mapping[Any, Any], agents: list[str]) -> list[str]:
    """`model` given as ``{role: model spec}``: valid roles, non-empty specs, and `agents` empty (then the mapping's
    roles, which are returned) or naming exactly its roles. A `ConfigError` keyed at what is wrong otherwise."""
    if not model:
        raise ConfigError("model is an empty mapping; give {role: model spec}, e.g. {planner: "
                          "embedded:smollm2-135m-instruct}, or one model spec for every role", key="model")
    for role, spec in model.items():
        problem = role_problem(role)
        if problem:
            raise ConfigError(problem, key=("model", role))
        if not isinstance(spec, str) or not spec.strip():
            raise ConfigError(f"the model of role {role!r} is empty; give a model spec (embedded:NAME or a local "
                              "directory)", key=("model", role))
    roles = list(model)
    if not agents:
        return roles
    missing = [r for r in roles if r not in agents]
    extra = [a for a in agents if a not in model]
    if missing or extra:
        raise ConfigError(f"agents {list(agents)} do not match the roles of the model mapping {roles}"
                          + (f" (no model for {extra})" if extra else "")
                          + (f" (not in agents: {missing})" if missing else "")
                          + "; omit agents or list the same roles", key="agents")
    return list(agents)


# --- node_roles ---------------------------------------------------------------------------------------

def parse_node_roles(value: Any, *, source: str | Path | None = None, key: str = "node_roles",
                     roles: list[str] | None = None) -> dict[str, str] | None:
    """Check a config's ``node_roles`` (``{node: role}``, or ``"node=role,..."`` from a command line).

    Returns a plain dict (None for None or empty). Raises `ValueError` naming `source` and `key` when it is not
    a mapping of non-empty strings to non-empty strings, or (when `roles` is given) maps to an unknown role.
    """
    where = f"{source}: {key}" if source is not None else key
    if value is None:
        return None
    if isinstance(value, str):
        text, value = value, {}
        for item in (i.strip() for i in text.split(",")):
            if not item:
                continue
            node, sep, role = item.partition("=")
            if not sep or not node.strip() or not role.strip():
                raise ValueError(f"{where}: {item!r} is not node=role; write e.g. 'plan_step=planner,draft=writer'")
            value[node.strip()] = role.strip()
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} must map node names to agent roles ({{node: role}}), "
                         f"got {type(value).__name__} {value!r}")
    out: dict[str, str] = {}
    for node, role in value.items():
        if not isinstance(node, str) or not node:
            raise ValueError(f"{where}: node name {node!r} must be a non-empty string")
        if not isinstance(role, str) or not role:
            raise ValueError(f"{where}: the role of node {node!r} must be a non-empty string, got {role!r}")
        if roles is not None and role not in roles:
            raise ValueError(f"{where}: node {node!r} maps to role {role!r}, which is not one of the agents {list(roles)}")
        out[node] = role
    return out or None
