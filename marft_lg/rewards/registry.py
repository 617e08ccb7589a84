"""Names of reward components: the built-ins by their field names, user components by import path.

An import path is ``"pkg.module:Name"`` or ``"path/to/file.py:Name"`` (a file is loaded by path,
so a rewards module next to a YAML file needs no installation).
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

_COMPONENTS: dict[str, type] = {}
_BASE_DIR: contextvars.ContextVar[Path | None] = contextvars.ContextVar("marft_reward_base_dir", default=None)

T = TypeVar("T", bound=type)


def register_component(name: str) -> Callable[[T], T]:
    """Class decorator: make a component available under `name` in weights and YAML."""

    def deco(cls: T) -> T:
        if name in _COMPONENTS and _COMPONENTS[name] is not cls:
            raise ValueError(f"reward component name {name!r} is already taken by {_COMPONENTS[name].__qualname__}")
        _COMPONENTS[name] = cls
        return cls

    return deco


def known_components() -> list[str]:
    """Registered component names, sorted."""
    _load_builtins()
    return sorted(_COMPONENTS)


def get_component_class(name: str) -> type | None:
    """The class registered under `name`, or None."""
    _load_builtins()
    return _COMPONENTS.get(name)


def is_import_path(text: str) -> bool:
    return ":" in text and not text.startswith(":") and not text.endswith(":")


@contextlib.contextmanager
def relative_to(base_dir: str | Path | None) -> Iterator[None]:
    """Resolve relative ``file.py:Name`` paths against `base_dir` (the YAML file's folder) inside the block."""
    token = _BASE_DIR.set(None if base_dir is None else Path(base_dir))
    try:
        yield
    finally:
        _BASE_DIR.reset(token)


def load_object(path: str, *, base_dir: str | Path | None = None) -> Any:
    """Import ``"pkg.module:Name"`` or ``"file.py:Name"`` (relative files resolve against `base_dir`,
    else the folder set by `relative_to`, else the working directory)."""
    base_dir = base_dir if base_dir is not None else _BASE_DIR.get()
    module_part, _, attr = path.rpartition(":")
    if not module_part or not attr:
        raise ValueError(f"{path!r} is not an import path; write 'pkg.module:Name' or 'path/to/file.py:Name'")
    if module_part.endswith(".py"):
        file = Path(module_part)
        if not file.is_absolute() and base_dir is not None:
            file = Path(base_dir) / file
        if not file.exists():
            raise ValueError(f"cannot load {path!r}: file {file} does not exist")
        mod_name = f"_marft_reward_{abs(hash(str(file.resolve())))}"
        module = sys.modules.get(mod_name)
        if module is None:
            spec = importlib.util.spec_from_file_location(mod_name, file)
            if spec is None or spec.loader is None:
                raise ValueError(f"cannot load {path!r}: {file} is not a Python module")
            module = importlib.util.module_from_spec(spec)
            sys.modules[mod_name] = module
            try:
                spec.loader.exec_module(module)
            except Exception:
                sys.modules.pop(mod_name, None)
                raise
    else:
        try:
            module = importlib.import_module(module_part)
        except ImportError as exc:
            raise ValueError(f"cannot import {module_part!r} for reward component {path!r}: {exc}. "
                             "Is the package installed or on PYTHONPATH?") from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise ValueError(f"{path!r}: module {module_part!r} has no attribute {attr!r}") from exc
    return obj


def import_path_of(obj: Any) -> str | None:
    """``"module:qualname"`` when `obj` can be imported back by that path, else None."""
    target = obj if isinstance(obj, type) or callable(obj) and hasattr(obj, "__qualname__") else type(obj)
    module = getattr(target, "__module__", None)
    qualname = getattr(target, "__qualname__", "")
    if not module or "<" in qualname or module.startswith("_marft_reward_") or module == "__main__":
        return None
    return f"{module}:{qualname}"


def _load_builtins() -> None:
    import marft_lg.rewards.components  # noqa: F401 - registers the built-ins
