"""examples/mixed_team: a frozen external planner and two trained workers on two base models (SmolLM2-135M and a
small model with another tokenizer), the whole loop from the CLI: serve both bases, run, mine, score, train
(offline + online), compare. The planner is traced as the environment and never trained."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from examples.wrap_existing.run import free_port, start_process, stop_server
from tests.gate_decision import assert_decision_follows_from_the_comparison

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.slow]
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "mixed_team"
CLI = [sys.executable, "-m", "marft_lg.cli"]


def _cli(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 600) -> str:
    proc = subprocess.run([*CLI, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"marft-lg {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout + proc.stderr


def test_frozen_planner_and_two_bases_from_the_cli(tmp_path):
    work = tmp_path / "mixed_team"
    shutil.copytree(EXAMPLE, work, ignore=shutil.ignore_patterns("runs", "traces", "registry", "bases", "data",
                                                                 "__pycache__"))
    # compare replays the 4 test-split scenarios (not all 8, the 4 traced ones included): the report needs no more
    rows = [json.loads(line) for line in (work / "scenarios.jsonl").read_text().splitlines() if line.strip()]
    held_out = [r for r in rows if r["split"] == "test"]
    assert len(held_out) == 4, "the example's scenarios changed: update the compare set"
    (work / "scenarios_test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in held_out))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "make_base.py", "bases/checker"], cwd=work, env=env, check=True,
                   capture_output=True, timeout=300)
    port, ext_port = free_port(), free_port()
    env["OPENAI_BASE_URL"] = f"http://127.0.0.1:{port}/v1"
    env["EXTERNAL_BASE_URL"] = f"http://127.0.0.1:{ext_port}/v1"
    agents = "solver=embedded:smollm2-135m-instruct,checker=bases/checker"
    external = start_process([sys.executable, "external.py", "--port", str(ext_port)],
                             f"http://127.0.0.1:{ext_port}/health", tmp_path / "external.log", cwd=work, env=env)
    server = None
    try:
        server = start_process([*CLI, "serve", "--agents", agents, "--registry", "registry", "--create-registry",
                                "--port", str(port)],
                               f"http://127.0.0.1:{port}/health", tmp_path / "serve.log", cwd=work, env=env)
        out = _cli(["run", "--app", "app.py:graph", "--scenarios", "scenarios.jsonl", "--split", "train"], work, env)
        assert "ran 4 episodes (0 failed)" in out
        _cli(["mine", "traces", "--out", "data"], work, env)
        actions = pd.read_parquet(work / "data" / "actions.parquet")
        assert set(actions["agent"]) == {"planner", "solver", "checker"}
        for _, episode in actions.groupby("episode_id"):
            acts = {a["agent"]: a for a in episode.to_dict("records")}
            planner = acts["planner"]  # the external API: text and usage only
            assert planner["completion_token_ids"] is None or len(planner["completion_token_ids"]) == 0
            assert planner["completion_logprobs"] is None or len(planner["completion_logprobs"]) == 0
            assert planner["order"] in list(acts["solver"]["depends_on"])
            assert acts["solver"]["order"] in list(acts["checker"]["depends_on"])
            # the model that answered: the hosted one, and each worker's base (the server's record, joined)
            assert planner["model"] == "external-planner"
            assert (acts["solver"]["model"], acts["checker"]["model"]) == ("embedded:smollm2-135m-instruct", "checker")
            for worker in ("solver", "checker"):  # served by marft-lg: the exact tokens and their log-probs
                ids, lps = acts[worker]["completion_token_ids"], acts[worker]["completion_logprobs"]
                assert ids is not None and 0 < len(ids) == len(lps) == acts[worker]["output_tokens"]
                assert all(lp <= 0.0 for lp in lps)
                assert len(acts[worker]["prompt_token_ids"]) == acts[worker]["input_tokens"] > 0  # as it rendered
                assert acts[worker]["adapter_version"] == "init"
        _cli(["score", "data", "--reward", "reward.yaml", "--scenarios", "scenarios.jsonl", "--out", "scores.parquet"],
             work, env)
        assert len(pd.read_parquet(work / "scores.parquet")) == 4

        out = _cli(["train", "--config", "train.yaml"], work, env, timeout=900)
        assert "saved as alias 'candidate'" in out
        aliases = json.loads((work / "registry" / "aliases.json").read_text())["aliases"]
        assert set(aliases["candidate"]) == {"solver", "checker"}  # the planner is never trained
        manifests = {role: json.loads((work / "registry" / role / version / "manifest.json").read_text())
                     for role, version in aliases["candidate"].items()}
        bases = {role: m["base_name"] for role, m in manifests.items()}
        assert bases == {"solver": "embedded:smollm2-135m-instruct", "checker": "checker"}  # each on its own base
        assert manifests["solver"]["base_hash"] != manifests["checker"]["base_hash"]
        rows = [json.loads(line) for line in (work / "runs" / "train" / "metrics.jsonl").read_text().splitlines()]
        assert rows and all(r["frozen_agents"] == ["planner"] for r in rows)
        # the traces hold each worker's tokens and log-probs: the offline phase uses them as recorded
        offline = [r for r in rows if r["phase"] == "offline"]
        assert offline and all(r["recomputed"] == {} and r["skipped"] == {} for r in offline)
        assert all(r["retokenised"] == {} for r in rows)  # no prompt re-rendered: the server's ids, offline and online
        assert all(r["agent_bases"] == bases for r in rows)
        assert {a for r in rows for a in r["trained_agents"]} == {"solver", "checker"}  # agent by agent, across bases

        out = _cli(["compare", "--baseline", "live", "--candidate", "candidate", "--scenarios", "scenarios_test.jsonl",
                    "--app", "app.py:build_graph", "--reward", "reward.yaml", "--registry", "registry", "--agents",
                    agents, "--max-tokens", "24", "--out", "runs/compare", "--no-drift"], work, env, timeout=900)
        decision = assert_decision_follows_from_the_comparison(work / "runs" / "compare")
        assert f"gate: {decision['decision'].upper()}" in out  # what the terminal said is what the file says
        report = (work / "runs" / "compare" / "report.md").read_text()
        assert "Agents and their base models" in report and "planner" in report
        for role, base in bases.items():
            assert f"| {role} | {base} |" in report
    finally:
        if server is not None:
            stop_server(server)
        stop_server(external)
