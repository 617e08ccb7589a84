"""Every figure in README's benchmark table names the results file and commit it comes from, and no results file is
older than the code it measures.

Each results file records the `commit` it was measured at (top-level key); the table's "measured at" cell names the
file and that commit. A file is stale when a later commit touched one of the paths listed for it in MEASURES; a
stale figure may stay only if its row says why ("not re-run: ..."), so no reader takes an old figure for today's.
The history checks need a git checkout (a clean clone has one) and are skipped outside it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"

# results file -> the code its figures depend on (the benchmark itself, then what it times); time_to_gain.py reads
# the demo's runs (demo.json's figures), serving.py's vLLM part runs serving_vllm.py
MEASURES: dict[str, list[str]] = {
    "serving.json": ["benchmarks/serving.py", "marft_lg/serving/engine/hf.py", "marft_lg/serving/engine/scheduler.py",
                     "marft_lg/serving/engine/adapters.py", "marft_lg/serving/engine/prefix.py", "marft_lg/serving/engine/sampling.py",
                     "marft_lg/serving/engine/mixed_forward.py", "marft_lg/serving/registry/lora.py",
                     # time to first token goes through the server's streaming path
                     "marft_lg/serving/http/server.py", "marft_lg/serving/http/chat_stream.py", "marft_lg/serving/engine/streaming.py"],
    "serving_vllm.json": ["benchmarks/serving_vllm.py", "marft_lg/serving/engine/vllm.py"],
    "rollout.json": ["benchmarks/rollout.py", "marft_lg/serving/engine/hf.py", "marft_lg/serving/engine/scheduler.py",
                     "marft_lg/serving/engine/prefix.py", "marft_lg/serving/engine/sampling.py", "marft_lg/serving/engine/mixed_forward.py",
                     "marft_lg/serving/engine/vllm.py", "marft_lg/examples/math_team"],
    "tracing.json": ["benchmarks/tracing.py", "marft_lg/graph/wrap.py", "marft_lg/graph/chat_model.py",
                     "marft_lg/tracing/recorder.py", "marft_lg/tracing/sink.py", "marft_lg/tracing/exporters.py",
                     "marft_lg/tracing/propagation.py"],
    "mining.json": ["benchmarks/mining.py", "marft_lg/trajectories"],
    "rewards_scoring.json": ["benchmarks/rewards_scoring.py", "marft_lg/rewards"],
    "compare.json": ["benchmarks/compare.py", "marft_lg/evaluation/comparison.py", "marft_lg/evaluation/stats.py",
                     "marft_lg/evaluation/gate.py", "marft_lg/evaluation/report.py",
                     "marft_lg/evaluation/agent_metrics.py", "marft_lg/rewards/composite.py"],
    "training.json": ["benchmarks/training.py", "marft_lg/training/ppo.py", "marft_lg/training/batch.py",
                      "marft_lg/training/units.py", "marft_lg/training/policy.py", "marft_lg/training/buffer.py",
                      "marft_lg/training/shared_prefix.py"],
    "hetero.json": ["benchmarks/hetero.py", "marft_lg/training", "marft_lg/serving/team_factory.py"],
    "gpu.json": ["benchmarks/gpu.py", "marft_lg/training/ppo.py", "marft_lg/training/batch.py",
                 "marft_lg/training/policy.py", "marft_lg/serving/engine/hf.py",
                 "marft_lg/serving/engine/static_decode.py", "marft_lg/serving/engine/scheduler.py",
                 "marft_lg/serving/engine/sampling.py"],
    "distributed.json": ["benchmarks/distributed.py", "marft_lg/distributed", "marft_lg/graph/collect.py"],
    "blame.json": ["benchmarks/blame.py", "marft_lg/evaluation/attribution.py", "marft_lg/graph/replays.py",
                   "marft_lg/serving/replay.py", "marft_lg/examples/relay.py", "marft_lg/examples/math_team"],
    "credit_tools.json": ["benchmarks/credit_tools.py", "marft_lg/training/credit.py", "marft_lg/graph/replays.py",
                          "marft_lg/serving/replay.py", "marft_lg/graph/collect.py", "examples/supervisor_tools"],
    # the tool-using team trained per setting and compared on held-out questions (credit_tools.py --out)
    "tools_learn.json": ["benchmarks/credit_tools.py", "marft_lg/training", "marft_lg/graph/collect.py",
                         "marft_lg/evaluation/shadow.py", "marft_lg/evaluation/comparison.py", "examples/supervisor_tools"],
    "credit.json": ["benchmarks/credit.py", "marft_lg/training/credit.py", "marft_lg/graph/replays.py",
                    "marft_lg/serving/replay.py", "marft_lg/demo.py"],
    "demo.json": ["benchmarks/demo.py", "marft_lg/demo.py", "marft_lg/examples/math_team", "marft_lg/training",
                  "marft_lg/serving/engine/hf.py", "marft_lg/serving/engine/scheduler.py", "marft_lg/serving/engine/sampling.py",
                  "marft_lg/evaluation/shadow.py", "marft_lg/evaluation/gate.py"],
    # the math team trained per reward arm, compared with the demo's held-out comparison; the loop mines traffic
    "unlabeled.json": ["benchmarks/unlabeled.py", "marft_lg/demo.py", "marft_lg/examples/math_team",
                       "marft_lg/training", "marft_lg/rewards", "marft_lg/tracing/feedback.py",
                       "marft_lg/trajectories/scenario_sets.py", "marft_lg/serving/engine/hf.py",
                       "marft_lg/serving/engine/scheduler.py", "marft_lg/serving/engine/sampling.py",
                       "marft_lg/evaluation/shadow.py"],
    # replays of a demo run's published versions on its held-out problems (the demo's comparison, stage 7)
    "time_to_gain.json": ["benchmarks/time_to_gain.py", "marft_lg/demo_curve.py", "marft_lg/demo.py", "marft_lg/examples/math_team",
                          "marft_lg/evaluation/shadow.py", "marft_lg/serving/engine/hf.py",
                          "marft_lg/serving/engine/scheduler.py", "marft_lg/serving/engine/sampling.py"],
    # whole demo runs per arm (benchmarks/learn.py runs run_demo): the demo's code paths, as demo.json's
    "learn.json": ["benchmarks/learn.py", "marft_lg/demo.py", "marft_lg/examples/math_team", "marft_lg/training",
                   "marft_lg/serving/engine/hf.py", "marft_lg/serving/engine/scheduler.py", "marft_lg/serving/engine/sampling.py",
                   "marft_lg/evaluation/shadow.py", "marft_lg/evaluation/gate.py"],
}
MEASURES["learn_credit.json"] = MEASURES["learn.json"]  # learn.py --out: the credit estimators, same demo runs


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True).stdout.strip()


def _has_history() -> bool:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return False
    try:
        return _git("rev-parse", "--is-shallow-repository") == "false"
    except subprocess.CalledProcessError:
        return False


def later_changes(commit: str, paths: list[str]) -> list[str]:
    """Commits after `commit` (on the way to HEAD) that touched any of `paths`, newest first."""
    out = _git("log", "--format=%h %s", f"{commit}..HEAD", "--", *paths)
    return [line for line in out.splitlines() if line]


def test_every_results_file_is_mapped_to_code_that_exists():
    files = {p.name for p in RESULTS.glob("*.json")}
    assert files == set(MEASURES), f"unmapped: {sorted(files - set(MEASURES))}, gone: {sorted(set(MEASURES) - files)}"
    missing = [p for paths in MEASURES.values() for p in paths if not (ROOT / p).exists()]
    assert not missing, missing
    for name in files:
        assert json.loads((RESULTS / name).read_text()).get("commit"), f"{name} records no commit"


def readme_rows() -> list[tuple[int, str, str, str]]:
    """(line, the row, results file, commit) of each row of README's benchmark table."""
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index("## Benchmarks")
    rows = []
    for n, line in enumerate(lines[start + 1:], start=start + 2):
        if line.startswith("## "):
            break
        if line.startswith("| ") and not line.startswith("| area "):
            m = re.search(r"\|\s*`([\w.]+\.json)`\s+([0-9a-f]{7,40})\s*\|\s*$", line)
            rows.append((n, line, m.group(1) if m else "", m.group(2) if m else ""))
    return rows


def test_every_benchmark_row_names_its_results_file_and_that_files_commit():
    rows = readme_rows()
    assert len(rows) > 10
    problems = []
    for n, line, name, commit in rows:
        if not name:
            problems.append(f"README.md:{n}: no `file.json` COMMIT in the last cell: {line[:80]}")
        elif not (RESULTS / name).exists():
            problems.append(f"README.md:{n}: benchmarks/results/{name} does not exist")
        elif not json.loads((RESULTS / name).read_text())["commit"].startswith(commit):
            recorded = json.loads((RESULTS / name).read_text())["commit"][:7]
            problems.append(f"README.md:{n}: says {name} at {commit}, the file records {recorded}")
    assert not problems, "\n".join(problems)


@pytest.mark.skipif(not _has_history(), reason="needs a git checkout with its history")
def test_no_results_file_is_older_than_the_code_it_measures():
    why_old = {name for _, line, name, _ in readme_rows() if "not re-run:" in line}
    problems = []
    for name, paths in sorted(MEASURES.items()):
        commit = json.loads((RESULTS / name).read_text())["commit"]
        try:
            _git("cat-file", "-e", f"{commit}^{{commit}}")
        except subprocess.CalledProcessError:
            problems.append(f"{name}: its commit {commit[:7]} is not in this repository's history")
            continue
        changes = later_changes(commit, paths)
        if changes and name not in why_old:
            problems.append(f"{name} was measured at {commit[:7]}; since then {len(changes)} commit(s) changed "
                            f"what it measures (newest: {changes[0]}). Re-run its benchmark, or say in its README "
                            f"row why not (\"not re-run: ...\").")
    assert not problems, "\n".join(problems)


@pytest.mark.skipif(not _has_history(), reason="needs a git checkout with its history")
def test_a_change_to_measured_code_is_seen():
    first = _git("rev-list", "--max-parents=0", "HEAD").splitlines()[0]
    assert later_changes(first, ["marft_lg/serving/engine/hf.py"]), "the engine never changed since the first commit?"
    assert later_changes("HEAD", ["marft_lg"]) == []


def _leaves(obj: object) -> list[float]:
    """Every number in a results file."""
    if isinstance(obj, bool):
        return []
    if isinstance(obj, (int, float)):
        return [float(obj)]
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list) else []
    return [x for v in items for x in _leaves(v)]


def _in_file(text: str, k: str | None, values: list[float]) -> bool:
    """Whether the figure `text` (as written: its decimals say its precision) is a number of the file, in the file's
    unit or scaled (k, %, MB -> GB)."""
    figure = float(text.replace(",", ""))  # signed: -0.07 is not 0.07
    half = 0.5 * 10 ** -(len(text.split(".")[1]) if "." in text else 0) + 1e-9
    scales = (1000.0,) if k else (1.0, 0.01, 1024.0, 1000.0)
    return any(abs(v / s - figure) <= half for v in values for s in scales)


def stale_figures(rows: list[tuple[int, str, str, str]]) -> list[str]:
    """The figures of README's benchmark rows (each row's result, before any remark) that its results file lacks."""
    problems = []
    for n, line, name, _ in rows:
        head = re.split(r"[(;]", line.split("|")[3])[0]
        if "≤" in head or not name or not (RESULTS / name).exists():
            continue
        values = _leaves(json.loads((RESULTS / name).read_text()))
        for m in re.finditer(r"((?<![\w.])-)?(\d[\d,]*(?:\.\d+)?)(k)?", head):  # a minus sign, not a range's dash
            if not _in_file((m.group(1) or "") + m.group(2), m.group(3), values):
                problems.append(f"README.md:{n}: {m.group(0)} is not in {name} ({head.strip()[:60]})")
    return problems


def test_every_benchmark_figure_is_read_from_its_results_file():
    problems = stale_figures(readme_rows())
    assert not problems, "\n".join(problems)


def test_a_planted_stale_figure_is_caught():
    rows = [r for r in readme_rows() if r[2] == "serving.json"]
    n, line, name, commit = rows[0]
    cells = line.split("|")
    planted = "|".join([*cells[:3], " 9.87× / 6.54× ", *cells[4:]])
    assert len(stale_figures([(n, planted, name, commit)])) == 2
    assert _in_file("-0.081", None, [-0.08125]) and not _in_file("-0.081", None, [0.08125])  # the sign counts
