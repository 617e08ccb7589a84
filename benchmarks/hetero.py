"""A team on two base models against two one-base teams: peak RSS and update time.

    python benchmarks/hetero.py [--quick] [--out benchmarks/results/hetero.json]

Base A is the embedded SmolLM2-135M; base B is a random Llama (hidden 256, 4 layers) with a tokenizer of
its own (`build_tiny_tokenizer`), so the two bases differ in size and tokenizer. The team: a frozen planner
(an external API: in the episodes, never trained), `solver` on A and `checker` on B. Each case runs in a
fresh process so its peak RSS is its own:

- `mixed`: `team({"solver": A, "checker": B})`, one offline MARFT iteration updating both roles;
- `single_a` / `single_b`: a one-base team of the one role on A / B, the same episodes, the same iteration.

The update time is the iteration's own (`time_s`: build the batch — re-tokenise, behaviour log-probs,
critic values, GAE — then the PPO steps and checks), the best of `--repeats` iterations after one warm-up.
Peak RSS is the process's maximum; `rss_before_mb` what it held before the first iteration (models
loaded). Results: benchmarks/results/hetero.json with the commit they were measured at.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from training import _peak_rss_mb, run_case  # noqa: E402 - benchmarks/ is the script's folder

ROLES = {"mixed": ["solver", "checker"], "single_a": ["solver"], "single_b": ["checker"]}


def _base_b(root: Path) -> Path:
    from marft_lg.serving.engine.models import build_tiny_model, build_tiny_tokenizer

    tok = build_tiny_tokenizer(root / "tokenizer-b")
    return build_tiny_model(root / "base-b", hidden_size=256, num_layers=4, num_heads=4, seed=1, tokenizer_dir=tok)


def _dataset(n_episodes: int):
    """Episodes of planner -> solver -> checker with chat messages and completions (no token ids: each base
    re-tokenises its own actions)."""
    import pandas as pd

    from marft_lg.trajectories.dataset import TrajectoryDataset

    episodes, actions = [], []
    for e in range(n_episodes):
        q = f"A shop sells {e + 3} boxes of {e + 7} pens each. How many pens are there in all?"
        plan = "Multiply the boxes by the pens in each box, then check the product."
        answer = f"There are {e + 3} x {e + 7} = {(e + 3) * (e + 7)} pens, so the answer is \\boxed{{{(e + 3) * (e + 7)}}}."
        check = f"The product {(e + 3) * (e + 7)} is right: the answer stands."
        eid = f"e{e}"
        now = pd.Timestamp("2026-11-25", tz="UTC") + pd.Timedelta(seconds=e)
        episodes.append({"episode_id": eid, "scenario_id": f"s{e // 2}", "start_time": now, "end_time": now,
                         "n_actions": 3, "agents": ["planner", "solver", "checker"], "status": "ok", "outcome": None,
                         "feedback": {}, "metadata": {}})
        turns = [("planner", [{"role": "user", "content": f"Plan: {q}"}], plan),
                 ("solver", [{"role": "system", "content": "You solve problems step by step."},
                             {"role": "user", "content": f"{q}\nPlan: {plan}"}], answer),
                 ("checker", [{"role": "system", "content": "You check answers."},
                              {"role": "user", "content": f"{q}\nAnswer: {answer}"}], check)]
        for order, (agent, messages, completion) in enumerate(turns):
            actions.append({"episode_id": eid, "order": order, "step": order, "agent": agent, "span_id": f"{eid}-{order}",
                            "messages": messages, "completion": completion, "prompt_token_ids": None,
                            "completion_token_ids": None, "completion_logprobs": None,
                            "depends_on": list(range(order)), "tool_calls": [], "tool_errors": 0, "input_tokens": None,
                            "output_tokens": None, "latency_s": None, "model": agent, "adapter_version": None})
    return TrajectoryDataset(episodes=pd.DataFrame(episodes), actions=pd.DataFrame(actions))


def case(kind: str, n_episodes: int, repeats: int, root: str) -> dict:
    import torch

    from marft_lg.serving.engine.models import resolve_model
    from marft_lg.serving.team_factory import team as build_team
    from marft_lg.training.config import MARFTConfig
    from marft_lg.training.trainer import MARFTTrainer

    torch.set_num_threads(2)
    a, b = str(resolve_model("embedded:smollm2-135m-instruct")), str(_base_b(Path(root)))
    models = {"solver": a, "checker": b}
    team = build_team({r: models[r] for r in ROLES[kind]}, versions=None, seed=0)
    rss_before = _peak_rss_mb()
    cfg = MARFTConfig(update_scheme="simultaneous", learning_rate=1e-5, kl_cut=None, plots=False,
                      offline_episodes_per_iteration=n_episodes, checkpoint_every=10_000)
    ds = _dataset(n_episodes)
    times, tokens = [], 0
    with tempfile.TemporaryDirectory() as run:
        trainer = MARFTTrainer(team, lambda ep: float(len(ep.actions)), cfg, run, progress=False)
        for i in range(repeats + 1):
            row = trainer.fit_offline(ds, iterations=i + 1)[-1]
            if i:  # the first iteration warms up (Adam state, lazy inits)
                times.append(row["time_s"])
            tokens = row["tokens"]
    team.close()
    return {"roles": ROLES[kind], "bases": len(models) if kind == "mixed" else 1, "update_s": min(times),
            "update_s_all": times, "tokens": tokens, "peak_rss_mb": _peak_rss_mb(), "rss_before_mb": rss_before}


def _sub(kind: str, **kw) -> dict:
    return run_case(__file__, kind, **kw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer episodes and repeats (smoke)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "hetero.json"))
    ap.add_argument("--case")
    ap.add_argument("--kw")
    args = ap.parse_args()
    if args.case:
        print(json.dumps(case(args.case, **json.loads(args.kw))))
        return
    from marft_lg._provenance import code_state, machine

    kw = {"n_episodes": 4 if args.quick else 8, "repeats": 1 if args.quick else 3}
    with tempfile.TemporaryDirectory() as root:
        t0 = time.perf_counter()
        runs = {k: _sub(k, root=root, **kw) for k in ROLES}
    mixed, a, b = runs["mixed"], runs["single_a"], runs["single_b"]
    result = {**code_state(), "machine": machine(), **kw, "wall_s": time.perf_counter() - t0, **runs,
              "update_ratio_vs_sum": mixed["update_s"] / (a["update_s"] + b["update_s"]),
              "peak_rss_ratio_vs_sum": mixed["peak_rss_mb"] / (a["peak_rss_mb"] + b["peak_rss_mb"]),
              "peak_rss_ratio_vs_sum_net": ((mixed["peak_rss_mb"] - mixed["rss_before_mb"])
                                            / max(a["peak_rss_mb"] - a["rss_before_mb"]
                                                  + b["peak_rss_mb"] - b["rss_before_mb"], 1e-9))}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"update: 2-base {mixed['update_s']:.2f} s vs 1-base {a['update_s']:.2f} + {b['update_s']:.2f} s "
          f"({result['update_ratio_vs_sum']:.2f}x of the sum)")
    print(f"peak RSS: 2-base {mixed['peak_rss_mb']:.0f} MB vs {a['peak_rss_mb']:.0f} + {b['peak_rss_mb']:.0f} MB "
          f"({result['peak_rss_ratio_vs_sum']:.2f}x of the sum; update growth {result['peak_rss_ratio_vs_sum_net']:.2f}x)")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
