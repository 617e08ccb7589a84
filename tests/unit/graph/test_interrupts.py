"""An app that calls `interrupt()`: the run that stops there is paused (not finished), the run that resumes its
thread continues the same episode (the resume value on it, the agents after it ordered after and dependent on the
ones before), through `TeamChatModel` and plain `ChatOpenAI` against the served team, streaming included, with
an in-memory and a SQLite checkpointer; the project's runners drive it with a resume policy and say so."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from chatopenai_apps import scripted
from cli_text import flat
from graph_fakes import FakeEngine
from hitl_apps import build, drafter_app
from langgraph.types import Command
from typer.testing import CliRunner

from marft_lg.graph.app_spec import AppSpec
from marft_lg.graph.chat_model import TeamChatModel
from marft_lg.graph.collect import GraphCollector, RolloutError, plan_episodes
from marft_lg.graph.interrupts import ResumePolicy, policy_from_flags
from marft_lg.graph.wrap import wrap
from marft_lg.serving.team import Team
from marft_lg.trajectories.mining import mine
from marft_lg.trajectories.scenarios import Scenario

HERE = Path(__file__).parent
TOPIC = {"topic": "cats"}


def _checkpointer(kind: str, tmp_path: Path):
    if kind == "memory":
        return None  # the app's own InMemorySaver
    from langgraph.checkpoint.sqlite import SqliteSaver

    return SqliteSaver(sqlite3.connect(tmp_path / "threads.sqlite", check_same_thread=False))


def _fake_app(tmp_path: Path, kind: str = "memory", **wrap_kw):
    engine = FakeEngine(agents=("drafter", "reviser"))
    llm = TeamChatModel(team=engine)
    graph = drafter_app(llm, llm, _checkpointer(kind, tmp_path))
    return wrap(graph, team=engine, trace_dir=tmp_path / "traces", node_roles={"drafter": "drafter",
                                                                               "reviser": "reviser"}, **wrap_kw)


def _mined(app, tmp_path: Path):
    app.flush()
    return mine([tmp_path / "traces"])


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_a_rejected_draft_is_one_episode_with_the_resume_value_and_the_reviser_after_the_drafter(tmp_path, kind):
    app = _fake_app(tmp_path, kind)
    thread = {"configurable": {"thread_id": "conv-1"}}
    first = app.invoke(TOPIC, thread)
    assert "__interrupt__" in first
    paused = _mined(app, tmp_path)
    [row] = paused.episodes.to_dict("records")
    assert row["status"] == "paused" and row["metadata"]["paused"] is True
    assert row["metadata"]["interrupts"][0]["value"]["draft"] == first["draft"]
    # the person rejects the draft later; the app streams the rest to them
    chunks = list(app.stream(Command(resume="rejected"), thread, stream_mode="updates"))
    assert any("reviser" in c for c in chunks)
    app.close()
    ds = _mined(app, tmp_path)
    [row] = ds.episodes.to_dict("records")
    assert row["status"] == "ok" and row["metadata"]["resumes"] == ["rejected"] and row["metadata"]["paused"] is False
    assert len(row["trace_ids"]) == 2  # two runs, one episode
    acts = ds.actions.sort_values("order")
    assert list(acts["agent"]) == ["drafter", "reviser"]
    assert list(acts["depends_on"].iloc[1]) == [0]
    assert acts["step"].iloc[1] > acts["step"].iloc[0]


def test_an_approving_resume_with_no_llm_call_still_finishes_the_episode(tmp_path):
    app = _fake_app(tmp_path)
    thread = {"configurable": {"thread_id": "conv-2"}}
    app.invoke(TOPIC, thread)
    app.invoke(Command(resume="approved"), thread)
    app.close()
    ds = _mined(app, tmp_path)
    [row] = ds.episodes.to_dict("records")
    assert row["status"] == "ok" and row["metadata"]["resumes"] == ["approved"] and row["n_actions"] == 1


def test_a_new_turn_on_the_thread_is_a_new_episode_unless_episodes_are_per_conversation(tmp_path):
    for episodes, expected in (("turn", 2), ("conversation", 1)):
        app = _fake_app(tmp_path / episodes, episodes=episodes)
        thread = {"configurable": {"thread_id": "conv-3"}}
        for _ in range(2):
            app.invoke(TOPIC, thread)
            app.invoke(Command(resume="approved"), thread)
        app.close()
        assert len(_mined(app, tmp_path / episodes)) == expected, episodes


def test_the_collector_resumes_with_the_policy_and_counts_what_stayed_paused(tmp_path):
    scenarios = [Scenario("cats", TOPIC), Scenario("dogs", {"topic": "dogs"})]
    jobs = plan_episodes("r", scenarios, 1, 0, 0)
    seen = []
    app = _fake_app(tmp_path / "resumed", resume=lambda payload: seen.append(payload) or "rejected")
    collector = GraphCollector(app, concurrency=2)
    ds = collector.run(jobs)
    app.close()
    assert collector.resumes == 2 and collector.paused == [] and len(seen) == 2 and "draft" in seen[0]
    assert sorted(ds.episodes["status"]) == ["ok", "ok"] and len(ds.actions) == 4
    assert all(m["resumes"] == ["rejected"] for m in ds.episodes["metadata"])

    app = _fake_app(tmp_path / "paused")
    collector = GraphCollector(app, concurrency=2)
    with pytest.raises(RolloutError, match="2 of 2 episodes stopped at an interrupt.*no resume policy"):
        collector.collect(scenarios, 1, 0, 0)
    app.close()
    assert sorted(collector.paused) == sorted(j.episode_id.replace("-it0-", "-it0-") for j in
                                              plan_episodes(collector.run_id, scenarios, 1, 0, 0))


def test_resume_policies_are_checked_and_loaded():
    assert ResumePolicy.of({"value": "approved"}).answer({"draft": "x"}) == "approved"
    assert ResumePolicy.of({"call": "hitl_apps:reject_once"}).answer({"draft": "x"}) == "rejected"
    assert policy_from_flags('{"ok": true}', None).value == {"ok": True}
    assert policy_from_flags("approved", None).value == "approved"
    assert policy_from_flags(None, None) is None
    for bad in ({"valu": 1}, {"value": 1, "max_resumes": 0}, "approved", {"call": 3}):
        with pytest.raises((ValueError, TypeError)):
            ResumePolicy.of(bad)
    with pytest.raises(ValueError, match="give one"):
        policy_from_flags("a", "m:f")
    two = ResumePolicy(value="ok").command([{"id": "a", "value": 1}, {"id": "b", "value": 2}])
    assert two.resume == {"a": "ok", "b": "ok"}


def test_train_yaml_and_job_yaml_take_a_resume_policy_and_refuse_a_bad_one(tmp_path):
    from marft_lg._config import ConfigError
    from marft_lg.jobs.config import RetrainJob

    with pytest.raises(ConfigError, match="resume"):
        RetrainJob(name="j", traces=["t"], resume={"answer": "approved"})
    assert RetrainJob(name="j", traces=["t"], resume={"value": "approved"}).resume == {"value": "approved"}
    spec = AppSpec(app="hitl_apps:build", agents=["drafter", "reviser"], base_dir=str(HERE),
                   resume={"call": "hitl_apps:reject_once"})
    assert spec.resume_policy().answer({"draft": "d"}) == "rejected"
    with pytest.raises(ConfigError, match="resume"):
        AppSpec(app="hitl_apps:build", agents=["drafter"], resume={"call": "hitl_apps:nothing_here"},
                base_dir=str(HERE)).resume_policy()


# ---- plain ChatOpenAI against the served team (tiny model) ----------------------------------------------------

@pytest.fixture()
def team(tiny_model_dir, tmp_path):
    t = Team(tiny_model_dir, ["drafter", "reviser"], registry=tmp_path / "registry", versions=None, seed=0)
    for role in ("drafter", "reviser"):
        t.load_version(role, t.save_version(role))
    scripted(t, {"drafter": ["Cats nap in the sun."], "reviser": ["Cats nap, then hunt."]})
    yield t
    t.close()


def test_a_chatopenai_app_resumed_by_stream_is_one_episode_with_the_servers_record(team, tmp_path):
    app = wrap(build(), team=team, trace_dir=tmp_path / "traces", serve_http=True)
    thread = {"configurable": {"thread_id": "desk-9"}}
    list(app.stream(TOPIC, thread, stream_mode="values"))
    list(app.stream(Command(resume={"verdict": "no"}), thread, stream_mode="updates"))
    app.close()
    ds = _mined(app, tmp_path)
    [row] = ds.episodes.to_dict("records")
    assert row["status"] == "ok" and row["metadata"]["resumes"] == [{"verdict": "no"}]
    acts = ds.actions.sort_values("order")
    assert list(acts["agent"]) == ["drafter", "reviser"] and list(acts["depends_on"].iloc[1]) == [0]
    assert set(acts["adapter_version"]) == {"v1"}  # the server's record of what it sampled, joined
    assert all(len(ids) > 0 for ids in acts["completion_token_ids"])


def test_on_policy_training_and_compare_drive_the_app_with_a_simulated_reviewer(team, tmp_path):
    from marft_lg.evaluation.shadow import shadow_compare
    from marft_lg.rewards.composite import CompositeReward
    from marft_lg.training.config import MARFTConfig
    from marft_lg.training.trainer import MARFTTrainer

    spec = AppSpec(app="hitl_apps:build", agents=["drafter", "reviser"], base_dir=str(HERE),
                   resume={"call": "hitl_apps:reject_once"})
    wrapped = spec.build_app(team, tmp_path / "traces")
    cfg = MARFTConfig(group_size=2, update_scheme="simultaneous", learning_rate=1e-2, plots=False, seed=1,
                      rollout_concurrency=2, behaviour_logprobs="recompute")
    reward = CompositeReward.from_yaml({"weights": {"step_count": -1.0}})
    trainer = MARFTTrainer(team, reward, cfg, tmp_path / "run", progress=False)
    [row] = trainer.fit_online(wrapped, [Scenario("cats", TOPIC)], iterations=1)
    assert row["episodes"] == 2 and trainer.update_steps["reviser"] > 0  # the reviser ran after each rejection
    team.save_version("drafter")
    result = shadow_compare(wrapped, {"drafter": "v1", "reviser": "v1"}, {"drafter": "v2"},
                            [Scenario("cats", TOPIC), Scenario("dogs", {"topic": "dogs"})], reward,
                            samples_per_scenario=1, drift=False, progress=False)
    wrapped.close()
    assert len(result.units) == 2
    assert set(result.datasets["candidate"].episodes["status"]) == {"ok"}

    unresumed = AppSpec(app="hitl_apps:build", agents=["drafter", "reviser"], base_dir=str(HERE)).build_app(
        team, tmp_path / "traces2")
    with pytest.raises(RolloutError, match="interrupt"):
        shadow_compare(unresumed, {"drafter": "v1"}, {"drafter": "v2"}, [Scenario("cats", TOPIC)], reward,
                       drift=False, progress=False)
    unresumed.close()


def test_marft_lg_run_resumes_with_the_flag_and_says_how_many_stayed_paused(tmp_path, monkeypatch):
    from marft_lg.cli import app as cli

    (tmp_path / "app.py").write_text(
        f"import sys\nsys.path.insert(0, {str(HERE)!r})\nfrom graph_fakes import FakeEngine\nfrom hitl_apps import drafter_app\n"
        "from marft_lg import TeamChatModel\n"
        "graph = drafter_app(TeamChatModel(team=FakeEngine(agents=('drafter', 'reviser'))),"
        " TeamChatModel(team=FakeEngine(agents=('drafter', 'reviser'))))\n")
    (tmp_path / "s.jsonl").write_text(json.dumps({"scenario_id": "cats", "inputs": TOPIC}) + "\n")
    monkeypatch.chdir(tmp_path)
    base = ["run", "--app", "app.py:graph", "--scenarios", "s.jsonl", "--samples", "2"]
    out = CliRunner().invoke(cli, [*base, "--trace-dir", "paused"])
    assert out.exit_code == 0, out.output
    assert "2 paused at an interrupt: give --resume-value or --resume-with" in flat(out.output)
    out = CliRunner().invoke(cli, [*base, "--trace-dir", "resumed", "--resume-value", "rejected"])
    assert out.exit_code == 0, out.output
    assert "2 interrupt(s) answered by the resume policy" in flat(out.output) and "paused" not in out.output
    ds = mine([tmp_path / "resumed"])
    assert len(ds) == 2 and set(ds.episodes["status"]) == {"ok"} and len(ds.actions) == 4


def test_ray_rollout_workers_get_the_resume_policy(tmp_path):
    from marft_lg.distributed.worker import WorkerSpec

    spec = AppSpec(app="hitl_apps:build", agents=["drafter", "reviser"], base_dir=str(HERE),
                   resume={"call": "hitl_apps:reject_once", "max_resumes": 2})
    worker_spec = WorkerSpec.of(spec, concurrency=1)
    assert worker_spec.resume == {"call": "hitl_apps:reject_once", "max_resumes": 2}
    policy = worker_spec.app_spec().resume_policy()
    assert policy.max_resumes == 2 and policy.answer({"draft": "d"}) == "rejected"
