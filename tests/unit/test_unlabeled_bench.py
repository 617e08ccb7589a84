"""benchmarks/unlabeled.py: its pure parts (the simulated judge and user, agreement, the results file) with no model;
a smoke run of the whole script on the tiny random model is marked slow."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from marft_lg.rewards import CompositeReward, GroupJudge
from marft_lg.rewards.components.group_judge import render_episode
from marft_lg.serving.types import ChatRequest

_ROOT = Path(__file__).resolve().parents[2]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # a dataclass in the module looks its module up
    spec.loader.exec_module(module)
    return module


ub = _load("unlabeled_bench", _ROOT / "benchmarks" / "unlabeled.py")
factory = _load("unlabeled_rewards_factory", _ROOT / "tests" / "unit" / "rewards" / "rewards_factory.py")

QUESTION = "Sam has 3 apples and gets 4 more. How many apples does Sam have now?"
SCENARIO = factory.scenario(scenario_id="math-train-0000", inputs={"question": QUESTION})


def _episodes(answers: list[str], sid: str = "math-train-0000") -> list[dict]:
    return [{"episode_id": f"{sid}-{i}", "scenario_id": sid,
             "actions": [{"agent": "reasoner", "completion": "3 + 4 = 7, so the answer is 7"},
                         {"agent": "actor", "completion": a}]} for i, a in enumerate(answers)]


ANSWERS = ["The answer is \\boxed{7}", "\\boxed{8}", "Sam has 7 apples", "I think\nit is \\boxed{7}\nthanks",
           "\\boxed{6} not 7"]
RIGHT = [True, False, True, True, False]


def test_final_answer_and_correctness_follow_the_reference_rule():
    ep = factory.make_episode(_episodes(["first line\n\\boxed{7}"])[0]["actions"], SCENARIO, episode_id="e")
    block = render_episode(ep)
    assert ub.final_answer(block) == "first line\n\\boxed{7}"  # a reply over several lines is kept whole
    assert ub.final_answer(block, "reasoner") == "3 + 4 = 7, so the answer is 7"
    assert ub.final_answer("step 0 [reasoner]: 7", "actor") == ""
    for text, right in zip(ANSWERS, RIGHT, strict=True):
        assert ub.answer_correct(text, "7") is right, text
    assert not ub.answer_correct(None, "7")
    assert ub.answer_correct("\\boxed{7.0}", 7)


def test_the_simulated_judge_reads_a_real_group_judge_prompt_and_answers_valid_json():
    ds = factory.make_dataset(_episodes(ANSWERS))
    eps = list(ds.iter_episodes({"math-train-0000": SCENARIO}))
    sim = ub.SimulatedJudge({QUESTION: "7"}, error=0.0)
    judge = GroupJudge(engine=sim, seed=5)
    prompt = judge.prompt(json.dumps(SCENARIO["inputs"]), [render_episode(e) for e in eps])
    task, blocks = ub.parse_prompt(prompt)
    assert QUESTION in task and len(blocks) == len(ANSWERS)
    reply = sim.chat([ChatRequest(messages=[{"role": "user", "content": prompt}], agent=None)])
    parsed = json.loads(reply[0].text)
    assert [e["attempt"] for e in parsed["scores"]] == [1, 2, 3, 4, 5]
    assert [e["score"] for e in parsed["scores"]] == [float(r) for r in RIGHT]
    # through group_judge itself: shuffled order, the scores land on the right episodes
    scores = judge.score_group(eps)
    assert [scores[e.episode_id].value for e in eps] == [float(r) for r in RIGHT]
    assert sim.calls == 2 and sim.flips == 0


def test_the_simulated_judge_inside_a_composite_reward_and_record_agreement():
    ds = factory.make_dataset(_episodes(ANSWERS))
    sim = ub.SimulatedJudge({QUESTION: "7"}, error=0.0)
    reward = CompositeReward({"group_judge": 1.0}, {"group_judge": GroupJudge(engine=sim)})
    pairs: list = []
    ub.record_agreement(reward, "group_judge", {"math-train-0000": "7"}, pairs)
    no_ref = {**SCENARIO, "reference": None}
    result = reward.score(ds, {"math-train-0000": no_ref})
    assert result.episodes["scored"].all()
    assert pairs == [(float(r), r) for r in RIGHT]
    assert {k: v for k, v in ub.agreement(pairs).items() if k in ("n", "agree", "rate")} == {"n": 5, "agree": 5,
                                                                                              "rate": 1.0}


def test_an_unknown_question_leaves_the_group_unscored_never_zero():
    ds = factory.make_dataset(_episodes(ANSWERS[:2]))
    sim = ub.SimulatedJudge({"another question": "7"}, error=0.0)
    reward = CompositeReward({"group_judge": 1.0}, {"group_judge": GroupJudge(engine=sim, retries=0)})
    result = reward.score(ds, {"math-train-0000": SCENARIO})
    assert not result.episodes["scored"].any()


def test_the_loops_reward_is_the_thumbs_and_for_the_format_arm_the_boxed_answer_beside_them():
    """Two approved episodes, one answer cut off before its box: thumbs alone score them alike, the format arm
    scores the boxed one higher; both need no reference."""
    eps = _episodes(["The answer is \\boxed{7}", "Sam gets 4 more, so add: 3 + 4 = 7. The answer is"])
    for ep in eps:
        ep["feedback"] = {ub.FEEDBACK_KEY: 1.0}
    ds = factory.make_dataset(eps)
    no_ref = {"math-train-0000": {**SCENARIO, "reference": None}}
    thumbs = ub.loop_reward("production_loop").score(ds, no_ref).episodes
    both = ub.loop_reward("production_loop_format").score(ds, no_ref).episodes
    assert thumbs["scored"].all() and both["scored"].all()
    assert thumbs["reward"].tolist() == [1.0, 1.0]
    assert both["reward"].tolist() == [1.5, 1.0] and both["format_compliance"].tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match="not a production loop arm"):
        ub.loop_reward("judge_base")


@pytest.mark.parametrize("error", [0.1, 0.3])
def test_the_simulated_judge_flips_about_e_of_its_verdicts(error):
    blocks = [f"step 0 [actor]: \\boxed{{{i % 9}}}" for i in range(20)]
    prompt = GroupJudge(engine=ub.SimulatedJudge({}, 0.0)).prompt(json.dumps({"question": QUESTION}), blocks)
    truth = [ub.answer_correct(ub.final_answer(b), "7") for b in blocks]
    wrong = total = 0
    for seed in range(150):
        sim = ub.SimulatedJudge({QUESTION: "7"}, error=error, seed=seed)
        scores = sim.judge(prompt)
        assert sim.flips == sum((s >= 0.5) != t for s, t in zip(scores, truth, strict=True))
        wrong += sim.flips
        total += len(blocks)
    assert wrong / total == pytest.approx(error, abs=0.03)
    again = ub.SimulatedJudge({QUESTION: "7"}, error=error, seed=3)
    assert again.judge(prompt) == ub.SimulatedJudge({QUESTION: "7"}, error=error, seed=3).judge(prompt)  # seeded


def test_agreement_skips_unscored_and_counts_the_threshold():
    pairs = [(1.0, True), (0.5, True), (0.49, True), (0.0, False), (0.7, False), (None, True), (float("nan"), False)]
    assert ub.agreement(pairs) == {"n": 5, "agree": 3, "rate": 0.6, "on_right": {"n": 3, "agree": 2, "rate": 2 / 3},
                                   "on_wrong": {"n": 2, "agree": 1, "rate": 0.5}}
    empty = {"n": 0, "agree": 0, "rate": None}
    assert ub.agreement([]) == {**empty, "on_right": empty, "on_wrong": empty}
    # everything called wrong where most answers are wrong: high overall, nothing on the right ones
    lazy = ub.agreement([(0.0, False)] * 9 + [(0.0, True)])
    assert lazy["rate"] == 0.9 and lazy["on_right"]["rate"] == 0.0 and lazy["on_wrong"]["rate"] == 1.0


def test_the_simulated_user_approves_right_answers_90_percent_and_wrong_ones_10():
    user = ub.SimulatedUser(seed=1)
    verdicts = [(c, user.approves(c, f"thread-{i}")) for i in range(4000) for c in (True, False)]
    rates = ub.approval_rates(verdicts)
    assert rates["right"]["n"] == rates["wrong"]["n"] == 4000
    assert rates["right"]["rate"] == pytest.approx(0.9, abs=0.02)
    assert rates["wrong"]["rate"] == pytest.approx(0.1, abs=0.02)
    assert user.approves(True, "t") == ub.SimulatedUser(seed=1).approves(True, "t")
    assert ub.approval_rates([]) == {"right": {"n": 0, "approved": 0, "rate": None},
                                     "wrong": {"n": 0, "approved": 0, "rate": None}}


def _run(arm: str, seed: int, gain: float, low: float, rate: float | None = None) -> dict:
    return {"arm": arm, "seed": seed, "training_minutes": 8.0, "judge_calls": 3,
            "agreement": None if rate is None else {"n": 10, "agree": int(rate * 10), "rate": rate},
            "heldout": {"n": 128, "gain": {"mean": gain, "low": low, "high": gain + 0.1, "n": 128},
                        "strict": {"untuned": 0.1, "tuned": 0.2}}}


def test_the_results_file_shape_and_append_merge():
    runs = [_run("judge_sim_e10", 0, 0.05, 0.01, 0.9), _run("reference", 0, 0.1, 0.02),
            _run("judge_sim_e10", 1, 0.03, -0.02, 0.8)]
    doc = ub.results_doc(runs, ub.BUDGETS["smoke"], code={"commit": "abc123", "dirty": False},
                         machine={"cpus": 2}, model="tiny")
    assert doc["commit"] == "abc123" and doc["machine"] == {"cpus": 2} and doc["budget"]["name"] == "smoke"
    assert "SIMULATED" in doc["notes"]["simulated"]
    assert [(r["arm"], r["seed"]) for r in doc["runs"]] == [("reference", 0), ("judge_sim_e10", 0),
                                                            ("judge_sim_e10", 1)]
    s = doc["summary"]["judge_sim_e10"]
    assert s["seeds"] == [0, 1] and s["gain_mean"] == pytest.approx(0.04)
    assert s["seeds_ci_above_zero"] == 1 and s["agreement_mean"] == pytest.approx(0.85) and s["simulated_judge"]
    assert doc["summary"]["reference"]["agreement_mean"] is None
    json.dumps(doc)  # serialisable
    assert "SIMULATED judge" in ub.table(doc)
    merged = ub.merge_runs(runs, [_run("reference", 0, 0.2, 0.1)])
    assert len(merged) == 3 and [r for r in merged if r["arm"] == "reference"][0]["heldout"]["gain"]["mean"] == 0.2


def test_strip_labels_drops_reference_and_checkpoints():
    from marft_lg.examples.math_team.problems import make_problems

    train = make_problems(3, 1, 0).split("train")
    stripped = ub.strip_labels(train)
    assert len(stripped) == 3
    assert all(s.reference is None and not s.checkpoints for s in stripped)
    assert [s.inputs for s in stripped] == [s.inputs for s in train]


def test_a_trained_run_comparing_the_untuned_versions_is_an_error():
    same = {"untuned": {"reasoner": "v1"}, "tuned": {"reasoner": "v1"}}
    with pytest.raises(RuntimeError, match="nothing published"):
        ub.check_candidate({"arm": "production_loop", "seed": 0, "iterations": 9, "versions": same})
    with pytest.raises(RuntimeError):  # a warm start alone trained too
        ub.check_candidate({"iterations": 0, "traffic": {"warm_start_kept": 3}, "versions": same})
    ub.check_candidate({"iterations": 0, "traffic": {"warm_start_kept": 0}, "versions": same})  # trained nothing
    ub.check_candidate({"iterations": 2, "versions": {"untuned": {"reasoner": "v1"}, "tuned": {"reasoner": "v3"}}})


def test_unknown_arm_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        ub.main(["--arms", "nope", "--out", str(tmp_path / "u.json")])


@pytest.mark.slow
def test_smoke_run_on_the_tiny_model(tiny_model_dir, tmp_path):
    """The script end to end (a simulated-judge arm and the production loop; ~25 s on 2 cores): the results file
    has its commit, the run's figures, the traffic's feedback joined by thread id."""
    out = tmp_path / "unlabeled.json"
    doc = ub.main(["--budget", "smoke", "--seeds", "0", "--arms", "judge_sim_e10,production_loop", "--model",
                   tiny_model_dir, "--out", str(out), "--work", str(tmp_path / "work")])
    saved = json.loads(out.read_text())
    assert saved["commit"] and saved["commit"] == doc["commit"]
    runs = {r["arm"]: r for r in saved["runs"]}
    assert set(runs) == {"judge_sim_e10", "production_loop"}
    sim = runs["judge_sim_e10"]
    assert sim["simulated_judge"] and sim["judge_calls"] >= 1 and sim["agreement"]["n"] >= 1
    assert sim["heldout"]["n"] == ub.BUDGETS["smoke"].n_heldout and "strict" in sim["heldout"]
    loop = runs["production_loop"]["traffic"]
    assert loop["with_feedback"] == loop["answered"] == loop["conversations"]  # thumbs joined by thread id
    if loop["warm_start_kept"] or runs["production_loop"]["iterations"]:  # what it trained is what it compared
        versions = runs["production_loop"]["versions"]
        assert versions["tuned"] != versions["untuned"]
    # --append keeps what is there and skips a pair it holds
    again = ub.main(["--budget", "smoke", "--seeds", "0", "--arms", "judge_sim_e10", "--model", tiny_model_dir,
                     "--out", str(out), "--work", str(tmp_path / "work2"), "--append"])
    assert len(again["runs"]) == 2


# ---- the tool-using app (examples/supervisor_tools) -----------------------------------------------------------------
TOOL_Q = "What is 6 times 7?"
TOOL_SCENARIO = factory.scenario(scenario_id="times-6-7-1", inputs={"messages": [{"role": "user", "content": TOOL_Q}]})


def _tool_episode(i: int, reply: str, last: str = "mathematician") -> dict:
    """A supervisor hand-off, a worker's tool call and its reply, then the supervisor finishing."""
    actions = [{"agent": "supervisor", "completion": "",
                "tool_calls": [{"name": "transfer_to_mathematician", "args": {}, "result": "ok"}]},
               {"agent": "mathematician", "completion": "",
                "tool_calls": [{"name": "multiply", "args": {"a": 6, "b": 7}, "result": "42"}]},
               {"agent": last, "completion": reply},
               {"agent": "supervisor", "completion": "done"}]
    return {"episode_id": f"tools-{i}", "scenario_id": "times-6-7-1", "actions": actions}


def test_the_tool_apps_simulated_judge_checks_the_last_worker_reply_as_the_reference_reward_does():
    replies = ["6 times 7 is 42.", "It is 41.", "The product is 42"]
    ds = factory.make_dataset([_tool_episode(i, r) for i, r in enumerate(replies)])
    eps = list(ds.iter_episodes({"times-6-7-1": TOOL_SCENARIO}))
    block = render_episode(eps[0])
    assert ub.final_answer(block, ("researcher", "mathematician")) == "6 times 7 is 42."  # not the supervisor's
    assert ub.answer_correct("6 times 7 is 42.", "42", "contains") and not ub.answer_correct("41", "42", "contains")
    sim = ub.SimulatedJudge({TOOL_Q: "42"}, error=0.0, agent=("researcher", "mathematician"), match="contains")
    scores = GroupJudge(engine=sim, seed=1).score_group(eps)  # the task is the app's input messages, as JSON
    assert [scores[e.episode_id].value for e in eps] == [1.0, 0.0, 1.0]
    pairs: list = []
    reward, judge = ub.judge_reward(sim, ub.TOOLS_BUDGETS["smoke"], 0, "tools")
    assert set(reward.weights) == {"group_judge", *ub.TOOLS_LABEL_FREE}  # no term that needs the reference
    ub.record_agreement(reward, "group_judge", {"times-6-7-1": "42"}, pairs, agents=ub.ToolsArmRun.answer_agents,
                        match="contains")
    reward.score(ds, {"times-6-7-1": {**TOOL_SCENARIO, "reference": None}})
    assert pairs == [(1.0, True), (0.0, False), (1.0, True)] and judge is reward.components["group_judge"]


def test_tool_app_runs_are_kept_apart_from_the_math_teams_in_the_results_file():
    math_run = _run("reference", 0, 0.1, 0.02)  # written before the tool-using app: no `app` key
    tools = [{**_run("reference", 0, 0.3, 0.1), "app": "tools"}, {**_run("judge_sim_e10", 0, -0.1, -0.2, 0.7),
                                                                    "app": "tools"}]
    doc = ub.results_doc([*tools, math_run], ub.BUDGETS["smoke"], code={"commit": "c"}, machine={}, model="m")
    assert [(ub.app_of(r), r["arm"]) for r in doc["runs"]] == [("math", "reference"), ("tools", "reference"),
                                                               ("tools", "judge_sim_e10")]
    assert doc["summary"]["reference"]["gain_mean"] == pytest.approx(0.1)  # the math team's keys are unchanged
    assert doc["summary"]["tools:reference"]["gain_mean"] == pytest.approx(0.3)
    assert doc["summary"]["tools:judge_sim_e10"]["simulated_judge"] and "tools" in doc["notes"]
    assert "| tools: judge_sim_e10 (SIMULATED judge) | 0 |" in ub.table(doc)
    merged = ub.merge_runs([math_run, *tools], [{**_run("reference", 0, 0.5, 0.4), "app": "tools"}])
    assert sorted((ub.app_of(r), r["heldout"]["gain"]["mean"]) for r in merged if r["arm"] == "reference") == [
        ("math", 0.1), ("tools", 0.5)]


def test_the_tool_app_has_no_production_loop_arm(tmp_path):
    with pytest.raises(SystemExit):
        ub.main(["--app", "tools", "--arms", "production_loop", "--out", str(tmp_path / "u.json")])


@pytest.mark.slow
def test_smoke_run_of_the_tool_app_on_the_tiny_model(tiny_model_dir, tmp_path):
    """The tool-using app's arms end to end on the tiny model, next to a math run already in the file."""
    out = tmp_path / "unlabeled.json"
    out.write_text(json.dumps({"runs": [_run("reference", 0, 0.1, 0.02)]}))
    doc = ub.main(["--app", "tools", "--budget", "smoke", "--seeds", "0", "--arms", "reference,judge_sim_e10",
                   "--model", tiny_model_dir, "--out", str(out), "--work", str(tmp_path / "work"), "--append"])
    runs = {(ub.app_of(r), r["arm"]): r for r in json.loads(out.read_text())["runs"]}
    assert set(runs) == {("math", "reference"), ("tools", "reference"), ("tools", "judge_sim_e10")}
    assert doc["budget"]["name"] == "smoke" and doc["budget"]["n_heldout"] == ub.BUDGETS["smoke"].n_heldout
    for arm in ("reference", "judge_sim_e10"):
        run = runs[("tools", arm)]
        assert run["app_budget"]["n_heldout"] == ub.TOOLS_BUDGETS["smoke"].n_heldout
        assert run["heldout"]["n"] == ub.TOOLS_BUDGETS["smoke"].n_heldout
        assert set(run["heldout"]["components"]["untuned"]) == {"task_completion", "goal_progress",
                                                                "tool_error_rate", "step_count"}
        assert 0.0 <= run["heldout"]["strict"]["untuned"] <= 1.0
    assert runs[("tools", "judge_sim_e10")]["judge_calls"] >= 1 and "tools:judge_sim_e10" in doc["summary"]
