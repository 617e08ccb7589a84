"""marft_lg.graph: route a LangGraph app's LLM calls to a Team's adapters and trace every episode.

The names below load on first use: `marft_lg.graph.collect` (what `training.rollout` imports) needs no
LangChain/LangGraph, so the trainer and the device tests run on a machine without them.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

_EXPORTS = {
    "TeamChatModel": "marft_lg.graph.chat_model",
    "UnmappedNodeError": "marft_lg.graph.chat_model",
    "WrappedGraph": "marft_lg.graph.wrap",
    "wrap": "marft_lg.graph.wrap",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'marft_lg.graph' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


class _Package(types.ModuleType):
    """Keeps `marft_lg.graph.wrap` the function: loading the submodule of the same name (``graph/wrap.py``) binds
    the module onto the package, which would make ``from marft_lg.graph import wrap`` depend on import order."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
