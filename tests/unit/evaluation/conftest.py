"""Lets the evaluation tests import their helpers (eval_factory) under any pytest import mode, and the served
registry the promotion tests share: built once per module, copied per test."""

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="module")
def template(tiny_model_dir, tmp_path_factory):
    """`served_registry.build_registry`'s registry folder, built once per test module."""
    from served_registry import build_registry

    return build_registry(tiny_model_dir, tmp_path_factory.mktemp("registry-template")).root


@pytest.fixture()
def registry(template, tmp_path):
    """A copy of `template` for one test (a module's own `registry` fixture wins)."""
    from marft_lg.serving.registry.store import AdapterRegistry

    shutil.copytree(template, tmp_path / "registry")
    return AdapterRegistry(tmp_path / "registry")
