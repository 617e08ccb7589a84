"""Lazy re-exports for a package's `__init__`: each public name is imported from its module on first use, so importing
the package stays cheap (`marft-lg --help` and `import marft_lg` load no torch, transformers or LangChain)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str],
                 extra: tuple[str, ...] = ()) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level `__getattr__` and `__dir__` of `package`. `exports` maps a name to the module that defines it
    (absolute, or relative to `package` with a leading dot); `extra` names `__dir__` lists besides them. A name is
    bound on the package once loaded, so the next use is a plain attribute."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted([*exports, *extra])

    return __getattr__, __dir__
