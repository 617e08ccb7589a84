"""`marft-lg demo` end to end on the real embedded model (smoke budget), from an installed wheel: the package is
built, installed into a fresh venv (its dependencies from this environment) and run from a temp dir outside the
checkout; every stage runs, the report exists, and its numbers agree with the run's own logs; the held-out curve
(`--curve-every`) replays the run's published teams into the report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.gate_decision import assert_decision_follows_from_the_comparison

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


def _installed_wheel(root: Path) -> Path:
    """A fresh venv holding the built wheel of this checkout (not the editable install); returns its bin dir."""
    dist = root / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
                    str(REPO)], check=True, capture_output=True, text=True, timeout=600)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    bin_dir = venv / "bin"
    site = Path(subprocess.run([str(bin_dir / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # the dependencies (torch, transformers, ...) come from this environment, after the venv's own packages
    (site / "_deps_from_test_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    wheels = sorted(dist.glob("marft_lg-*.whl"))
    assert wheels, f"no wheel built in {dist}"
    subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheels[-1])],
                   check=True, timeout=300)
    return bin_dir


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory, embedded_model_dir):
    root = tmp_path_factory.mktemp("demo")
    bin_dir = _installed_wheel(root)
    away = root / "elsewhere"
    away.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = subprocess.run([str(bin_dir / "python"), "-c", "import marft_lg, marft_lg.examples.math_team as m; "
                            "print(marft_lg.__file__); print(m.__file__)"], cwd=away, env=env, check=True,
                           capture_output=True, text=True).stdout
    assert str(REPO) not in where and str(root / "venv") in where, where  # the wheel, not the checkout
    run_dir, traces = root / "run", root / "traces"
    proc = subprocess.run(
        [str(bin_dir / "marft-lg"), "demo", "--budget", "smoke", "--run-dir", str(run_dir), "--trace-root", str(traces),
         "--curve-every", "1"],
        capture_output=True, text=True, timeout=1500, cwd=away, env=env,
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
    page = (run_dir / "report.html").read_text()
    assert '<img src="train/reward.png"' in page and "<table>" in page
    assert "answer accuracy" in text and "minimum detectable gain" in text
    assert "held-out answer accuracy" in stdout and "smallest gain detectable" in stdout
    # printed last: the decision with its reason, then where the report is (then, asked for here, the curve's line,
    # which names the report again)
    last = stdout[stdout.rindex("decision: "):]
    assert ("PROMOTE" in last or "REJECT" in last) and "report:" in last and "beside it)" in last
    assert stdout.rstrip().endswith(f"report {report}, plot {run_dir / 'curve.png'}")


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
    # the comparison's untuned side ran before on-policy training, timed; the on-policy stage got what the deadline
    # left after it and the comparison stage (1.2 times as long), never more than the budget's cap
    assert log["untuned_heldout"]["episodes"] == summary["budget"]["n_heldout"]
    assert log["untuned_heldout"]["elapsed_s"] <= log["online_budget"]["elapsed_s"] <= log["online"]["elapsed_s"]
    plan = summary["online_budget"]
    assert plan == {k: v for k, v in log["online_budget"].items() if k not in ("event", "elapsed_s")}
    assert plan["tuned_side_s"] == pytest.approx(1.2 * log["untuned_heldout"]["seconds"], abs=0.1)
    assert log["compare"]["predicted_s"] == plan["tuned_side_s"] and log["compare"]["stage_s"] > 0
    assert f"  - on-policy MARFT given {plan['online_s'] / 60:.1f} min (what the deadline left;" in (
        run_dir / "report.md").read_text()
    left = plan["deadline_s"] - plan["spent_s"] - plan["tuned_side_s"] - plan["reserve_s"]
    assert plan["online_s"] == pytest.approx(max(0.0, min(plan["cap_s"], left)), abs=0.2)
    # traced problems only for the offline stage; on-policy drew fresh ones; both sides' accuracy and the MDE
    # cover every held-out pair
    assert summary["problems"]["traced"] == summary["budget"]["n_traced"]
    assert summary["episodes_traced"] == summary["budget"]["n_traced"] * summary["budget"]["traces_per_problem"]
    assert summary["problems"]["online_seen"] == log["online"]["problems_seen"] <= summary["problems"]["stream"]
    for side in ("baseline", "candidate"):
        acc = summary["heldout"]["accuracy"][side]
        assert acc["n"] == summary["heldout"]["pairs"] and 0 <= acc["strict"] <= 1 and 0 <= acc["lenient"] <= 1
    assert summary["heldout"]["mde"]["n"] == summary["heldout"]["pairs"]
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
    # whichever way it went, it follows from the comparison's numbers
    assert_decision_follows_from_the_comparison(run_dir, _log(run_dir)["compare"])


def test_the_curve_replays_the_published_teams_into_the_report(demo_run):
    run_dir, stdout = demo_run
    summary = json.loads((run_dir / "summary.json").read_text())
    curve = json.loads((run_dir / "curve.json").read_text())
    metrics = [json.loads(line) for line in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()]
    online = [m for m in metrics if m["phase"] == "online"]
    assert [c["iteration"] for c in curve["checkpoints"]] == [m["iteration"] for m in online]  # every 1st
    last = curve["checkpoints"][-1]
    assert last["versions"] == summary["versions"]["tuned"] and last["n"] == summary["heldout"]["pairs"]
    assert last["online_minutes"] == pytest.approx(sum(m["rollout_s"] + m["time_s"] for m in online) / 60, abs=1e-3)
    # the demo's own greedy comparison replayed; the engine batches rows as threads arrive, so one problem's reward
    # (at most 2.0: answer, format, set-up) may differ
    assert abs(last["mean"] - summary["heldout"]["difference"]["mean"]) <= 2.0 / last["n"] + 1e-9
    assert summary["curve"]["checkpoints"] == curve["checkpoints"]
    assert summary["versions"]["live"] == json.loads((run_dir / "registry" / "aliases.json").read_text())[
        "aliases"]["live"]  # the replays only read the registry
    assert (run_dir / "curve.png").read_bytes()[:4] == b"\x89PNG"
    assert "![held-out gain over training time](curve.png)" in (run_dir / "report.md").read_text()
    assert '<img src="curve.png"' in (run_dir / "report.html").read_text()
    assert "min of replays" in stdout  # the curve's closing line


def test_the_demo_benchmark_splits_the_answers_by_set_up(demo_run):
    """benchmarks/demo.py's `setup_split` re-scores the comparison's traces: its answer rates are the comparison's."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo_bench", REPO / "benchmarks" / "demo.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    run_dir, _ = demo_run
    summary = json.loads((run_dir / "summary.json").read_text())
    split = bench.setup_split(run_dir, summary)
    assert set(split) == {"baseline", "candidate"}
    for side in split.values():
        assert side["n"] == summary["heldout"]["pairs"]
        parts = [(side["setup"], side["answer_given_setup"]), (1 - side["setup"], side["answer_without_setup"])]
        assert sum(w * (a or 0.0) for w, a in parts) == pytest.approx(side["answer"], abs=1e-3)
    delta = _log(run_dir)["compare"]["components"]["task_completion"]["mean"]
    assert split["candidate"]["answer"] - split["baseline"]["answer"] == pytest.approx(delta, abs=1e-3)
