"""Train the math team with MARFT on the embedded 135M model and measure held-out team reward.

    python -m marft_lg.examples.math_team.learn --minutes 20

Steps: untuned team on held-out problems (greedy) -> on-policy MARFT on the train split until the
time budget is spent -> tuned team on the same held-out problems -> paired bootstrap 95% CI of
the per-problem reward difference, and strict / lenient answer accuracy before and after. Writes
`benchmarks/results/math_team_learning.json` and a PNG next to it (train curve; held-out
before/after per component with the CI).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

from marft_lg._durable import write_atomic
from marft_lg.examples.math_team.accuracy import answer_accuracy
from marft_lg.examples.math_team.graph import ROLES, build_graph
from marft_lg.examples.math_team.problems import make_problems
from marft_lg.examples.math_team.reward import math_reward
from marft_lg.examples.math_team.settings import MARFT_SETTINGS, REPLY_TOKENS


def evaluate(app, scenarios, reward, *, tag: str, seed: int) -> tuple[list[float], dict[str, float], dict]:
    """Per-scenario reward of one greedy episode each, component means, and answer accuracy
    (`answer_accuracy`: strict and lenient, over the episodes that came back)."""
    from marft_lg.training.rollout import GraphCollector

    collector = GraphCollector(app, concurrency=len(scenarios), run_id=tag)
    ds = collector.collect(list(scenarios), 1, 0, seed)
    result = reward.score(ds, scenarios)
    table = result.episodes.merge(ds.episodes[["episode_id", "scenario_id"]], on="episode_id")
    by_sid = dict(zip(table["scenario_id"], table["reward"].astype(float), strict=True))
    scores = [by_sid.get(s.scenario_id, 0.0) for s in scenarios]  # an episode that failed scores 0
    comps = {c: float(table[c].astype(float).mean()) for c in ("task_completion", "format_compliance", "goal_progress") if c in table}
    return scores, comps, answer_accuracy(ds, scenarios)


def plot(result: dict, path: Path) -> None:
    """Two panels: the train reward per iteration, and held-out reward before vs after per component
    with the paired 95% CI of the team reward difference in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    curve = result["train_curve"]
    left.plot(range(1, len(curve) + 1), curve, marker="o")
    left.set(title=f"on-policy team reward ({result['args']['scenarios_per_iteration']} problems x "
                   f"K={result['args']['k']} per iteration)", xlabel="iteration", ylabel="train reward (sampled)")
    keys = ["reward_mean", "task_completion", "format_compliance", "goal_progress"]
    x = np.arange(len(keys))
    right.bar(x - 0.2, [result["before"][k] for k in keys], 0.4, label="untuned")
    right.bar(x + 0.2, [result["after"][k] for k in keys], 0.4, label=f"after {result['iterations']} iterations")
    right.set_xticks(x, ["team reward", "task", "format", "set-up"])
    ci = result["paired_difference_ci95"]
    right.set_title(f"held-out ({result['heldout_problems']} problems, greedy): "
                    f"diff {ci['mean']:+.3f} [{ci['low']:+.3f}, {ci['high']:+.3f}]", fontsize=10)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=20.0, help="training time budget (evaluation not included)")
    ap.add_argument("--run-dir", default="runs/math_team_learn")
    ap.add_argument("--out", default="benchmarks/results/math_team_learning.json")
    ap.add_argument("--train", type=int, default=64, help="train problems (cycled through)")
    ap.add_argument("--heldout", type=int, default=256)
    ap.add_argument("--k", type=int, default=4, help="episodes per train problem per iteration (group size)")
    ap.add_argument("--scenarios-per-iteration", type=int, default=4)
    ap.add_argument("--lr", type=float, default=MARFT_SETTINGS["learning_rate"])
    ap.add_argument("--ppo-epochs", type=int, default=MARFT_SETTINGS["ppo_epochs"])
    ap.add_argument("--minibatches", type=int, default=MARFT_SETTINGS["num_minibatches"])
    ap.add_argument("--temperature", type=float, default=MARFT_SETTINGS["temperature"], help="rollout sampling temperature")
    ap.add_argument("--reasoner-tokens", type=int, default=REPLY_TOKENS["reasoner_tokens"])
    ap.add_argument("--actor-tokens", type=int, default=REPLY_TOKENS["actor_tokens"])
    ap.add_argument("--model", default="embedded:smollm2-135m-instruct")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import torch

    from marft_lg.evaluation.stats import bootstrap_ci, paired_differences
    from marft_lg.graph.chat_model import TeamChatModel
    from marft_lg.graph.wrap import wrap
    from marft_lg.serving.team import Team
    from marft_lg.training.config import MARFTConfig
    from marft_lg.training.trainer import MARFTTrainer

    torch.set_num_threads(os.cpu_count() or 2)
    run = Path(args.run_dir)
    shutil.rmtree(run, ignore_errors=True)
    problems = make_problems(args.train, args.heldout, args.seed)
    train, heldout = problems.split("train"), problems.split("heldout")
    reward = math_reward()
    team = Team(args.model, ROLES, registry=run / "registry", versions=None, seed=args.seed)
    caps = {"reasoner_tokens": args.reasoner_tokens, "actor_tokens": args.actor_tokens}
    max_tokens = max(caps.values())
    sample_app = wrap(build_graph(TeamChatModel(team=team, max_tokens=max_tokens, temperature=args.temperature), **caps),
                      team=team, trace_dir=run / "traces")
    greedy_app = wrap(build_graph(TeamChatModel(team=team, max_tokens=max_tokens, temperature=0.0), **caps),
                      team=team, trace_dir=run / "eval_traces")
    t0 = time.perf_counter()
    before, before_comps, before_acc = evaluate(greedy_app, heldout, reward, tag="before", seed=args.seed + 7)
    eval_s = time.perf_counter() - t0
    print(f"untuned held-out reward {np.mean(before):.3f} {before_comps} accuracy {before_acc} ({eval_s:.0f}s)")

    settings = {**MARFT_SETTINGS, "learning_rate": args.lr, "ppo_epochs": args.ppo_epochs,
                "num_minibatches": args.minibatches, "temperature": args.temperature}
    cfg = MARFTConfig(**settings, group_size=args.k, max_new_tokens=max_tokens, max_context=1024, seed=args.seed,
                      checkpoint_every=5, rollout_concurrency=args.k * args.scenarios_per_iteration)
    trainer = MARFTTrainer(team, reward, cfg, run / "train")
    t_train = time.perf_counter()
    # an iteration starts only if one as long as the previous still fits the budget
    rows = trainer.fit_online(sample_app, train, 500, scenarios_per_iteration=args.scenarios_per_iteration,
                              time_budget_s=args.minutes * 60)
    it = len(rows)
    train_minutes = (time.perf_counter() - t_train) / 60
    after, after_comps, after_acc = evaluate(greedy_app, heldout, reward, tag="after", seed=args.seed + 7)
    ci = bootstrap_ci(paired_differences(before, after), confidence=0.95, seed=args.seed)
    from marft_lg._provenance import code_state

    result = {
        **code_state(), "model": args.model, "iterations": it, "train_minutes": round(train_minutes, 2), "cpu_threads": torch.get_num_threads(),
        "heldout_problems": len(heldout), "before": {"reward_mean": float(np.mean(before)), **before_comps},
        "after": {"reward_mean": float(np.mean(after)), **after_comps}, "paired_difference_ci95": ci.to_dict(),
        "ci_excludes_zero": bool(ci.defined and ci.low > 0),
        "accuracy": {"before": before_acc, "after": after_acc},  # strict: \boxed{} right; lenient: last number right
        "train_curve": [r["reward_mean"] for r in rows], "eval_seconds": round(eval_s, 1),
        "args": vars(args), "config": cfg.to_dict(),
        "versions": team.versions(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print(json.dumps({k: result[k] for k in ("iterations", "before", "after", "paired_difference_ci95", "accuracy")},
                     indent=2))
    team.close()
    return result


if __name__ == "__main__":
    main()
