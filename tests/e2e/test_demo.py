"""`marft-lg demo` end to end on the real embedded model (smoke budget): every stage runs, the report
exists, and its numbers agree with the run's own logs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory, embedded_model_dir):
    root = tmp_path_factory.mktemp("demo")
    run_dir, traces = root / "run", root / "traces"
    proc = subprocess.run(
        [sys.executable, "-m", "marft_lg.cli", "demo", "--budget", "smoke", "--run-dir", str(run_dir),
         "--trace-root", str(traces)],
        capture_output=True, text=True, timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return run_dir, proc.stdout


def _log(run_dir):
    return {row["event"]: row for row in map(json.loads, (run_dir / "demo_log.jsonl").read_text().splitlines())}


def test_report_and_plots_exist_and_say_where(demo_run):
    run_dir, stdout = demo_run
    report = run_dir / "report.md"
    assert report.exists()
    assert str(report) in stdout.replace("\n", "")
    text = report.read_text()
    assert "smoke" in text and "too little training" in text
    for png in ("train/reward.png", "train/agents.png", "compare/plots/component_deltas.png",
                "compare/plots/agent_deltas.png"):
        assert (run_dir / png).stat().st_size > 1000, png
        assert png in text
    assert (run_dir / "compare" / "report.html").exists()


def test_report_numbers_match_the_logs(demo_run):
    run_dir, _ = demo_run
    summary = json.loads((run_dir / "summary.json").read_text())
    log = _log(run_dir)
    metrics = [json.loads(line) for line in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()]

    # traced -> mined: every untuned episode was traced and mined, with both agents acting
    assert summary["episodes_traced"] == log["traced"]["episodes"] == summary["episodes_mined"]
    assert set(summary["actions_per_agent"]) == {"reasoner", "actor"}
    assert summary["actions_per_agent"]["actor"] == summary["episodes_mined"]
    # training curve in the report = the trainer's metrics log = offline + online iterations of the demo log
    assert summary["train_reward_curve"] == [m["reward_mean"] for m in metrics]
    assert len(metrics) == log["offline"]["iterations"] + log["online"]["iterations"] >= 2
    assert {m["phase"] for m in metrics} == {"offline", "online"}
    # the comparison numbers in the summary are those the comparison logged
    assert summary["heldout"]["pairs"] == log["compare"]["n_pairs"] == summary["budget"]["n_heldout"]
    assert summary["heldout"]["difference"] == log["compare"]["team_reward"]
    assert summary["heldout"]["baseline_reward"] == pytest.approx(log["compare"]["baseline_reward_mean"])
    # every reported iteration reward appears in the report table
    text = (run_dir / "report.md").read_text()
    for i, r in enumerate(summary["train_reward_curve"]):
        assert f"| {i} | {r:.3f} |" in text


def test_gate_decision_matches_the_registry(demo_run):
    run_dir, _ = demo_run
    summary = json.loads((run_dir / "summary.json").read_text())
    decision = json.loads((run_dir / "decision.json").read_text())
    aliases = json.loads((run_dir / "registry" / "aliases.json").read_text())
    assert decision["promote"] == summary["gate"]["promote"]
    live = summary["versions"]["live"]
    expected = summary["versions"]["tuned"] if decision["promote"] else summary["versions"]["untuned"]
    assert live == expected
    assert aliases["aliases"]["live"] == live
    if not decision["promote"]:
        assert decision["reasons"]
