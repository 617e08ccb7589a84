"""Signals from users after the run: feedback about an episode by its LangGraph thread (and turn) or a trace id,
recorded by `record_feedback`, a JSONL file (`marft-lg feedback`) or ``POST /v1/feedback`` on the server, joined at
mining (one process and several); and the answer a person gives at an `interrupt()` as the reward of the action
they saw, through `TeamChatModel` and plain `ChatOpenAI` against the served team, and in on-policy training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from chatopenai_apps import scripted
from fastapi.testclient import TestClient
from graph_fakes import FakeEngine
from hitl_apps import build, drafter_app
from langgraph.types import Command
from typer.testing import CliRunner

from marft_lg import record_feedback
from marft_lg.graph.app_spec import AppSpec
from marft_lg.graph.chat_model import TeamChatModel
from marft_lg.graph.wrap import wrap
from marft_lg.rewards.composite import CompositeReward
from marft_lg.serving.team import Team
from marft_lg.trajectories.mining import mine
from marft_lg.trajectories.scenarios import Scenario

HERE = Path(__file__).parent
TOPIC = {"topic": "cats"}


def _fake_app(tmp_path: Path, **wrap_kw):
    engine = FakeEngine(agents=("drafter", "reviser"))
    llm = TeamChatModel(team=engine)
    return wrap(drafter_app(llm, llm), team=engine, trace_dir=tmp_path / "traces",
                node_roles={"drafter": "drafter", "reviser": "reviser"}, **wrap_kw)


def _conversations(tmp_path: Path) -> dict[str, list[str]]:
    """Three episodes on thread t1 (two approved turns, then one left paused) and one rejected on t2."""
    app = _fake_app(tmp_path)
    for thread, verdicts in (("t1", ["approved", "approved", None]), ("t2", ["rejected"])):
        cfg = {"configurable": {"thread_id": thread}}
        for verdict in verdicts:
            app.invoke(TOPIC, cfg)
            if verdict is not None:
                app.invoke(Command(resume=verdict), cfg)
    app.close()
    ds = mine([tmp_path / "traces"])
    eps = ds.episodes.sort_values("start_time")
    out: dict[str, list[str]] = {}
    for eid, md in zip(eps["episode_id"], eps["metadata"], strict=True):
        out.setdefault("t2" if md.get("resumes") == ["rejected"] else "t1", []).append(eid)
    assert [len(out["t1"]), len(out["t2"])] == [3, 1]
    return out


@pytest.mark.parametrize("workers", [1, 2])
def test_feedback_by_thread_turn_or_trace_joins_its_episode_and_the_unknown_is_quarantined(tmp_path, workers):
    eps = _conversations(tmp_path)
    traces = tmp_path / "traces"
    t2_trace = mine([traces]).episodes.set_index("episode_id").loc[eps["t2"][0], "trace_ids"][0]
    record_feedback(name="thumbs", value=1, thread_id="t1", trace_dir=traces)  # the thread's latest episode
    record_feedback(name="csat", value=5, thread_id="t1", turn=0, trace_dir=traces)
    record_feedback(name="csat", value=2, thread_id="t1", turn=-2, trace_dir=traces)
    record_feedback(name="thumbs", value=0, trace_id=t2_trace.upper(), trace_dir=traces)  # ids in any case
    record_feedback(name="thumbs", value=1, thread_id="nobody", trace_dir=traces)
    record_feedback(name="thumbs", value=1, thread_id="t1", turn=7, trace_dir=traces)
    q = tmp_path / f"q{workers}.jsonl"
    ds = mine([traces], quarantine=q, workers=workers)
    fb = dict(zip(ds.episodes["episode_id"], ds.episodes["feedback"], strict=True))
    assert fb[eps["t1"][0]] == {"csat": 5}
    assert fb[eps["t1"][1]] == {"csat": 2}
    assert fb[eps["t1"][2]] == {"thumbs": 1}
    assert fb[eps["t2"][0]] == {"thumbs": 0}
    reasons = [json.loads(line) for line in q.read_text().splitlines()]
    details = sorted(r["detail"] for r in reasons if r["reason"] == "feedback_without_episode")
    assert len(details) == 2 and "'nobody' has no episode" in details[0] and "turn 7" in details[1]
    with pytest.raises(ValueError, match="exactly one of"):
        record_feedback(name="x", value=1, thread_id="t1", episode_id="e", trace_dir=traces)
    with pytest.raises(ValueError, match="give thread_id"):
        record_feedback("e", "x", 1, turn=0, trace_dir=traces)


def test_a_feedback_file_is_checked_whole_and_recorded_by_the_cli(tmp_path, monkeypatch):
    from marft_lg.cli import app as cli

    eps = _conversations(tmp_path)
    monkeypatch.chdir(tmp_path)
    good = [{"thread_id": "t2", "name": "resolved", "value": True, "comment": "fixed"},
            {"episode_id": eps["t1"][0], "name": "csat", "value": 4}]
    Path("fb.jsonl").write_text("\n".join(json.dumps(x) for x in [*good, {"thread_id": "t1", "value": 1}]) + "\n")
    out = CliRunner().invoke(cli, ["feedback", "fb.jsonl", "--trace-dir", "traces"])
    assert out.exit_code == 2 and "fb.jsonl:3: a feedback needs 'name' and 'value'" in out.output
    assert mine(["traces"]).episodes["feedback"].map(len).sum() == 0  # nothing recorded from a bad file
    Path("fb.jsonl").write_text("\n".join(json.dumps(x) for x in good) + "\n\n")
    out = CliRunner().invoke(cli, ["feedback", "fb.jsonl", "--trace-dir", "traces"])
    assert out.exit_code == 0 and "recorded 2 feedback item(s)" in out.output, out.output
    fb = dict(zip(*(mine(["traces"]).episodes[c] for c in ("episode_id", "feedback")), strict=True))
    assert fb[eps["t2"][0]] == {"resolved": True} and fb[eps["t1"][0]] == {"csat": 4}


# ---- the served team (tiny model): plain ChatOpenAI and the feedback route -----------------------------------

@pytest.fixture()
def team(tiny_model_dir, tmp_path):
    t = Team(tiny_model_dir, ["drafter", "reviser"], registry=tmp_path / "registry", versions=None, seed=0)
    for role in ("drafter", "reviser"):
        t.load_version(role, t.save_version(role))
    yield t
    t.close()


def test_feedback_posted_to_the_server_by_thread_id_after_the_run_joins_its_episode(team, tmp_path):
    from marft_lg.serving.http.server import create_app

    scripted(team, {"drafter": ["Cats nap in the sun."], "reviser": ["Cats nap, then hunt."]})
    traces = tmp_path / "traces"
    app = wrap(build(), team=team, trace_dir=traces, serve_http=True)
    cfg = {"configurable": {"thread_id": "desk-1"}}
    list(app.stream(TOPIC, cfg, stream_mode="values"))
    list(app.stream(Command(resume="approved"), cfg, stream_mode="updates"))
    app.close()
    with TestClient(create_app(team, feedback_dir=traces)) as c:
        ok = c.post("/v1/feedback", json={"thread_id": "desk-1", "name": "thumbs", "value": 1})
        assert ok.status_code == 200 and ok.json()["thread_id"] == "desk-1"
        bad = c.post("/v1/feedback", json={"thread_id": "desk-1", "name": "thumbs", "value": {"a": 1}})
        assert bad.status_code == 400 and "number, bool or string" in bad.json()["error"]["message"]
        bad = c.post("/v1/feedback", json={"thread": "desk-1", "name": "thumbs", "value": 1})
        assert bad.status_code == 400 and "unknown field" in bad.json()["error"]["message"]
    with TestClient(create_app(team)) as c:
        assert c.post("/v1/feedback", json={"thread_id": "desk-1", "name": "t", "value": 1}).status_code == 404
    [row] = mine([traces]).episodes.to_dict("records")
    assert row["feedback"] == {"thumbs": 1} and row["metadata"]["resumes"] == ["approved"]


# ---- the answer at an interrupt is the reward of the action the person saw -------------------------------------

REWARD = {"credit": "shaped", "weights": {"interrupt_feedback": 1.0},
          "components": {"interrupt_feedback": {"values": {"approved": 1.0, "rejected": 0.0}}}}


def _scored(ds, reward=REWARD):
    result = CompositeReward.from_yaml(reward).score(ds)
    return result.episodes.set_index("episode_id"), result.action_rewards


def test_the_resume_value_rewards_the_draft_not_the_last_agent_to_answer(tmp_path):
    app = _fake_app(tmp_path)
    for thread, resume in (("a", "approved"), ("r", "rejected"), ("e", "EDIT"), ("p", None)):
        cfg = {"configurable": {"thread_id": thread}}
        first = app.invoke(TOPIC, cfg)
        if resume == "EDIT":  # the person sends back an edited draft: half of it kept
            draft = first["draft"]
            resume = draft[: len(draft) // 2] + "x" * (len(draft) - len(draft) // 2)
        if resume is not None:
            app.invoke(Command(resume=resume), cfg)
    app.close()
    ds = mine([tmp_path / "traces"])
    table, per_action = _scored(ds)
    by_resume = {(md.get("resumes") or ["paused"])[0][:8]: eid for eid, md in
                 zip(ds.episodes["episode_id"], ds.episodes["metadata"], strict=True)}
    approved, rejected, paused = by_resume["approved"], by_resume["rejected"], by_resume["paused"]
    edited = next(e for k, e in by_resume.items() if k not in ("approved", "rejected", "paused"))
    assert table.loc[approved, "reward"] == 1.0 and table.loc[rejected, "reward"] == 0.0
    assert 0.4 <= table.loc[edited, "reward"] <= 0.6
    assert bool(table.loc[paused, "scored"]) is False  # never answered: no verdict, never a 0 that trains
    # the rejected conversation ran the reviser after the drafter; the verdict is the drafter's (order 0)
    acts = ds.actions[ds.actions["episode_id"] == rejected].sort_values("order")
    assert list(acts["agent"]) == ["drafter", "reviser"]
    meta = ds.episodes.set_index("episode_id").loc[rejected, "metadata"]
    assert meta["interrupts"][0]["after_calls"] == 1
    approved_acts = list(per_action[approved])
    assert approved_acts[0] == 1.0 and sum(approved_acts) == 1.0


def test_a_chatopenai_app_gets_the_verdict_on_its_draft_and_on_policy_training_with_a_simulated_approver_trains(
        team, tmp_path):
    from marft_lg.training.config import MARFTConfig
    from marft_lg.training.trainer import MARFTTrainer

    scripted(team, {"drafter": ["Cats nap in the sun."], "reviser": ["Cats nap, then hunt."]})
    app = wrap(build(), team=team, trace_dir=tmp_path / "traces", serve_http=True)
    cfg = {"configurable": {"thread_id": "desk-9"}}
    list(app.stream(TOPIC, cfg, stream_mode="values"))
    list(app.stream(Command(resume={"verdict": "no", "note": "too short"}), cfg, stream_mode="updates"))
    app.close()
    ds = mine([tmp_path / "traces"])
    reward = {"credit": "shaped", "weights": {"interrupt_feedback": 1.0},
              "components": {"interrupt_feedback": {"field": "verdict", "values": {"yes": 1.0, "no": 0.25}}}}
    table, per_action = _scored(ds, reward)
    [eid] = ds.episode_ids
    assert table.loc[eid, "reward"] == 0.25 and list(per_action[eid]) == [0.25, 0.0]  # on the draft
    _, terminal = _scored(ds, {**reward, "credit": "terminal"})
    assert list(terminal[eid]) == [0.0, 0.25]  # terminal credit puts it on the last action, as for any component

    del team.achat  # the scripted answers off: the model's own drafts, which vary
    spec = AppSpec(app="hitl_apps:build", agents=["drafter", "reviser"], base_dir=str(HERE),
                   resume={"call": "hitl_apps:approve_even"})
    wrapped = spec.build_app(team, tmp_path / "traces-train")
    trainer = MARFTTrainer(team, CompositeReward.from_yaml(REWARD),
                           MARFTConfig(group_size=4, update_scheme="simultaneous", learning_rate=1e-2, plots=False,
                                       seed=3, rollout_concurrency=2, behaviour_logprobs="recompute",
                                       max_new_tokens=12),
                           tmp_path / "run", progress=False)
    rows = trainer.fit_online(wrapped, [Scenario("cats", TOPIC), Scenario("dogs", {"topic": "dogs"})], iterations=1)
    wrapped.close()
    assert rows[0]["episodes"] == 8
    assert trainer.update_steps.get("drafter", 0) > 0  # verdicts differ within a group: the drafter learned
