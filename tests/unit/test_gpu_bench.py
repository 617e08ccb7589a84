"""benchmarks/gpu.py on the CPU (a 2-layer `tiny` shape), as the GPU check runs it: on a bare CUDA PyTorch machine
(tests/bare_machine hides the embedded model package, LangChain, LangGraph and OpenTelemetry), with the fields that
issue #34's "done when" asks of benchmarks/results/gpu.json."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from tests.bare_machine.bare_env import bare_env

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_benchmark_writes_its_rows_on_a_bare_machine(tmp_path):
    from marft_lg.serving.engine.models import build_tiny_tokenizer

    tok = build_tiny_tokenizer(tmp_path / "tokenizer")
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, "benchmarks/gpu.py", "--device", "cpu", "--shapes", "tiny", "--dtypes",
                           "float32", "--batch", "2,3", "--max-tokens", "3", "--per-role", "2", "--repeats", "1",
                           "--tokenizer", str(tok), "--out", str(out)], cwd=ROOT, env=bare_env(tmp_path),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    result = json.loads(out.read_text())
    assert result["commit"] and result["device"].startswith("cpu") and result["torch"]
    assert [(r["shape"], r["dtype"], r["batch"]) for r in result["runs"]] == [("tiny", "float32", 2), ("tiny", "float32", 3)]
    for r in result["runs"]:
        assert r["engine"]["tokens"] == r["generate"]["tokens"] == 3 * r["batch"]  # every row forced to max tokens
        assert r["engine_over_generate"] == r["engine_tokens_per_s"] / r["generate_tokens_per_s"] > 0
        assert r["ppo_over_plain"] == r["ppo"]["ratio_ppo_to_plain"] > 0
        assert r["bandwidth_limit_tokens_per_s"] is None  # measured on a GPU only
        # the static decode step (issue #49) in the same run; compiled and generate's static cache: GPU defaults only
        assert r["engine_static"]["tokens"] == 3 * r["batch"] and r["engine_static"]["decode"] == "static"
        assert r["static_over_eager"] == r["engine_static_tokens_per_s"] / r["engine_tokens_per_s"] > 0
        assert "engine_compiled" not in r and "generate_static" not in r
    assert "engine/generate" in proc.stdout and "PPO/plain" in proc.stdout and "x eager" in proc.stdout


def test_commit_comes_from_the_flag_first_then_git(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_bench", ROOT / "benchmarks" / "gpu.py")
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    import marft_lg._provenance as prov

    here = prov.code_state()["commit"]
    assert gpu.provenance(None)["commit"] == here  # git where no commit is given
    state = gpu.provenance("f" * 40)  # the flag wins (a device copy's .git can be stale); git's view kept beside it
    assert state["commit"] == "f" * 40 and state["git_commit"] == here and here[:7] in state["commit_note"]
    assert gpu.provenance(here) == prov.code_state()  # the same: nothing to note
    monkeypatch.setattr(prov, "code_state", lambda: {"commit": None, "dirty": None})
    state = gpu.provenance("f" * 40)
    assert state["commit"] == "f" * 40 and "--commit" in state["commit_note"]
    assert gpu.provenance(None)["commit"] is None


def test_gpu_check_scripts_parse_and_agree_with_their_doc():
    for script in ("gpu_check.sh", "gpu_prepare.sh"):
        out = subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / script)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
    check = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
    doc = (ROOT / "docs" / "gpu-check.md").read_text()
    assert ".gpu/tokenizer" in check and ".gpu/wheels/*.whl" in check and "tests/unit/training/test_device.py" in check
    assert 'carry=[".gpu"]' in doc and "/.gpu/" in (ROOT / ".gitignore").read_text().splitlines()
