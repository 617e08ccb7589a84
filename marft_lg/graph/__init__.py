"""marft_lg.graph: route a LangGraph app's LLM calls to a Team's adapters and trace every episode.

The names below load on first use: `marft_lg.graph.collect` (what `training.rollout` imports) needs no
LangChain/LangGraph, so the trainer and the device tests run on a machine without them.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from marft_lg._lazy import lazy_exports

_EXPORTS = {
    "TeamChatModel": "marft_lg.graph.chat_model",
    "UnmappedNodeError": "marft_lg.graph.chat_model",
    "WrappedGraph": "marft_lg.graph.wrap",
    "wrap": "marft_lg.graph.wrap",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


class _Package(types.ModuleType):
    """Keeps `marft_lg.graph.wrap` the function: loading the submodule of the same name (``graph/wrap.py``) binds
    the module onto the package, which would make ``from marft_lg.graph import wrap`` depend on import order."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
