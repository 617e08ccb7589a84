"""benchmarks/learn.py: its pure parts (grid, arms -> run_demo kwargs, a finished run's figures, the aggregate, the
table) on hand-made run directories; no model is loaded."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from marft_lg.demo import BUDGETS

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "learn.py"
_spec = importlib.util.spec_from_file_location("learn_bench", _PATH)
learn = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(learn)


# ------------------------------------------------------------------------------------------------------ grid


def test_parse_grid_crosses_every_axis_in_order():
    grid = learn.parse_grid("learning_rate=5e-5,1e-4; group_size=4,8")
    assert grid == [{"learning_rate": 5e-5, "group_size": 4}, {"learning_rate": 5e-5, "group_size": 8},
                    {"learning_rate": 1e-4, "group_size": 4}, {"learning_rate": 1e-4, "group_size": 8}]
    assert learn.parse_grid(None) == [{}]
    assert learn.parse_grid("  ") == [{}]


def test_parse_grid_values_are_typed():
    grid = learn.parse_grid("kl_cut=none,0.05;credit_normalize=per_agent;normalize_advantages=false;ppo_epochs=2")
    assert grid[0] == {"kl_cut": None, "credit_normalize": "per_agent", "normalize_advantages": False,
                       "ppo_epochs": 2}
    assert isinstance(grid[1]["kl_cut"], float)


@pytest.mark.parametrize("spec, match", [
    ("no_such_key=1", "unknown key 'no_such_key'"),
    ("temperature=0.7", "not a setting here.*rollout_temperature"),
    ("lora_rank=8", "not a setting here.*lora.r"),
    ("target_modules=q_proj", "use lora.target_modules"),
    ("lora.rank=8", "unknown LoRA key 'lora.rank'.*lora.r"),
    ("n_heldout=64", "yardstick"),
    ("max_new_tokens=64", "not a credit override.*max_tokens"),
    ("seed=3", "use --seeds"),
    ("dynamic_sampling=true", "it is an arm"),
    ("warm_start.nope=1", "unknown warm start key.*warm_start.epochs"),
    ("learning_rate", "not key=value"),
    ("learning_rate=", "has no values"),
    ("learning_rate=1e-4;learning_rate=1e-3", "given twice"),
])
def test_parse_grid_refuses_with_a_clear_message(spec, match):
    with pytest.raises(ValueError, match=match):
        learn.parse_grid(spec)


def test_label_is_a_safe_directory_name():
    assert learn.label("baseline", {}) == "baseline"
    assert learn.label("both", {"learning_rate": 0.0001, "warm_start.epochs": 1}) == \
        "both__learning_rate-0.0001__warm_start.epochs-1"
    assert "/" not in learn.label("baseline", {"credit_normalize": "a/b"})


# ----------------------------------------------------------------------------------------- arm -> run_demo


def test_arms_map_onto_credit_and_warm_start():
    base = learn.demo_kwargs("baseline", {}, "full", 0)  # the demo's default is on: the arms without it say off
    assert base["credit"] == {"dynamic_sampling": False} and base["warm_start"] is None and base["seed"] == 0
    assert base["budget"] == BUDGETS["full"]
    ds = learn.demo_kwargs("dynamic_sampling", {}, "quick", 1)
    assert ds["credit"] == {"dynamic_sampling": True} and ds["warm_start"] is None and ds["budget"].name == "quick"
    ws = learn.demo_kwargs("warm_start", {}, "full", 2)
    assert ws["credit"] == {"dynamic_sampling": False} and ws["warm_start"] == {}
    both = learn.demo_kwargs("both", {}, "smoke", 0)
    assert both["credit"] == {"dynamic_sampling": True} and both["warm_start"] == {}


def test_grid_settings_go_where_they_live():
    kw = learn.demo_kwargs("both", {"learning_rate": 1e-4, "group_size": 8, "online_minutes": 6,
                                    "warm_start.epochs": 1}, "full", 0)
    assert kw["credit"] == {"dynamic_sampling": True, "learning_rate": 1e-4}
    assert kw["warm_start"] == {"epochs": 1}
    assert kw["budget"].group_size == 8 and kw["budget"].online_minutes == 6.0
    assert isinstance(kw["budget"].online_minutes, float)
    assert kw["budget"].scenarios_per_iteration == BUDGETS["full"].scenarios_per_iteration
    assert BUDGETS["full"].group_size == 4  # the shared budget is not changed


def test_lora_and_the_rollout_temperature_reach_run_demo():
    kw = learn.demo_kwargs("baseline", learn.parse_grid(
        "lora.r=4;lora.target_modules=q_proj+v_proj;rollout_temperature=0.7")[0], "full", 0)
    assert kw["lora"] == {"r": 4, "target_modules": "q_proj+v_proj"} and kw["rollout_temperature"] == 0.7
    assert kw["credit"] == {"dynamic_sampling": False} and kw["warm_start"] is None
    plain = learn.demo_kwargs("baseline", {}, "full", 0)
    assert plain["lora"] is None and plain["rollout_temperature"] is None
    item = learn.plan(["baseline"], learn.parse_grid("lora.r=4;rollout_temperature=0.7"), [0], "smoke")[0]
    assert item["label"] == "baseline__lora.r-4__rollout_temperature-0.7"
    assert "lora {'r': 4}, rollout_temperature 0.7" in learn.describe(item)


def test_the_demo_reads_lora_keys_into_settings():
    from marft_lg.demo import _lora_settings, _rollout_temperature

    s = _lora_settings({"r": 4, "alpha": 8, "target_modules": "q_proj+v_proj"})
    assert (s.r, s.alpha, s.target_modules) == (4, 8, ["q_proj", "v_proj"])
    assert _lora_settings(None) is None
    assert _rollout_temperature(None, 0.9) == 0.9 and _rollout_temperature(0.5, 0.9) == 0.5
    with pytest.raises(ValueError, match="rank"):
        _lora_settings({"rank": 4})


@pytest.mark.parametrize("arm, settings, match", [
    ("baseline", {"warm_start.epochs": 1}, "needs an arm with the warm start"),
    ("nope", {}, "unknown arm"),
    ("baseline", {"learning_rate": -1.0}, "learning_rate"),
    ("baseline", {"credit_normalize": "sideways"}, "credit_normalize"),
    ("baseline", {"group_size": 2.5}, "group_size must be an int"),
    ("baseline", {"online_minutes": 0}, "online_minutes must be > 0"),
    ("warm_start", {"warm_start.epochs": 0}, "epochs"),
    ("baseline", {"lora.r": 0}, "lora: r: must be >= 1"),
    ("baseline", {"lora.dropout": 1.5}, "dropout"),
    ("baseline", {"lora.target_modules": "+"}, "target_modules"),
    ("baseline", {"rollout_temperature": 0}, "rollout_temperature must be in"),
    ("baseline", {"rollout_temperature": "hot"}, "rollout_temperature must be in"),
])
def test_demo_kwargs_refuse_bad_values_before_any_run(arm, settings, match):
    with pytest.raises(ValueError, match=match):
        learn.demo_kwargs(arm, settings, "full", 0)


def test_plan_is_seed_major_with_one_run_dir_each(tmp_path):
    items = learn.plan(["baseline", "both"], learn.parse_grid("learning_rate=1e-4,1e-3"), [0, 1], "smoke", tmp_path)
    assert [(i["seed"], i["label"]) for i in items] == [
        (0, "baseline__learning_rate-0.0001"), (0, "baseline__learning_rate-0.001"),
        (0, "both__learning_rate-0.0001"), (0, "both__learning_rate-0.001"),
        (1, "baseline__learning_rate-0.0001"), (1, "baseline__learning_rate-0.001"),
        (1, "both__learning_rate-0.0001"), (1, "both__learning_rate-0.001")]
    assert items[0]["run_dir"] == tmp_path / "baseline__learning_rate-0.0001-seed0"
    assert len({i["run_dir"] for i in items}) == len(items)
    assert "credit {'dynamic_sampling': True, 'learning_rate': 0.0001}" in learn.describe(items[2])


def test_dry_run_prints_the_plan_and_runs_nothing(tmp_path, capsys):
    out = tmp_path / "learn.json"
    assert learn.main(["--dry-run", "--seeds", "0,1", "--budget", "smoke", "--out", str(out),
                       "--runs-root", str(tmp_path / "runs")]) == 0
    text = capsys.readouterr().out
    assert "8 runs" in text and "both seed 1" in text
    assert not out.exists() and not (tmp_path / "runs").exists()


def test_main_refuses_a_bad_grid(capsys):
    with pytest.raises(SystemExit):
        learn.main(["--dry-run", "--grid", "lora.rank=4,8"])
    assert "LoRA" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- a finished run


def _ci(mean, low, high, n=128):
    return {"mean": mean, "low": low, "high": high, "n": n, "confidence": 0.95, "dropped": 0}


def _row(iteration, phase, **extra):
    row = {"iteration": iteration, "phase": phase, "episodes": 16, "actions": 32, "reward_mean": 0.5,
           "reward_std": 0.3, "components": {"task_completion": 0.2}, "trained_agents": ["reasoner", "actor"],
           "time_s": 30.0, "tokens": 600, "groups": 4, "equal_groups": 1, "single_groups": 0,
           "equal_groups_share": 0.25, "trained_actions": 32, "zero_advantage_share": 0.25}
    row.update(extra)
    return row


def fake_run(root: Path, seed: int = 0, *, gain=(0.2, 0.1, 0.3), tc=(0.06, 0.01, 0.11),
             strict=(0.15, 0.3), promote=True, comparison_file=False, dynamic=False, warm=False,
             run: Path | None = None) -> Path:
    """A finished demo run directory with the files `collect` reads, shaped like a real run's."""
    run = run or root / f"run-seed{seed}"
    (run / "train").mkdir(parents=True)
    components = {"task_completion": _ci(*tc), "format_compliance": _ci(0.02, 0.0, 0.05),
                  "goal_progress": _ci(0.21, 0.1, 0.3)}
    summary = {
        "budget": {"name": "full", "minutes": 15, "group_size": 4, "scenarios_per_iteration": 4},
        "model": "embedded:smollm2-135m-instruct", "seed": seed, "run_dir": str(run),
        "untuned_train_reward": 0.3, "train_iterations": 3, "train_reward_curve": [0.3, 0.4, 0.5],
        "heldout": {"pairs": 128, "baseline_reward": 0.6, "candidate_reward": 0.6 + gain[0],
                    "difference": _ci(*gain), "mde": {"mde": 0.09, "n": 128, "sd": 0.36, "alpha": 0.05, "power": 0.8},
                    "accuracy": {"baseline": {"strict": strict[0], "lenient": 0.2, "n": 128},
                                 "candidate": {"strict": strict[1], "lenient": 0.35, "n": 128}}},
        "gate": {"promote": promote, "reasons": [] if promote else ["95% CI [-0.1, +0.2] (lower bound must be > 0)"]},
        "minutes": 13.4, "code": {"commit": "a" * 40, "dirty": False, "machine": {"cpus": 2}},
    }
    (run / "summary.json").write_text(json.dumps(summary))
    log = [{"event": "start", "elapsed_s": 0.0}, {"event": "offline", "elapsed_s": 60.0, "iterations": 1}]
    compare = {"event": "compare", "elapsed_s": 700.0, "n_pairs": 128, "team_reward": _ci(*gain),
               "components": components, "agents": {}}
    if comparison_file:  # an older layout: the component CIs only in compare/comparison.json
        (run / "compare").mkdir()
        (run / "compare" / "comparison.json").write_text(json.dumps({k: v for k, v in compare.items()
                                                                     if k not in ("event", "elapsed_s")}))
    else:
        log.append(compare)
    log.append({"event": "done", "elapsed_s": 800.0, "minutes": 13.4})
    (run / "demo_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    rows = []
    if warm:
        rows.append({"iteration": 0, "phase": "warm_start", "keep": "best_of_group", "episodes": 32,
                     "kept_episodes": 6, "actions": 12, "tokens": 300, "elapsed_s": 12.0, "tokens_per_min": 1500.0})
    rows.append(_row(len(rows), "offline", scoring_s=1.0, update_s=29.0, iteration_s=30.0, tokens_per_min=1200.0))
    ds1 = {"dynamic_sampling": {"draws": 2, "wanted": 4, "informative": 4, "dropped_groups": 2, "short": 0}} \
        if dynamic else {}
    ds2 = {"dynamic_sampling": {"draws": 4, "wanted": 4, "informative": 0, "dropped_groups": 4, "dropped_equal": 4,
                                "dropped_single": 0, "short": 4}} \
        if dynamic else {}
    rows.append(_row(len(rows), "online", rollout_s=14.0, scoring_s=1.0, update_s=27.0, iteration_s=42.0,
                     tokens_per_min=800.0, equal_groups_share=0.5, zero_advantage_share=0.5, **ds1))
    if dynamic:  # nothing informative in its draws: the update is skipped (the trainer's `_skipped_iteration` row)
        rows.append({"iteration": len(rows), "phase": "online", "episodes": 16, "reward_mean": 0.0,
                     "reward_std": 0.0, "actions": 0, "trained_agents": [], "updated_agents": [], "agents": {},
                     "skipped_update": "nothing informative", "iteration_s": 20.0, "rollout_s": 20.0,
                     "scoring_s": 0.0, **ds2})
    else:
        rows.append(_row(len(rows), "online", rollout_s=14.0, scoring_s=1.0, update_s=27.0, iteration_s=42.0,
                         tokens_per_min=None, equal_groups_share=None, zero_advantage_share=None))
    (run / "train" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_collect_reads_the_summary_the_component_cis_and_the_waste(tmp_path):
    r = learn.collect(fake_run(tmp_path))
    assert r["seed"] == 0 and r["minutes"] == 13.4 and r["promote"] is True
    assert r["gain"] == {"mean": 0.2, "low": 0.1, "high": 0.3, "n": 128}
    assert r["task_completion"] == {"mean": 0.06, "low": 0.01, "high": 0.11, "n": 128}
    assert set(r["components"]) == {"task_completion", "format_compliance", "goal_progress"}
    assert r["strict"] == {"untuned": 0.15, "tuned": 0.3} and r["lenient"] == {"untuned": 0.2, "tuned": 0.35}
    assert r["mde"] == 0.09 and r["heldout_n"] == 128 and r["code"]["commit"] == "a" * 40
    assert r["iterations"] == {"warm_start": 0, "offline": 1, "online": 2}
    assert r["online_training_minutes"] == pytest.approx((14 + 30) * 2 / 60, abs=0.01)
    w = r["waste"]
    assert w["equal_groups_share"] == pytest.approx((0.25 + 0.5) / 2)  # a None (no comparable group) is left out
    assert w["equal_groups_share_online"] == pytest.approx(0.5)
    assert w["zero_advantage_share"] == pytest.approx((0.25 + 0.5) / 2)
    assert w["tokens_per_min"] == pytest.approx(1000.0)
    assert w["tokens_trained"] == 1800
    assert w["time_minutes"] == {"rollout": round(28 / 60, 2), "scoring": round(3 / 60, 2), "replay": 0.0,
                                 "update": round(83 / 60, 2)}
    assert w["dynamic_sampling"] is None and w["skipped_updates"] == 0 and w["warm_start"] is None


def test_collect_counts_dynamic_sampling_draws_and_skipped_iterations(tmp_path):
    w = learn.collect(fake_run(tmp_path, dynamic=True, warm=True))["waste"]
    assert w["dynamic_sampling"] == {"iterations": 2, "draws": 6, "extra_draws": 4, "dropped_groups": 6,
                                     "short_iterations": 1}
    assert w["skipped_updates"] == 1
    assert w["warm_start"] == {"kept_episodes": 6, "actions": 12, "minutes": 0.2}
    # the skipped row has no group counts: its draws' groups were all equal (4 of 4)
    assert w["equal_groups_share_online"] == pytest.approx((0.5 + 1.0) / 2)
    assert w["tokens_per_min"] == pytest.approx(1000.0)  # the warm start's own throughput stays apart


def test_equal_share_from_the_row_else_from_its_dynamic_sampling_report():
    assert learn.equal_share({"equal_groups_share": 0.25}) == 0.25
    assert learn.equal_share({"dynamic_sampling": {"informative": 1, "dropped_equal": 3}}) == 0.75
    assert learn.equal_share({"dynamic_sampling": {"informative": 0, "dropped_equal": 0}}) is None
    assert learn.equal_share({"equal_groups_share": None}) is None


def test_collect_falls_back_to_comparison_json_for_the_components(tmp_path):
    r = learn.collect(fake_run(tmp_path, comparison_file=True))
    assert r["task_completion"]["low"] == 0.01


def test_collect_without_component_cis_says_none(tmp_path):
    run = fake_run(tmp_path)
    rows = [json.loads(x) for x in (run / "demo_log.jsonl").read_text().splitlines()]
    (run / "demo_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if r["event"] != "compare"))
    r = learn.collect(run)
    assert r["task_completion"] is None and r["components"] == {}


# ------------------------------------------------------------------------------------------ aggregate, table


def _runs(tmp_path: Path) -> list[dict]:
    specs = [  # label, arm, seed, gain CI, task_completion CI, strict, promote
        ("baseline", "baseline", 0, (0.17, 0.06, 0.28), (0.05, 0.01, 0.1), (0.15, 0.2), True),
        ("baseline", "baseline", 1, (-0.1, -0.18, -0.01), (-0.05, -0.1, 0.0), (0.16, 0.06), False),
        ("baseline", "baseline", 2, (0.05, -0.05, 0.15), (0.02, -0.02, 0.06), (0.1, 0.2), False),
        ("both", "both", 0, (0.3, 0.2, 0.4), (0.1, 0.05, 0.15), (0.15, 0.4), True),
        ("both", "both", 1, (0.25, 0.15, 0.35), (0.08, 0.02, 0.14), (0.16, 0.3), True),
    ]
    runs = []
    for name, arm, seed, gain, tc, strict, promote in specs:
        d = fake_run(tmp_path / name, seed, gain=gain, tc=tc, strict=strict, promote=promote,
                     dynamic=arm == "both", warm=arm == "both")
        runs.append({"label": name, "arm": arm, "settings": {}, **learn.collect(d), "commit": "a" * 40})
    return runs


def test_aggregate_per_arm(tmp_path):
    agg = learn.aggregate(_runs(tmp_path))
    assert list(agg) == ["baseline", "both"]
    b = agg["baseline"]
    assert b["seeds"] == [0, 1, 2] and b["promoted"] == 1
    assert b["mean_gain"] == pytest.approx((0.17 - 0.1 + 0.05) / 3)
    assert b["worst_seed"] == {"seed": 1, "gain": -0.1}
    assert b["task_completion_above_zero"] == [0]
    assert b["worse"] == [1]
    assert b["strict_doubled"] == [2]  # 0.10 -> 0.20; 0.15 -> 0.20 is not double
    assert b["strict_untuned"] == pytest.approx((0.15 + 0.16 + 0.1) / 3)
    a = agg["both"]
    assert a["promoted"] == 2 and a["worse"] == [] and a["task_completion_above_zero"] == [0, 1]
    assert a["strict_doubled"] == [0] and a["worst_seed"] == {"seed": 1, "gain": 0.25}
    assert a["mean_minutes"] == pytest.approx(13.4)


def test_aggregate_keeps_grid_points_apart(tmp_path):
    runs = _runs(tmp_path)[:2]
    runs[1] = {**runs[1], "label": "baseline__learning_rate-0.0001", "settings": {"learning_rate": 1e-4}}
    agg = learn.aggregate(runs)
    assert list(agg) == ["baseline", "baseline__learning_rate-0.0001"]
    assert agg["baseline__learning_rate-0.0001"]["settings"] == {"learning_rate": 1e-4}


def test_table_shows_each_arm_then_each_run(tmp_path):
    runs = _runs(tmp_path)
    runs[4] = {**runs[4], "label": "both__learning_rate-0.0001", "settings": {"learning_rate": 1e-4}}
    results = {"commit": "b" * 40, "budget": "full", "runs": runs, "aggregate": learn.aggregate(runs)}
    text = learn.table(results)
    lines = text.splitlines()
    assert lines[0] == "Budget `full`, measured at `bbbbbbb`."
    head = [x for x in lines if x.startswith("| arm |")]
    assert head and head[0].count("|") == lines[lines.index(head[0]) + 1].count("|")
    base = next(x for x in lines if x.startswith("| baseline |"))
    assert "| 0,1,2 | 1/3 | +0.040 | -0.100 (seed 1) | 1/3 | 1/3 | 0.14 -> 0.15 (1/3) |" in base
    assert any(x.startswith("| +both | 0 | 1/1 |") for x in lines)
    assert any(x.startswith("| +both (learning_rate=0.0001) | 1 |") for x in lines)
    run_rows = [x for x in lines if x.startswith("| baseline | ") and "[" in x]
    assert len(run_rows) == 3
    assert "| +0.170 [+0.060, +0.280] | +0.050 [+0.010, +0.100] | 0.15 -> 0.20 |" in run_rows[0]
    assert "**promote**" in run_rows[0] and run_rows[1].endswith("| reject |")
    dyn = [x for x in lines if x.startswith("| both | 0 |")]
    assert dyn and "| 6 (1) |" in dyn[0]


def test_table_mode_reads_the_results_file(tmp_path, capsys):
    runs = _runs(tmp_path)
    out = tmp_path / "learn.json"
    out.write_text(json.dumps({"commit": "c" * 40, "budget": "full", "runs": runs}))  # no aggregate: computed
    assert learn.main(["--table", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| baseline | 0,1,2 | 1/3 |" in text and "measured at `ccccccc`" in text
    with pytest.raises(SystemExit):
        learn.main(["--table", "--out", str(tmp_path / "missing.json")])


def test_main_runs_the_missing_runs_and_append_resumes(tmp_path, monkeypatch, capsys):
    out, runs_root, children = tmp_path / "learn.json", tmp_path / "runs", []

    def child(spec):  # stands in for the demo's child process: a finished run in its run directory
        children.append(spec)
        fake_run(tmp_path, spec["seed"], run=Path(spec["run_dir"]),
                 dynamic=bool((spec["credit"] or {}).get("dynamic_sampling")))

    monkeypatch.setattr(learn, "run_child", child)
    monkeypatch.setattr(learn, "ROOT", tmp_path)  # the traces removed before each run are under tmp_path
    argv = ["--budget", "smoke", "--arms", "baseline,dynamic_sampling", "--out", str(out), "--runs-root",
            str(runs_root)]
    assert learn.main([*argv, "--seeds", "0"]) == 0
    assert [(c["seed"], c["credit"]) for c in children] == [(0, {"dynamic_sampling": False}), (0, {"dynamic_sampling": True})]
    assert children[0]["budget"]["name"] == "smoke" and children[0]["run_dir"] == str(runs_root / "baseline-seed0")
    data = json.loads(out.read_text())
    assert data["benchmark"] == "learn" and data["budget"] == "smoke" and "machine" in data and "commit" in data
    assert [(r["label"], r["seed"]) for r in data["runs"]] == [("baseline", 0), ("dynamic_sampling", 0)]
    assert set(data["aggregate"]) == {"baseline", "dynamic_sampling"}
    children.clear()
    assert learn.main([*argv, "--seeds", "0,1", "--append"]) == 0
    assert [c["seed"] for c in children] == [1, 1]  # seed 0 was already there
    data = json.loads(out.read_text())
    assert [(r["label"], r["seed"]) for r in data["runs"]] == [("baseline", 0), ("dynamic_sampling", 0),
                                                                 ("baseline", 1), ("dynamic_sampling", 1)]
    assert data["aggregate"]["baseline"]["seeds"] == [0, 1]
    with pytest.raises(SystemExit):  # another budget's results are not resumed
        learn.main([*argv, "--budget", "quick", "--seeds", "0", "--append"])
    assert "was measured with budget 'smoke'" in capsys.readouterr().err

    # what an earlier session put beside the runs stays; --replace runs a held run again and keeps the old one
    data["reference_runs"] = [{"label": "elsewhere"}]
    out.write_text(json.dumps(data))
    children.clear()
    assert learn.main([*argv, "--seeds", "1", "--arms", "dynamic_sampling", "--append", "--replace"]) == 0
    assert [(c["seed"], c["credit"]) for c in children] == [(1, {"dynamic_sampling": True})]
    again = json.loads(out.read_text())
    assert again["reference_runs"] == [{"label": "elsewhere"}]
    assert [(r["label"], r["seed"]) for r in again["runs"]] == [("baseline", 0), ("dynamic_sampling", 0),
                                                                  ("baseline", 1), ("dynamic_sampling", 1)]
    old = [s for s in again["superseded"] if (s["run"]["label"], s["run"]["seed"]) == ("dynamic_sampling", 1)]
    assert len(old) == 1 and old[0]["run"] == data["runs"][3] and "--replace" in old[0]["reason"]
    with pytest.raises(SystemExit):  # nothing to replace in a new file
        learn.main([*argv, "--seeds", "0", "--replace"])
    assert "--replace needs --append" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------- --adopt


def demo_cli_run(root: Path, seed: int, **start_over) -> Path:
    """A finished run as `marft-lg demo --seed N` (benchmarks/demo.py) leaves it: its start event says what it ran
    with (no credit overrides, no warm start, the team's LoRA, the math team's rollout temperature)."""
    from marft_lg.examples.math_team.settings import ROLLOUT_TEMPERATURE

    run = fake_run(root, seed, run=root / f"demo-bench-seed{seed}", dynamic=True)
    start = {"event": "start", "elapsed_s": 0.0, "budget": BUDGETS["full"].to_dict(), "model": learn.MODEL,
             "seed": seed, "credit": {}, "warm_start": None, "lora": None, "rollout_temperature": ROLLOUT_TEMPERATURE,
             **start_over}
    rows = [json.loads(x) for x in (run / "demo_log.jsonl").read_text().splitlines()]
    (run / "demo_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [start, *rows[1:]]))
    return run


def test_adopt_takes_a_demo_run_as_the_arm_it_is(tmp_path):
    items = learn.plan(["baseline", "dynamic_sampling"], [{}], [0, 1], "full", tmp_path / "runs")
    run = demo_cli_run(tmp_path, 1)
    assert learn.adopt([run], items, learn.MODEL) == {("dynamic_sampling", 1): run}  # the demo's default is on
    with pytest.raises(ValueError, match=r"none of the planned runs; closest dynamic_sampling seed 1: it ran with "
                                         r"rollout_temperature 0\.6"):
        learn.adopt([demo_cli_run(tmp_path / "cold", 1, rollout_temperature=0.6)], items, learn.MODEL)
    with pytest.raises(ValueError, match="closest baseline seed 0: it ran with marft"):  # dynamic sampling off
        learn.adopt([demo_cli_run(tmp_path / "off", 0, credit={"dynamic_sampling": False, "kl_cut": 0.5})],
                    items, learn.MODEL)
    with pytest.raises(ValueError, match="are both dynamic_sampling seed 1"):
        learn.adopt([run, demo_cli_run(tmp_path / "again", 1)], items, learn.MODEL)
    with pytest.raises(ValueError, match="not a finished demo run"):
        learn.adopt([tmp_path / "nothing"], items, learn.MODEL)


def test_main_adopts_instead_of_running(tmp_path, monkeypatch, capsys):
    out, children = tmp_path / "learn.json", []

    def child(spec):
        children.append(spec)
        fake_run(tmp_path, spec["seed"], run=Path(spec["run_dir"]))

    monkeypatch.setattr(learn, "run_child", child)
    monkeypatch.setattr(learn, "ROOT", tmp_path)
    adopted = demo_cli_run(tmp_path / "bench", 0)
    argv = ["--arms", "baseline,dynamic_sampling", "--seeds", "0", "--out", str(out), "--runs-root",
            str(tmp_path / "runs")]
    assert learn.main([*argv, "--adopt", str(adopted)]) == 0
    assert [c["credit"] for c in children] == [{"dynamic_sampling": False}]  # only the baseline ran
    runs = {r["label"]: r for r in json.loads(out.read_text())["runs"]}
    assert runs["dynamic_sampling"]["run_dir"] == str(adopted) and runs["dynamic_sampling"]["adopted"] is True
    assert runs["dynamic_sampling"]["commit"] == "a" * 40 and runs["dynamic_sampling"]["machine"] == {"cpus": 2}
    assert "adopted" not in runs["baseline"] and adopted.is_dir()  # an adopted run's files are left where they are
    with pytest.raises(SystemExit):  # the file holds it: replacing it is said
        learn.main([*argv, "--append", "--adopt", str(adopted)])
    assert "already holds dynamic_sampling seed 0; add --replace" in capsys.readouterr().err
    children.clear()
    assert learn.main([*argv, "--append", "--replace", "--adopt", str(adopted)]) == 0
    assert len(children) == 1 and len(json.loads(out.read_text())["superseded"]) == 2
