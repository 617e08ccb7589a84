"""Names of reward components: the built-ins by their field names, user components by import path.

An import path is ``"pkg.module:Name"`` or ``"path/to/file.py:Name"``, loaded by `marft_lg.loading.load_object`
(a file, or a module, next to the reward YAML needs no installation).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from marft_lg.loading import FILE_MODULE_PREFIX
from marft_lg.loading import load_object as _load

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


@contextlib.contextmanager
def relative_to(base_dir: str | Path | None) -> Iterator[None]:
    """Resolve relative ``file.py:Name`` paths against `base_dir` (the YAML file's folder) inside the block;
    `base_dir` is also on the import path while a component's module is imported."""
    token = _BASE_DIR.set(None if base_dir is None else Path(base_dir))
    try:
        yield
    finally:
        _BASE_DIR.reset(token)


def load_object(path: str, *, base_dir: str | Path | None = None, what: str = "reward component") -> Any:
    """`marft_lg.loading.load_object` with `base_dir` defaulting to the folder set by `relative_to`
    (the reward YAML's folder while it is being built). Raises `LoadError` (a ValueError)."""
    return _load(path, base_dir=base_dir if base_dir is not None else _BASE_DIR.get(), what=what)


def import_path_of(obj: Any) -> str | None:
    """``"module:qualname"`` when `obj` can be imported back by that path, else None."""
    target = obj if isinstance(obj, type) or callable(obj) and hasattr(obj, "__qualname__") else type(obj)
    module = getattr(target, "__module__", None)
    qualname = getattr(target, "__qualname__", "")
    if not module or "<" in qualname or module.startswith(FILE_MODULE_PREFIX) or module == "__main__":
        return None
    return f"{module}:{qualname}"


def _load_builtins() -> None:
    import marft_lg.rewards.components  # noqa: F401 - registers the built-ins
