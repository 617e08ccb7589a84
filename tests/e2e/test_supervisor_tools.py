"""examples/supervisor_tools: a supervisor + two prebuilt ReAct workers on plain ChatOpenAI, its whole loop from the
CLI on the real 135M model: serve, run, mine, score, train (offline + online), compare, promote, rollback, retrain.
No PYTHONPATH and no glue file: the configs in the example's folder are all it takes (run here on fewer scenarios,
`_smaller_budget`: every stage and command is the example's, on less data)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from examples.wrap_existing.run import free_port, start_process, stop_server
from tests.gate_decision import assert_decision_follows_from_the_comparison

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.slow]
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "supervisor_tools"
CLI = [sys.executable, "-m", "marft_lg.cli"]


def _cli(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 600) -> str:
    t0 = time.perf_counter()
    proc = subprocess.run([*CLI, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    print(f"marft-lg {args[0]}: {time.perf_counter() - t0:.1f} s")  # where the minutes go (pytest -s / on failure)
    assert proc.returncode == 0, f"marft-lg {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout + proc.stderr


ONLINE_SCENARIO = {"scenario_id": "mul-3-3", "inputs": {"messages": [{"role": "user", "content": "What is 3 times 3?"}]},
                   "reference": "9", "split": "online"}
TRACED = ("fact-otel", "add-2-3")  # the train-split scenarios the test runs: a fact and an arithmetic question


def _smaller_budget(work: Path) -> None:
    """The example's configs with a test's budget (the same app, commands, trainer, job and gate; CPU minutes matter
    here, each action's prompt is ~450-600 tokens): `run` traces 2 of the 4 train-split scenarios (a fact and a sum;
    `train` and `retrain` train offline on those 2 episodes); `train`'s online phase runs one scenario of its own (2
    episodes of the group) from `train_scenarios.jsonl`; `compare` replays the 2 held-out scenarios
    (scenarios_heldout.jsonl), as the job's compare does."""
    rows = [json.loads(line) for line in (work / "scenarios.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if r["split"] == "train" and r["scenario_id"] in TRACED]
    heldout = [r for r in rows if r["split"] == "heldout"]
    assert len(train) == 2 and len(heldout) == 2, "the example's scenarios changed: update this budget"
    (work / "scenarios.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*train, *heldout]))
    (work / "train_scenarios.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*train, ONLINE_SCENARIO]))
    (work / "scenarios_heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in heldout))
    text = (work / "train.yaml").read_text()
    for old, new in (("scenarios: scenarios.jsonl", "scenarios: train_scenarios.jsonl"),
                     ("split: train}", "split: online}")):
        assert text.count(old) == 1, f"train.yaml has no single {old!r}: update this budget"
        text = text.replace(old, new)
    (work / "train.yaml").write_text(text)


def test_the_whole_loop_runs_from_the_cli(tmp_path):
    work = tmp_path / "supervisor_tools"
    shutil.copytree(EXAMPLE, work, ignore=shutil.ignore_patterns("runs", "traces", "registry", "__pycache__"))
    _smaller_budget(work)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    port = free_port()
    env["OPENAI_BASE_URL"] = f"http://127.0.0.1:{port}/v1"
    agents = "supervisor,researcher,mathematician"
    server = start_process([*CLI, "serve", "--agents", agents, "--registry", "registry", "--create-registry",
                            "--port", str(port)],
                           f"http://127.0.0.1:{port}/health", tmp_path / "serve.log", cwd=work, env=env)
    try:
        out = _cli(["run", "--app", "app.py:graph", "--scenarios", "scenarios.jsonl", "--split", "train"], work, env)
        assert "ran 2 episodes (0 failed)" in out
        _cli(["mine", "traces", "--out", "data"], work, env)
        actions = pd.read_parquet(work / "data" / "actions.parquet")
        assert set(actions["agent"]) <= {"supervisor", "researcher", "mathematician"}
        assert "supervisor" in set(actions["agent"]) and len(set(actions["agent"])) >= 2  # it routed to a worker
        routes = {"transfer_to_researcher", "transfer_to_mathematician", "finish"}
        for row in actions[actions["agent"] == "supervisor"].to_dict("records"):  # every hand-off a parsed call
            calls = json.loads(row["tool_calls"])
            assert [c["name"] in routes and not c.get("error") for c in calls] == [True], row["completion"]
            assert json.loads(row["constraint"])["choice"] == "required" and row["tool_errors"] == 0
        assert (actions.groupby("episode_id")["step"].apply(lambda s: list(s) == sorted(s))).all()
        _cli(["score", "data", "--reward", "reward.yaml", "--scenarios", "scenarios.jsonl", "--out", "scores.parquet"],
             work, env)
        assert len(pd.read_parquet(work / "scores.parquet")) == 2

        out = _cli(["train", "--config", "train.yaml"], work, env, timeout=900)
        assert "saved as alias 'candidate'" in out
        rows = [json.loads(line) for line in (work / "runs" / "train" / "metrics.jsonl").read_text().splitlines()]
        assert [(r["phase"], r["episodes"]) for r in rows] == [("offline", 2), ("online", 2)]  # both phases ran
        out = _cli(["compare", "--baseline", "live", "--candidate", "candidate", "--scenarios",
                    "scenarios_heldout.jsonl", "--app", "app.py:build_graph", "--reward", "reward.yaml", "--registry",
                    "registry", "--agents", agents, "--max-tokens", "48", "--out", "runs/compare", "--no-drift"],
                   work, env, timeout=900)
        decision = assert_decision_follows_from_the_comparison(work / "runs" / "compare")
        assert f"gate: {decision['decision'].upper()}" in out  # what the terminal said is what the file says
        from marft_lg.trajectories.mining import mine

        replayed = mine([work / "runs" / "compare" / "traces"]).actions
        sup = replayed[replayed["agent"] == "supervisor"]
        assert len(sup) and (sup["tool_errors"] == 0).all()  # replays hand off with forced calls too

        server_url = f"http://127.0.0.1:{port}"
        out = _cli(["promote", "--registry", "registry", "--versions", "candidate", "--force", "--server", server_url,
                    "--reason", "e2e"], work, env)
        live = json.loads((work / "registry" / "aliases.json").read_text())["aliases"]["live"]
        updated = {a for r in rows for a in r.get("updated_agents", [])}  # a role no step reached keeps its version
        assert "supervisor" in updated and live == {a: "v1" for a in updated}
        _cli(["rollback", "--registry", "registry", "--server", server_url], work, env)
        assert not json.loads((work / "registry" / "aliases.json").read_text())["aliases"].get("live")
        _cli(["promote", "--registry", "registry", "--versions", "candidate", "--force", "--reason", "retrain from it"],
             work, env)

        # no watermark yet: the job's first run mines the traces recorded above (a second `run` would add nothing)
        out = _cli(["retrain", "--job", "job.yaml"], work, env, timeout=1200)
        runs = list((work / "runs" / "retrain").glob("*/"))
        assert runs, out
    finally:
        stop_server(server)
