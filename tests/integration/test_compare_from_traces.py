"""`marft-lg compare --from-traces`, `promote` and `rollback` through the CLI, on traces mirrored by a
real wrapped graph (tiny random Llama, Team + registry, wrap(shadow=..., sample_rate=1))."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared graph, under any pytest import mode
from test_compare_gate import ROLES, build_graph  # noqa: E402


@pytest.fixture(scope="module")
def mirrored(tiny_model_dir, tmp_path_factory):
    from marft_lg.graph.chat_model import TeamChatModel
    from marft_lg.graph.wrap import wrap
    from marft_lg.serving.engine.models import model_fingerprint
    from marft_lg.serving.registry.lora import LoraSettings, write_fresh_adapter
    from marft_lg.serving.registry.store import AdapterRegistry
    from marft_lg.serving.team import Team

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("mirrored")
    reg = AdapterRegistry(root / "registry")
    fp = model_fingerprint(tiny_model_dir)
    for seed, init in ((0, True), (1, False)):
        d = write_fresh_adapter(tiny_model_dir, LoraSettings(r=2, init=init), root / f"a{seed}", seed=seed)
        for role in ROLES:
            reg.save(role, d, base_fingerprint=fp)
    reg.promote({"planner": "v1", "writer": "v1"})
    reg.set_alias("candidate", {"writer": "v2"})
    team = Team(tiny_model_dir, ROLES, registry=reg)
    app = wrap(build_graph(TeamChatModel(team=team, temperature=0.0, max_tokens=6)), team=team,
               trace_dir=root / "traces", shadow={"writer": "v2"}, sample_rate=1.0, shadow_seed=0)
    answers = [app.invoke({"question": f"What is {i} plus {i}?"}) for i in range(6)]
    assert app.wait_for_shadows(120)
    app.close()
    team.close()
    reward = root / "reward.yaml"
    reward.write_text(yaml.safe_dump({"weights": {"format_compliance": 1.0}, "components": {
        "format_compliance": {"agents": {"writer": {"regex": r"ANSWER: \d+", "fullmatch": True}}}}}))
    return {"root": root, "reg": reg, "answers": answers, "reward": reward}


def test_compare_from_traces_pairs_live_and_shadow(mirrored):
    from marft_lg.evaluation.shadow import compare_mirrored
    from marft_lg.rewards.composite import CompositeReward

    res = compare_mirrored(mirrored["root"] / "traces", CompositeReward.from_yaml(mirrored["reward"]))
    assert res.n_pairs == 6 and not any(res.unmatched.values())
    assert res.meta["baseline"]["writer"] == ["v1"] and res.meta["candidate"]["writer"] == ["v2"]
    assert res.meta["candidate"]["planner"] == ["v1"]
    assert res.episode_metrics["steps"].mean == 0.0  # same graph, same number of agent steps


def test_cli_compare_promote_rollback(mirrored, tmp_path):
    from marft_lg.cli import app

    runner = CliRunner()
    out = tmp_path / "run"
    r = runner.invoke(app, ["compare", "--from-traces", str(mirrored["root"] / "traces"), "--reward",
                            str(mirrored["reward"]), "--out", str(out)])
    assert r.exit_code == 0, r.output
    decision = json.loads((out / "decision.json").read_text())
    assert decision["decision"] == "reject"  # no gain: the CI lower bound is not above zero
    assert any("lower bound must be > 0" in reason for reason in decision["reasons"])
    for name in ("report.md", "report.html", "comparison.json", "plots/component_deltas.png"):
        assert (out / name).exists(), name
    assert "REJECT" in r.output

    reg = str(mirrored["reg"].root)
    r = runner.invoke(app, ["promote", "--registry", reg, "--decision", str(out)])
    assert r.exit_code == 1 and "not promoted" in r.output
    assert mirrored["reg"].alias("live") == {"planner": "v1", "writer": "v1"}
    r = runner.invoke(app, ["promote", "--registry", reg, "--force", "--decision", str(out), "--reason", "test"])
    assert r.exit_code == 0, r.output
    assert mirrored["reg"].alias("live") == {"planner": "v1", "writer": "v2"}
    r = runner.invoke(app, ["rollback", "--registry", reg])
    assert r.exit_code == 0, r.output
    assert mirrored["reg"].alias("live") == {"planner": "v1", "writer": "v1"}
    records = [json.loads(x) for x in (mirrored["reg"].root / "promotions.jsonl").read_text().splitlines()]
    assert [x["action"] for x in records][-2:] == ["promote", "rollback"]
    assert records[-2]["reason"].startswith("FORCED")


def test_cli_compare_replays_scenarios_through_an_app_factory(mirrored, tiny_model_dir, tmp_path):
    from marft_lg.cli import app
    from marft_lg.trajectories.scenarios import Scenario, ScenarioSet

    scen = tmp_path / "scenarios.jsonl"
    ScenarioSet(Scenario(f"s{i}", {"question": f"What is {i} plus {i}?"}) for i in range(5)).save(scen)
    out = tmp_path / "replay"
    factory = f"{Path(__file__).with_name('test_compare_gate.py')}:build_graph"
    r = CliRunner().invoke(app, [
        "compare", "--app", factory, "--registry", str(mirrored["reg"].root), "--model", tiny_model_dir,
        "--baseline", "live", "--candidate", "writer=v2", "--scenarios", str(scen), "--reward", str(mirrored["reward"]),
        "--temperature", "0", "--max-tokens", "4", "--out", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads((out / "comparison.json").read_text())
    assert data["n_pairs"] == 5 and data["meta"]["candidate"] == {"planner": "v1", "writer": "v2"}
    assert data["drift"]["writer"]["kl"] > 0 and data["drift"]["planner"]["kl"] < 1e-6
    assert list((out / "traces").glob("*.jsonl"))
