"""Does the blame report name the agent that was made worse on purpose? One agent's LoRA adapter is broken (Gaussian
noise, std `--noise`, on its weights) and `evaluation.attribution.attribute` replays every step from the base model
(`reference: base`, `--replays` per action, upstream held); the agent whose replacement raises the return most over all
episodes is the one named (`blamed`), and `named` when that shift's CI is above 0. Also a control with nothing broken,
where no agent's shift should have a CI above 0. `significant_on_failed_only` shows why the verdict does not read
failed episodes alone: there every agent's replay tends to do better (a failure is partly bad luck).

    python benchmarks/blame.py [--seeds 0,1,2] [--quick]

Teams, on the real SmolLM2-135M (float32, CPU):
- relay (`marft_lg.examples.relay`): messenger -> recorder passing a secret word; reward 1 when the recorder wrote it.
- math (`marft_lg.examples.math_team`): reasoner -> actor, the demo's reward. The untuned actor is almost never right,
  so replacing a broken actor by the base one rarely repairs an episode: the case shows the method's limit.

Writes benchmarks/results/blame.json: `commit`, settings, `cases: [{team, sabotaged, seed, blamed, named, significant,
agents, episodes, failed_episodes, replays, used, seconds}]` and a summary per team. `named`: the blamed agent is the
sabotaged one with its CI above 0 (for the control: no agent's shift has a CI above 0).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "blame.json"


def _team_parts(name: str) -> tuple[list[str], object, list, object, dict]:
    """(roles, graph builder, scenarios, reward, chat-model kwargs) of a team."""
    if name == "relay":
        from marft_lg.examples.relay import ROLES, build_graph, relay_reward, relay_scenarios

        return ROLES, build_graph, relay_scenarios(), relay_reward(), {"max_tokens": 16, "temperature": 0.7}
    from marft_lg.examples.math_team.graph import ROLES, build_graph
    from marft_lg.examples.math_team.problems import make_problems
    from marft_lg.examples.math_team.reward import math_reward
    from marft_lg.examples.math_team.settings import REPLY_TOKENS, ROLLOUT_TEMPERATURE

    def graph(llm):
        return build_graph(llm, **REPLY_TOKENS)

    problems = [s for s in make_problems(12, 0, seed=11)]
    return ROLES, graph, problems, math_reward(), {"max_tokens": 32, "temperature": ROLLOUT_TEMPERATURE}


def one_case(model_dir: str, team_name: str, sabotaged: str | None, seed: int, *, replays: int, noise: float,
             work: Path) -> dict:
    import torch

    from marft_lg.evaluation.attribution import attribute
    from marft_lg.graph.chat_model import TeamChatModel
    from marft_lg.graph.collect import GraphCollector, plan_episodes
    from marft_lg.graph.replays import ReplayBudget
    from marft_lg.graph.wrap import wrap
    from marft_lg.serving.team import Team
    from marft_lg.training.policy import adapter_parameters

    roles, graph, scenarios, reward, chat = _team_parts(team_name)
    t0 = time.perf_counter()
    root = work / f"{team_name}-{sabotaged}-s{seed}"
    team = Team(model_dir, roles, registry=root / "registry", versions=None, seed=seed)
    app = wrap(graph(TeamChatModel(team=team, **chat)), team=team, trace_dir=root / "traces")
    try:
        if sabotaged:
            gen = torch.Generator().manual_seed(seed)
            with team.exclusive(), torch.no_grad():
                for p in adapter_parameters(team.model, team.adapter_name(sabotaged)):
                    p.add_(torch.randn(p.shape, generator=gen) * noise)
        collector = GraphCollector(app, concurrency=16)
        ds = collector.run(plan_episodes("blame", scenarios, 1, 0, seed))
        result = attribute(collector, ds, {s.scenario_id: s for s in scenarios}, reward,
                           budget=ReplayBudget(per_action=replays, reference="base"), seed=seed)
    finally:
        app.close()
        team.close()
    by = {a.agent: a for a in result.agents}
    significant = sorted(a.agent for a in result.agents if a.shift.defined and a.shift.low > 0)
    on_failed = sorted(a.agent for a in result.agents if a.shift_failed.defined and a.shift_failed.low > 0)
    named = result.blamed == sabotaged and result.significant if sabotaged else not significant
    return {"team": team_name, "sabotaged": sabotaged, "seed": seed, "blamed": result.blamed, "named": named,
            "significant": significant, "significant_on_failed_only": on_failed,
            "agents": [by[r].to_dict() for r in roles if r in by],
            "episodes": result.episodes, "failed_episodes": result.failed_episodes, "replays": result.replays,
            "used": result.used, "diverged": result.diverged, "seconds": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2", help="relay seeds (the math team runs the first only)")
    ap.add_argument("--replays", type=int, default=2, help="replays per action")
    ap.add_argument("--noise", type=float, default=0.5, help="std of the noise added to the broken adapter")
    ap.add_argument("--quick", action="store_true", help="relay, seed 0, sabotaged messenger only (smoke)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    import torch

    from marft_lg._durable import write_atomic
    from marft_lg._provenance import code_state, machine
    from marft_lg.serving.engine.models import resolve_model

    torch.set_num_threads(2)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    plan = [("relay", s, seed) for seed in seeds for s in (None, "messenger", "recorder")]
    plan += [("math", s, seeds[0]) for s in (None, "reasoner", "actor")]
    if args.quick:
        plan = [("relay", "messenger", seeds[0])]
    model_dir = str(resolve_model("embedded:smollm2-135m-instruct"))
    out = {**code_state(), "benchmark": "blame", "machine": machine(),
           "settings": {"replays_per_action": args.replays, "reference": "base", "noise_std": args.noise,
                        "scenarios": {"relay": 12, "math": 12}}, "cases": []}
    with tempfile.TemporaryDirectory(prefix="marft-blame-") as work:
        for team_name, sabotaged, seed in plan:
            case = one_case(model_dir, team_name, sabotaged, seed, replays=args.replays, noise=args.noise,
                            work=Path(work))
            out["cases"].append(case)
            print(json.dumps({k: case[k] for k in ("team", "sabotaged", "seed", "blamed", "named", "significant",
                                                    "failed_episodes", "seconds")}), flush=True)
            out["summary"] = {t: {"cases": sum(c["team"] == t for c in out["cases"]),
                                  "named": sum(c["team"] == t and c["named"] for c in out["cases"])}
                              for t in sorted({c["team"] for c in out["cases"]})}
            write_atomic(args.out, json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
