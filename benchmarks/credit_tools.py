"""Credit estimators on a tool-using team at equal training time: examples/supervisor_tools (a supervisor that hands
off by a forced tool call to two prebuilt ReAct workers, a researcher with `lookup` and a mathematician with
add / multiply / divide), on-policy MARFT from untuned adapters with `credit: group`, `credit: reward_to_go` and with `credit:
counterfactual`, then the tuned team shadow-compared with the untuned one on held-out questions (greedy, paired).
The reward (`REWARD`): the answer names the reference, plus partial credit for the right hand-off and the right
tool (scenario checkpoints, `goal_progress`); tool errors and steps cost a little.

    python benchmarks/credit_tools.py --seeds 0,1,2 --online-minutes 14 --per-iteration 2 --heldout 24

Each episode runs under a LangGraph step limit (`--recursion-limit`, default 8: a worker's ReAct loop ends after at
most 4 calls). Without it one untuned on-policy iteration on 2 CPU cores ran 16 episodes of 124 actions (prompts
1,448 tokens on average, up to 5,401: the untuned mathematician looped on tool calls, one episode took 51 actions)
and its update had not ended after 13 minutes; with it and 2 questions per iteration an iteration takes 10 s to 2
minutes.

The questions are generated (arithmetic with fresh numbers, the three facts asked several ways), a stream for
training and a disjoint held-out set. The supervisor's hand-offs are tool calls, so every worker step has tool calls
upstream: counterfactual replays run those tools again (`replay_tools: rerun`; they have no side effects). Writes
benchmarks/results/credit_tools.json: `commit`, settings, `runs: [{estimator, seed, minutes, iterations, gain, ci_low,
ci_high, minutes_to_significance, components, checkpoints, agents, ...}]` (as credit.json: `minutes` counts
rollouts, updates, replays and the warm start; `minutes_to_significance` is measured at the end of the budget only).

Each run also says where its gain came from: per reward component (`components`: the answer, the checkpoints, tool
errors, steps), per checkpoint (`checkpoints`: the right hand-off and the right tool, each scored alone) and per agent
(`agents`: the reward each agent earned and its tool accuracy), each a paired 95% CI over the held-out questions,
and where its time went (`rollout_s_by_iteration`, `update_s_by_iteration`). `--append` keeps the runs already in
`--out`; `--append --replace` runs the planned ones again, the older ones moving to `superseded`.
`--warm-start N` first runs the untuned team K times on N training questions and fine-tunes each agent on its own
actions in the best episode of each question (`training.warm_start`), inside the same time budget.

    python benchmarks/credit_tools.py --estimators group --seeds 0,1,2 --online-minutes 12 --heldout 24 \
        --out benchmarks/results/tools_learn.json
    python benchmarks/credit_tools.py --table benchmarks/results/tools_learn.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "supervisor_tools"
RESULTS = ROOT / "benchmarks" / "results" / "credit_tools.json"
ROLES = ["supervisor", "researcher", "mathematician"]
MODEL = "embedded:smollm2-135m-instruct"
SETTINGS = {"learning_rate": 1e-3, "update_scheme": "simultaneous", "use_critic": False, "temperature": 0.8,
            "ppo_epochs": 1, "num_minibatches": 2, "kl_cut": None, "entropy_coef": 0.0, "max_new_tokens": 48,
            "max_context": 2048, "plots": False, "checkpoint_every": 1000}
# The same 4 questions per iteration; counterfactual runs 2 episodes per question instead of 4 and replays half of
# them (one replay per action, ~4 actions an episode), about group's rollouts per iteration.
ESTIMATORS = {
    "group": {"credit": "group", "group_size": 4},
    # each action's return from it on, against the same agent's in its group: the worker is not paid for the
    # supervisor's hand-off (REWARD places each checkpoint on the action that met it)
    "reward_to_go": {"credit": "reward_to_go", "group_size": 4},
    "counterfactual": {"credit": "counterfactual", "group_size": 2, "replays_per_action": 1, "replay_fraction": 0.5,
                       "replay_tools": "rerun"},
}
TOOL_OF = {"plus": "add", "times": "multiply", "divided by": "divide"}
CHECKPOINTS = ("handoff", "tool")  # what each question's two checkpoints ask, in order
# The team's reward: the answer names the reference, and partial credit for the steps to it (the supervisor's
# hand-off to the right worker, that worker's right tool), which an untuned team sometimes takes; tool errors and
# steps cost a little. (With the example's own reward.yaml, answer or nothing, the untuned team almost never earned
# anything and `group` training collapsed within 4 iterations to a supervisor that calls `finish` at once: doing
# nothing cost less than trying.) Each checkpoint's share sits on the action that met it (`credit: shaped`), the
# answer on the answering worker's last action: the same episode return, so `group` reads it as before.
REWARD = {"weights": {"task_completion": 1.0, "goal_progress": 0.5, "tool_error_rate": -0.2, "step_count": -0.02},
          "components": {"task_completion": {"match": "contains"}}, "credit": "shaped",
          "answer_agents": ["researcher", "mathematician"]}
FACTS = {"otel": "OpenTelemetry", "lora": "low-rank", "ppo": "clips"}
ASK_FACT = ["What is {t}?", "Tell me about {t}.", "What does {t} mean?", "Explain {t} in one sentence.",
            "Give me a fact about {t}.", "I need to know what {t} is."]


def questions(n: int, rng: random.Random, taken: set[str]) -> list:
    """`n` fresh questions (a third facts, the rest arithmetic), none of them in `taken` (which they join)."""
    from marft_lg.trajectories.scenarios import Scenario

    out = []
    while len(out) < n:
        if rng.random() < 1 / 3:
            topic = rng.choice(sorted(FACTS))
            text, ref, sid = rng.choice(ASK_FACT).format(t=topic), FACTS[topic], f"fact-{topic}"
            steps = ["tool:transfer_to_researcher", "tool:lookup"]
        else:
            a, b = rng.randint(2, 30), rng.randint(2, 30)
            op = rng.choice(["plus", "times", "divided by"])
            if op == "divided by":
                a *= b
            value = {"plus": a + b, "times": a * b, "divided by": a // b}[op]
            text, ref, sid = f"What is {a} {op} {b}?", str(value), f"{op.split()[0]}-{a}-{b}"
            steps = ["tool:transfer_to_mathematician", f"tool:{TOOL_OF[op]}"]
        if text in taken:
            continue
        taken.add(text)
        out.append(Scenario(f"{sid}-{len(taken)}", {"messages": [{"role": "user", "content": text}]}, reference=ref,
                            checkpoints=steps))
    return out


def checkpoint_gains(baseline: Any, candidate: Any, scenarios: list, *, seed: int = 0) -> dict[str, dict]:
    """Per checkpoint position (`CHECKPOINTS`), the paired gain in the share of questions that met it: both sides'
    episodes scored by `goal_progress` against that one checkpoint only, so "right hand-off" and "right tool" read
    apart where the reward sums them."""
    from marft_lg.evaluation.comparison import compare_datasets
    from marft_lg.rewards.composite import CompositeReward

    alone = CompositeReward.from_yaml({"weights": {"goal_progress": 1.0}})
    out = {}
    for i, name in enumerate(CHECKPOINTS):
        by_id = {s.scenario_id: {**s.to_dict(), "checkpoints": s.checkpoints[i:i + 1]} for s in scenarios}
        result = compare_datasets(baseline, candidate, alone, scenarios=by_id, seed=seed)
        out[name] = {**result.team.to_dict(), "baseline": result.side_mean("baseline", "reward"),
                     "candidate": result.side_mean("candidate", "reward")}
    return out


def where_from(result: Any, scenarios: list, *, seed: int = 0) -> dict[str, Any]:
    """A comparison's gain by reward component, by checkpoint and by agent (its reward and tool accuracy)."""
    agents = {a: {m: ms[m].to_dict() for m in ("reward", "tool_accuracy") if m in ms}
              for a, ms in result.agents.items()}
    return {"components": {k: {**v.to_dict(), "baseline": result.side_mean("baseline", k),
                               "candidate": result.side_mean("candidate", k)} for k, v in result.components.items()},
            "checkpoints": checkpoint_gains(result.datasets["baseline"], result.datasets["candidate"], scenarios,
                                            seed=seed),
            "agents": agents}


def online_budget_s(online_minutes: float, warm_start_minutes: float) -> float:
    """Seconds left for on-policy training after the warm start, inside the run's budget (never below 0)."""
    return max(0.0, 60 * (online_minutes - warm_start_minutes))


def one_run(estimator: str, seed: int, online_minutes: float, heldout: int, work: Path, *, per_iteration: int = 4,
            recursion_limit: int | None = None, warm_start: int = 0, overrides: dict | None = None) -> dict:
    from marft_lg.evaluation.shadow import shadow_compare
    from marft_lg.graph.app_spec import AppSpec
    from marft_lg.graph.collect import GraphCollector
    from marft_lg.rewards.composite import CompositeReward
    from marft_lg.serving.errors import RegistryError
    from marft_lg.training.config import MARFTConfig
    from marft_lg.training.metrics import read_metrics
    from marft_lg.training.trainer import MARFTTrainer
    from marft_lg.training.warm_start import WarmStartConfig

    overrides = dict(overrides or {})
    run = work / f"{estimator}-w{warm_start}-{'-'.join(f'{k}{v}' for k, v in sorted(overrides.items()))}-s{seed}"
    rng, taken = random.Random(seed), set()
    test = questions(heldout, rng, taken)
    stream = questions(400, rng, taken)
    reward = CompositeReward.from_yaml(REWARD)
    spec = AppSpec(app="app:build_graph", base_dir=str(EXAMPLE), model=MODEL, agents=ROLES,
                   registry=str(run / "registry"), versions=None, seed=seed, recursion_limit=recursion_limit,
                   chat_model={"max_tokens": SETTINGS["max_new_tokens"], "temperature": SETTINGS["temperature"]})
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    team = spec.build_team()
    apps = []
    try:
        untuned = {r: team.save_version(r, run_id="untuned") for r in ROLES}
        team.registry.promote(untuned, reason="benchmark: untuned")
        sampling = spec.build_app(team, run / "traces")
        apps.append(sampling)
        est = ESTIMATORS[estimator]
        cfg = MARFTConfig(**{**SETTINGS, **overrides}, **est, seed=seed, rollout_concurrency=4 * est["group_size"])
        trainer = MARFTTrainer(team, reward, cfg, run / "train", run_id=f"credit-tools-{estimator}", progress=False)
        warm = {}
        if warm_start:  # K untuned episodes on the stream's first questions, then their best teach each agent
            w0 = time.perf_counter()
            episodes = GraphCollector(sampling, concurrency=16, run_id="warm").collect(
                stream[:warm_start], est["group_size"], 0, seed)
            row = trainer.fit_warm_start(episodes, stream[:warm_start], WarmStartConfig())
            warm = {"warm_start_questions": warm_start, "warm_start_episodes": len(episodes),
                    "kept_episodes": row["kept_episodes"], "warm_start_minutes": round((time.perf_counter() - w0) / 60, 2)}
            stream = stream[warm_start:]
        left = online_budget_s(online_minutes, warm.get("warm_start_minutes", 0.0))
        if left > 0:
            trainer.fit_online(sampling, stream, 1000, scenarios_per_iteration=per_iteration, time_budget_s=left)
        else:  # the warm start is what was trained: publish it so the comparison sees it
            print(f"{run.name}: the warm start took all {online_minutes} minutes; no on-policy iteration",
                  file=sys.stderr)
            trainer.publish()
        trainer.close("FINISHED")
        tuned, not_updated = dict(team.versions()), []
        for role, version in tuned.items():  # a role no update reached has no new version: its candidate is untuned
            try:
                team.registry.resolve(role, version)
            except RegistryError:
                tuned[role] = untuned[role]
                not_updated.append(role)
        team.registry.set_alias("candidate", tuned, reason="benchmark: tuned")
        greedy = replace(spec, chat_model={"max_tokens": SETTINGS["max_new_tokens"], "temperature": 0.0}).build_app(
            team, run / "compare")
        apps.append(greedy)
        result = shadow_compare(greedy, "live", "candidate", test, reward, samples_per_scenario=1, seed=seed,
                                run_id=f"credit-tools-{estimator}-{seed}", concurrency=16, drift=False)
    finally:
        for app in apps:
            app.close()
        team.close()
    rows = [r for r in read_metrics(run / "train" / "metrics.jsonl") if r.get("phase") != "warm_start"]
    train_s = sum(float(r.get(k) or 0) for r in rows for k in ("time_s", "rollout_s", "replay_s"))  # replays too
    train_s += 60 * warm.get("warm_start_minutes", 0.0)
    d = result.team.to_dict()
    significant = d.get("low") is not None and d["low"] > 0
    return {
        "estimator": estimator, "warm_start": warm_start, "overrides": overrides, "seed": seed,
        "minutes": round(train_s / 60, 2),
        "iterations": len(rows), **warm,
        "gain": d["mean"], "ci_low": d.get("low"), "ci_high": d.get("high"), "pairs": d.get("n"),
        "minutes_to_significance": round(train_s / 60, 2) if significant else None,
        "replays": sum(int(r.get("replays") or 0) for r in rows),
        "replays_used": sum(int(r.get("replays_used") or 0) for r in rows),
        "replay_minutes": round(sum(float(r.get("replay_s") or 0) for r in rows) / 60, 2),
        "baseline_reward": result.side_mean("baseline", "reward"),
        "candidate_reward": result.side_mean("candidate", "reward"),
        "train_reward_by_iteration": [r.get("reward_mean") for r in rows],
        "rollout_s_by_iteration": [round(float(r.get("rollout_s") or 0), 1) for r in rows],
        "update_s_by_iteration": [round(float(r.get("update_s") or r.get("time_s") or 0), 1) for r in rows],
        "roles_not_updated": not_updated,
        "wall_minutes": round((time.perf_counter() - t0) / 60, 2),
        "load_avg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        **where_from(result, test, seed=seed),
    }


def parse_set(item: str) -> tuple[str, Any]:
    """``key=value`` -> (key, the value as YAML reads it); a key MARFTConfig lacks is an error naming it."""
    import yaml

    from marft_lg.training.config import MARFTConfig

    key, sep, value = item.partition("=")
    if not sep or key.strip() not in MARFTConfig.__dataclass_fields__:
        raise SystemExit(f"--set {item!r}: expected KEY=VALUE with KEY a MARFTConfig field")
    return key.strip(), yaml.safe_load(value)


def carry_over(before: dict, planned: set[tuple], *, replace: bool, commit: str) -> tuple[list[dict], list[dict]]:
    """(runs kept, superseded runs) of a results file `before` that `--append` extends: each run keeps its own
    commit; with `replace`, the runs whose key is `planned` move to `superseded`, saying why, to be run again."""
    runs = [{**r, "commit": r.get("commit", before["commit"])} for r in before["runs"]]
    superseded = list(before.get("superseded", []))
    if replace:
        again = [r for r in runs if run_key(r["estimator"], r.get("warm_start", 0), r.get("overrides"),
                                            r["seed"]) in planned]
        runs = [r for r in runs if r not in again]
        superseded += [{**r, "superseded_reason": f"run again at {commit[:7]} (--replace)"} for r in again]
    return runs, superseded


def run_key(estimator: str, warm_start: int, overrides: dict | None, seed: int) -> tuple:
    """What makes two runs the same run (`--append` skips a planned run whose key the file already holds)."""
    return estimator, warm_start, json.dumps(overrides or {}, sort_keys=True), seed


def _ci(d: dict | None) -> str:
    """``+0.125 [+0.031, +0.219]``, and the two sides' levels (``0.12 -> 0.25``) where the run recorded them."""
    if not d or d.get("mean") is None:
        return "n/a"
    from marft_lg.evaluation.stats import format_ci

    levels = f" ({d['baseline']:.2f} -> {d['candidate']:.2f})" if d.get("baseline") is not None else ""
    return f"{format_ci(d['mean'], d.get('low'), d.get('high'))}{levels}"


def table(results: dict) -> str:
    """One row per run: the team's gain, and where it came from (the answer, the hand-off, the tool, each agent)."""
    roles = sorted({a for r in results["runs"] for a in r.get("agents", {})})
    lines = ["| estimator | warm start, settings | seed | minutes (iterations) | team reward gain | answer right | right hand-off | "
             "right tool | " + " | ".join(f"{a} reward" for a in roles) + " |",
             "|---|---:|---:|---|---|---|---|---|" + "---|" * len(roles)]
    for r in results["runs"]:
        team = {"mean": r["gain"], "low": r["ci_low"], "high": r["ci_high"]}
        cps, comps = r.get("checkpoints", {}), r.get("components", {})
        extra = "".join(f", {k}={v}" for k, v in sorted((r.get("overrides") or {}).items()))
        lines.append(f"| {r['estimator']} | {r.get('warm_start', 0)}{extra} | {r['seed']} | {r['minutes']:.1f} "
                     f"({r['iterations']}) | {_ci(team)} | {_ci(comps.get('task_completion'))} | "
                     f"{_ci(cps.get('handoff'))} | {_ci(cps.get('tool'))} | "
                     + " | ".join(_ci(r.get("agents", {}).get(a, {}).get("reward")) for a in roles) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--estimators", default="group,counterfactual")
    ap.add_argument("--online-minutes", type=float, default=5.0)
    ap.add_argument("--heldout", type=int, default=32)
    ap.add_argument("--per-iteration", type=int, default=4, help="questions per on-policy iteration")
    ap.add_argument("--recursion-limit", type=int, default=8,
                    help="LangGraph step limit of each episode (a worker's tool loop ends before it); 0: LangGraph's own")
    ap.add_argument("--warm-start", type=int, default=0,
                    help="questions whose K untuned episodes' best teach each agent first (0: no warm start)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a MARFTConfig setting over SETTINGS for these runs (repeatable; recorded per run)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--table", type=Path, default=None, help="print the Markdown table of this results file and exit")
    ap.add_argument("--append", action="store_true",
                    help="keep the runs already in --out (same settings) and run only the missing estimator x seed")
    ap.add_argument("--replace", action="store_true",
                    help="with --append: run the planned runs again as well, each older one moving to `superseded`")
    args = ap.parse_args(argv)
    if args.table is not None:
        print(table(json.loads(args.table.read_text())))
        return 0
    import torch

    from marft_lg._durable import write_atomic
    from marft_lg._provenance import code_state, machine

    torch.set_num_threads(2)
    limit = args.recursion_limit or None
    out = {**code_state(), "benchmark": "credit_tools", "machine": machine(),
           "settings": {"online_minutes": args.online_minutes, "heldout": args.heldout, "trainer": SETTINGS,
                        "questions_per_iteration": args.per_iteration, "recursion_limit": limit,
                        "estimators": {k: ESTIMATORS[k] for k in args.estimators.split(",")},
                        "reward": REWARD,
                        "app": "examples/supervisor_tools, generated questions with checkpoints (hand-off, tool)"},
           "runs": []}
    overrides = dict(parse_set(item) for item in args.set)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    planned = {run_key(e, args.warm_start, overrides, s) for s in seeds for e in args.estimators.split(",")}
    if args.replace and not args.append:
        ap.error("--replace goes with --append (it replaces runs the file already holds)")
    if args.append and args.out.exists():
        before = json.loads(args.out.read_text())
        if {k: v for k, v in before["settings"].items() if k != "estimators"} != {
                k: v for k, v in json.loads(json.dumps(out["settings"])).items() if k != "estimators"}:
            ap.error(f"--append: {args.out} was measured with other settings")
        out["runs"], out["superseded"] = carry_over(before, planned, replace=args.replace, commit=out["commit"])
    done = {run_key(r["estimator"], r.get("warm_start", 0), r.get("overrides"), r["seed"]) for r in out["runs"]}
    args.out.parent.mkdir(parents=True, exist_ok=True)  # before an hour of runs, not after the first
    work = Path(tempfile.mkdtemp(prefix="marft-credit-tools-"))
    try:
        for seed in seeds:
            for estimator in args.estimators.split(","):
                if run_key(estimator, args.warm_start, overrides, seed) in done:
                    continue
                run = one_run(estimator, seed, args.online_minutes, args.heldout, work, per_iteration=args.per_iteration,
                              recursion_limit=limit, warm_start=args.warm_start, overrides=overrides)
                out["runs"].append({**run, "commit": out["commit"]})
                print(json.dumps({k: run[k] for k in ("estimator", "warm_start", "seed", "minutes", "iterations", "gain",
                                                      "ci_low", "ci_high", "replays")}), flush=True)
                write_atomic(args.out, json.dumps(out, indent=2) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
