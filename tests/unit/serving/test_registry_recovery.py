"""What a killed save leaves is cleaned up, never a live save's folder; a version whose manifest is gone is named by
`marft-lg adapters` (loudest when an alias still names it) and its number is never reused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from test_registry import _fake_adapter
from typer.testing import CliRunner

from marft_lg.cli import app
from marft_lg.serving.registry.store import _HOST, FOREIGN_SAVE_STALE_S, AdapterRegistry

ROOT = Path(__file__).resolve().parents[3]  # the checkout whose marft_lg is under test
# a save that stops for good once its files are copied into its work folder (a marker says so): then it is killed
SAVE_THEN_HANG = """
import sys, time
from pathlib import Path
from marft_lg.serving.registry import store as registry

def hang(folder):
    Path(sys.argv[3]).write_text(str(folder))
    time.sleep(600)

registry.record_adapter = hang
registry.AdapterRegistry(sys.argv[1]).save("planner", sys.argv[2], base_fingerprint="fp")
"""


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_save_killed_mid_way_leaves_no_tmp_folder_once_the_registry_is_opened_again(tmp_path):
    reg = AdapterRegistry(tmp_path / "reg")
    src = _fake_adapter(tmp_path / "src")
    assert reg.save("planner", src, base_fingerprint="fp") == "v1"
    marker = tmp_path / "copied"
    proc = subprocess.Popen([sys.executable, "-c", SAVE_THEN_HANG, str(reg.root), str(src), str(marker)],
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 60
    while not marker.exists():  # the condition, not a timer: the files are in the work folder now
        assert proc.poll() is None and time.monotonic() < deadline, "the save never reached its work folder"
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    left = [p.name for p in (reg.root / "planner").iterdir() if p.name.startswith(".tmp-")]
    assert left and left[0].startswith(f".tmp-{proc.pid}-")  # what the kill left behind
    reopened = AdapterRegistry(reg.root, create=False)  # the next open cleans it
    assert sorted(p.name for p in (reg.root / "planner").iterdir()) == ["v1"]
    assert reopened.save("planner", src, base_fingerprint="fp") == "v2" and reopened.versions("planner") == ["v1", "v2"]


def test_only_folders_of_saves_whose_process_is_gone_are_removed(tmp_path):
    reg = AdapterRegistry(tmp_path / "reg")
    reg.save("planner", _fake_adapter(tmp_path / "src"), base_fingerprint="fp")
    role = reg.root / "planner"
    dead = _dead_pid()
    live = role / f".tmp-{os.getpid()}-1"  # a save in flight in a live process (this one)
    old_format_dead = role / f".tmp-{dead}-2"
    this_host_dead = role / f".tmp-{dead}-3-{_HOST}"
    foreign_fresh = role / f".tmp-{dead}-4-elsewhere"  # another host's pid means nothing here: its age decides
    foreign_old = role / f".tmp-{dead}-5-elsewhere"
    for folder in (live, old_format_dead, this_host_dead, foreign_fresh, foreign_old):
        folder.mkdir()
        (folder / "adapter_model.safetensors").write_bytes(b"partial")
    old = time.time() - FOREIGN_SAVE_STALE_S - 60
    os.utime(foreign_old, (old, old))
    AdapterRegistry(reg.root)
    assert sorted(p.name for p in role.iterdir()) == sorted(["v1", live.name, foreign_fresh.name])
    reg.save("planner", tmp_path / "src", base_fingerprint="fp")  # a save cleans too, and keeps the live one
    assert live.exists() and foreign_fresh.exists()


def test_a_version_without_its_manifest_is_named_by_adapters_loudest_when_live_names_it(tmp_path):
    reg = AdapterRegistry(tmp_path / "reg")
    src = _fake_adapter(tmp_path / "src")
    for _ in range(3):
        reg.save("planner", src, base_fingerprint="fp")
    reg.promote({"planner": "v2"})
    (reg.root / "planner" / "v2" / "manifest.json").unlink()
    (reg.root / "planner" / "v3" / "manifest.json").unlink()
    result = CliRunner().invoke(app, ["adapters", "--registry", str(reg.root)], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    v2, v3 = reg.root / "planner" / "v2", reg.root / "planner" / "v3"
    assert f"warning: {v2} has no manifest.json, yet alias live names it for planner" in text
    assert f"warning: {v3} has no manifest.json (deleted, or a save that never finished)" in text
    assert reg.incomplete() == [("planner", "v2"), ("planner", "v3")]
    assert reg.save("planner", src, base_fingerprint="fp") == "v4"  # the number of a folder that is still there
