"""The demo's problems (a small traced set, then a stream of fresh on-policy problems, then held-out ones) and
what a run reports: held-out accuracy strict/lenient, the minimum detectable gain, the printed closing order.
The run uses fakes for the team, the trainer and the replays: no model is loaded."""

from __future__ import annotations

import importlib
import io
import json
import types

import pytest
from math_team_factory import math_dataset
from rich.console import Console

from marft_lg.demo import BUDGETS, DemoBudget, demo_problems, run_demo
from marft_lg.evaluation.comparison import compare_datasets
from marft_lg.evaluation.stats import detectable_effect
from marft_lg.examples.math_team.problems import make_problems
from marft_lg.examples.math_team.reward import math_reward
from marft_lg.training.trainer import MARFTTrainer

STREAMY = DemoBudget("streamy", 1, n_traced=3, n_heldout=6, traces_per_problem=2, offline_passes=1,
                     online_iterations=4, online_minutes=1.0, scenarios_per_iteration=2, group_size=2, max_tokens=16)


@pytest.mark.parametrize("seed", [0, 1, 2, 7, 123])
@pytest.mark.parametrize(("n_train", "n_heldout"), [(2, 5), (16, 48), (176, 128), (64, 256)])
def test_make_problems_gives_distinct_questions_and_disjoint_splits(seed, n_train, n_heldout):
    problems = make_problems(n_train, n_heldout, seed)
    train, heldout = problems.split("train"), problems.split("heldout")
    assert (len(train), len(heldout)) == (n_train, n_heldout)
    questions = [s.inputs["question"] for s in problems]
    assert len(set(questions)) == len(questions)
    assert not {s.inputs["question"] for s in train} & {s.inputs["question"] for s in heldout}
    # nor the same arithmetic under other names: the checkpoints name the operands and operators
    held_sums = [(frozenset(s.checkpoints), s.reference) for s in heldout]
    assert len(set(held_sums)) == len(held_sums)
    assert not {(frozenset(s.checkpoints), s.reference) for s in train} & set(held_sums)
    assert make_problems(n_train, n_heldout, seed).by_id() == problems.by_id()  # same seed, same problems


def test_make_problems_says_when_the_arithmetic_runs_out():
    with pytest.raises(ValueError, match="held-out problems whose arithmetic differs"):
        make_problems(176, 1000, 0)


@pytest.mark.parametrize("budget", [*BUDGETS.values(), STREAMY], ids=lambda b: b.name)
def test_every_on_policy_iteration_gets_problems_never_seen_before(budget):
    problems = demo_problems(budget, seed=0)
    assert len(problems.traced) == budget.n_traced and len(problems.heldout) == budget.n_heldout
    assert len(problems.stream) == budget.n_stream >= budget.online_iterations * budget.scenarios_per_iteration
    stream = list(problems.stream)
    # what fit_online runs in each iteration, over the whole budget of iterations
    batches = [MARFTTrainer._online_batch(stream, it, budget.scenarios_per_iteration)
               for it in range(budget.online_iterations)]
    ids = [s.scenario_id for batch in batches for s in batch]
    assert len(ids) == len(set(ids)) == budget.n_stream  # no problem twice
    questions = {s.scenario_id: s.inputs["question"] for s in problems.all}
    seen_before = {questions[s.scenario_id] for s in [*problems.traced, *problems.heldout]}
    assert not {questions[i] for i in ids} & seen_before  # neither traced nor held out


def test_the_traced_set_stays_small_while_the_stream_grows():
    full = BUDGETS["full"]
    assert full.n_traced == 16 and full.n_stream == full.online_iterations * full.scenarios_per_iteration == 160
    assert BUDGETS["smoke"].n_train <= 4 and BUDGETS["quick"].n_train <= 8  # the cheap budgets stay cheap
    assert full.to_dict()["n_train"] == 176 and full.to_dict()["n_traced"] == 16


class _Registry:
    def __init__(self):
        self.aliases = {}

    def promote(self, versions, **kw):
        self.aliases["live"] = dict(versions)

    def set_alias(self, name, versions, **kw):
        self.aliases[name] = dict(versions)

    def alias(self, name):
        return self.aliases.get(name, {})


class _Team:
    saved: list[str] = []

    def __init__(self, model, roles, **kw):
        self.roles, self.registry = roles, _Registry()

    def save_version(self, role, **kw):
        _Team.saved.append(role)
        return "v1"

    def load_version(self, role, version):
        pass

    def versions(self):
        return {r: "v2" for r in self.roles}

    def close(self):
        pass


def _answers(heldout, side):
    """baseline: boxed right on 0-1, right but unboxed on 2-3, wrong after; candidate: boxed right on 0-3."""
    out = {}
    for i, s in enumerate(heldout):
        right = s.reference
        if side == "baseline":
            text = f"\\boxed{{{right}}}" if i < 2 else (f"so {right}" if i < 4 else "\\boxed{999}")
        else:
            text = f"so \\boxed{{{right}}}" if i < 4 else "no idea"
        out[f"cmp-{side}-{s.scenario_id}"] = (s.scenario_id, [("reasoner", "think"), ("actor", text)])
    return out


def test_a_run_trains_on_the_stream_and_reports_accuracy_and_the_detectable_gain(tmp_path, monkeypatch):
    budget, seen = STREAMY, {}
    problems = demo_problems(budget, seed=0)
    heldout = list(problems.heldout)
    traced_eps = {f"untuned-{s.scenario_id}-{k}": (s.scenario_id, [("reasoner", "r"), ("actor", "\\boxed{1}")])
                  for k in range(budget.traces_per_problem) for s in problems.traced}
    everything = math_dataset({**traced_eps, **_answers(heldout, "baseline"), **_answers(heldout, "candidate")})
    online_batch = MARFTTrainer._online_batch

    class FakeTrainer:
        def __init__(self, team, reward, cfg, run_dir, **kw):
            self.team, self.run_id, self.iteration = team, "demo", 5
            self.unpublished = {"actor"}  # changed by an update that no on-policy iteration published

        def publish(self):  # what MARFTTrainer.publish does with a Team (its own test: training/test_publish.py)
            for role in sorted(self.unpublished):
                self.team.load_version(role, self.team.save_version(role, run_id=self.run_id))
            self.unpublished.clear()

        def fit_offline(self, dataset, scenarios):
            seen["offline"] = [s.scenario_id for s in scenarios]
            return [{"reward_mean": 0.5}]

        def fit_online(self, app, scenarios, iterations, *, scenarios_per_iteration, time_budget_s):
            seen["time_budget_s"] = time_budget_s
            items = list(scenarios)
            seen["online"] = [[s.scenario_id for s in online_batch(items, it, scenarios_per_iteration)]
                              for it in range(iterations)]
            return [{"reward_mean": 0.6}] * iterations

    def fake_run_episodes(app, jobs, **kw):
        seen["traced"] = sorted({s.scenario_id for s, _ in jobs})
        return len(jobs)

    class FakeBaselineOnce:  # the untuned side run ahead (BaselineOnce's own tests: test_demo_curve.py)
        def __init__(self, app, concurrency):
            self.failures = []

        def run_ahead(self, baseline, scenarios, **kw):
            seen["ahead"] = (baseline, sorted(s.scenario_id for s in scenarios), kw)
            return everything.select([e for e in everything.episode_ids if e.startswith("cmp-baseline-")])

    def fake_compare(app, baseline, candidate, scenarios, reward, **kw):
        seen["compare_runner"] = kw.get("runner")
        by_id = {s.scenario_id: s.to_dict() for s in scenarios}
        side = {k: everything.select([e for e in everything.episode_ids if e.startswith(f"cmp-{k}-")])
                for k in ("baseline", "candidate")}
        result = compare_datasets(side["baseline"], side["candidate"], reward, scenarios=by_id)
        result.datasets = side  # shadow_compare keeps both sides' episodes, which the accuracy is read from
        return result

    app = types.SimpleNamespace(trace_dir=tmp_path / "compare-traces", flush=lambda: True, close=lambda: None)
    monkeypatch.setattr("marft_lg.serving.team_factory.team", _Team)
    monkeypatch.setattr(importlib.import_module("marft_lg.graph.wrap"), "wrap", lambda graph, **kw: app)
    monkeypatch.setattr("marft_lg.graph.chat_model.TeamChatModel", lambda **kw: object())
    monkeypatch.setattr("marft_lg.trajectories.mining.mine", lambda *a, **kw: everything)
    monkeypatch.setattr("marft_lg.training.trainer.MARFTTrainer", FakeTrainer)
    monkeypatch.setattr("marft_lg.training.metrics.read_metrics", lambda path: [{"reward_mean": 0.5}] * 5)
    monkeypatch.setattr("marft_lg.evaluation.shadow.shadow_compare", fake_compare)
    monkeypatch.setattr("marft_lg.evaluation.shadow.BaselineOnce", FakeBaselineOnce)
    monkeypatch.setattr("marft_lg.demo._run_episodes", fake_run_episodes)
    monkeypatch.setattr(_Team, "saved", [])
    buf = io.StringIO()
    summary = run_demo(budget, tmp_path / "run", model="unused", trace_root=tmp_path / "traces",
                       console=Console(file=buf, width=80))

    # the untuned versions of both roles, then the actor's unpublished update: the candidate is what was trained
    assert sorted(_Team.saved[:2]) == ["actor", "reasoner"] and _Team.saved[2:] == ["actor"]
    # the offline stage and the traced runs used the traced problems only; on-policy got a fresh batch each time
    traced_ids = sorted(s.scenario_id for s in problems.traced)
    assert seen["traced"] == sorted(seen["offline"]) == traced_ids
    flat = [i for batch in seen["online"] for i in batch]
    assert len(seen["online"]) == budget.online_iterations and len(flat) == len(set(flat)) == budget.n_stream
    assert not set(flat) & set(traced_ids)
    assert summary["problems"] == {"traced": 3, "stream": 8, "online_seen": 8, "heldout": 6}
    # the comparison's untuned side ran ahead on the held-out problems, pinned to `live`, with the comparison's run id
    # and seed, and the comparison reused it (its runner); on-policy got what the 1-minute deadline left
    assert seen["ahead"] == ("live", sorted(s.scenario_id for s in heldout),
                             {"samples_per_scenario": 1, "seed": 0, "run_id": "demo-run"})
    assert isinstance(seen["compare_runner"], FakeBaselineOnce)
    plan = summary["online_budget"]
    assert seen["time_budget_s"] == plan["online_s"] and plan["deadline_s"] == 60 and plan["cap_s"] == 60
    assert plan["online_s"] == pytest.approx(60 - plan["spent_s"] - plan["tuned_side_s"] - plan["reserve_s"], abs=0.2)
    assert 0 < plan["online_s"] < 60
    report = (tmp_path / "run" / "report.md").read_text()
    assert f"  - on-policy MARFT given {plan['online_s'] / 60:.1f} min (what the deadline left; at most 1)\n" in report

    # accuracy of each side, from the replayed answers
    acc = summary["heldout"]["accuracy"]
    assert acc["baseline"] == {"strict": 2 / 6, "lenient": 4 / 6, "n": 6}
    assert acc["candidate"] == {"strict": 4 / 6, "lenient": 4 / 6, "n": 6}
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert saved["heldout"]["accuracy"] == acc
    # the detectable gain is that of the per-problem reward differences the CI comes from
    reward = math_reward()
    rewards = {side: reward.score(everything.select([e for e in everything.episode_ids if e.startswith(f"cmp-{side}-")]),
                                  {s.scenario_id: s.to_dict() for s in heldout}).episodes["reward"].tolist()
               for side in ("baseline", "candidate")}
    expected = detectable_effect([c - b for b, c in zip(rewards["baseline"], rewards["candidate"], strict=True)])
    assert saved["heldout"]["mde"]["n"] == 6
    assert saved["heldout"]["mde"]["mde"] == pytest.approx(expected.mde)
    assert saved["heldout"]["mde"]["sd"] == pytest.approx(expected.sd)

    report = (tmp_path / "run" / "report.md").read_text()
    assert "| answer accuracy (n=6) | untuned | tuned |" in report
    assert "| strict: `\\boxed{N}` = reference | 0.333 | 0.667 |" in report
    assert "| lenient: last number = reference | 0.667 | 0.667 |" in report
    assert f"minimum detectable gain at n=6 (80% power, 5% two-sided): {expected.mde:.3f}" in report
    assert "8 fresh for on-policy MARFT, 2 new per iteration (8 used, none twice)" in report
    assert "too little training" in report  # not the full budget
    reasons = {f"  - {r}" for r in saved["gate"]["reasons"]}  # the gate's own prose
    prose = [line for line in report.splitlines()
             if not line.startswith(("|", "![", "  - traces in")) and line not in reasons]
    assert max(map(len, prose)) <= 80, max(prose, key=len)

    out = buf.getvalue()
    closing = out[out.index("held-out answer accuracy"):]
    assert "strict  (\\boxed{N} = reference)           0.333    0.667" in closing
    assert f"smallest gain detectable at n=6 (80% power, 5% two-sided): {expected.mde:.3f}" in closing
    assert max(len(line) for line in closing.splitlines()[:5]) <= 80
    # printed last: the decision with its reason, then the report's path
    tail = [line for line in out.splitlines() if line.strip()][-2:]
    assert tail[0].startswith("decision: REJECT: ") and tail[1].startswith("report: ")
    assert tail[1].endswith("beside it)") or "beside it)" in out[out.index("report: "):]


@pytest.mark.parametrize(("deadline", "spent", "untuned_s", "online_s"), [
    (True, 100.0, 200.0, 900 - 100 - 1.2 * 200 - 15),  # the deadline leaves less than the cap
    (True, 10.0, 20.0, 720.0),  # a fast host: the cap
    (True, 500.0, 400.0, 0.0),  # nothing left (one iteration still runs)
    (False, 500.0, 400.0, 720.0),  # no deadline: the cap, whatever the rest took
])
def test_the_on_policy_stage_gets_what_the_deadline_leaves(monkeypatch, deadline, spent, untuned_s, online_s):
    import dataclasses

    from marft_lg import demo

    monkeypatch.setattr(demo.time, "perf_counter", lambda: 1000.0 + spent)
    run = types.SimpleNamespace(budget=dataclasses.replace(BUDGETS["full"], deadline=deadline), served_at=1000.0,
                                untuned_heldout_s=untuned_s, log=None)
    plan = demo.DemoRun.online_budget(run)
    assert plan["online_s"] == pytest.approx(online_s)
    assert plan["cap_s"] == BUDGETS["full"].online_minutes * 60 == 720
    assert plan["deadline_s"] == (900 if deadline else None) and plan["spent_s"] == spent
    assert plan["tuned_side_s"] == pytest.approx(1.2 * untuned_s)
