"""Run the support team on its scenarios through marft_lg (traced), then mine what it wrote.

    python -m examples.support_team --fake               # scripted model, seconds
    python -m examples.support_team --limit 2            # the embedded SmolLM2-135M, one LoRA per agent
"""

from __future__ import annotations

import argparse
from pathlib import Path

AGENTS = ["planner", "researcher", "writer", "critic"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.support_team", description=__doc__.splitlines()[0])
    parser.add_argument("--fake", action="store_true", help="use the scripted FakeSupportModel instead of a real model")
    parser.add_argument("--model", default="embedded:smollm2-135m-instruct", help="base model for the Team")
    parser.add_argument("--split", default="train", choices=["train", "heldout", "all"])
    parser.add_argument("--limit", type=int, default=None, help="run at most this many scenarios")
    parser.add_argument("--trace-dir", type=Path, default=Path("traces") / "support_team")
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args(argv)

    from rich.console import Console
    from rich.progress import track

    from examples.support_team.app import SCENARIOS, build_graph
    from marft_lg.graph.wrap import wrap
    from marft_lg.trajectories.mining import mine_with_report
    from marft_lg.trajectories.scenarios import ScenarioSet

    console = Console()
    scenarios = ScenarioSet.load(SCENARIOS)
    if args.split != "all":
        scenarios = scenarios.split(args.split)
    chosen = list(scenarios)[: args.limit]
    team = None
    if args.fake:
        from examples.support_team.fake import FakeSupportModel

        llm = FakeSupportModel()
    else:
        from marft_lg.graph.chat_model import TeamChatModel
        from marft_lg.serving.team import Team

        team = Team(args.model, AGENTS, versions=None)
        llm = TeamChatModel(team=team, max_tokens=args.max_tokens, temperature=0.7, seed=0)
    app = wrap(build_graph(llm), team=team, trace_dir=args.trace_dir)
    correct = 0
    try:
        for s in track(chosen, description="support team", console=console):
            out = app.invoke(s.inputs, {"max_concurrency": 1, "recursion_limit": 25},
                             episode_id=f"st-{s.scenario_id}", scenario_id=s.scenario_id, seed=0)
            answer = str(out.get("answer", ""))
            ok = str(s.reference).lower() in answer.lower()
            correct += ok
            console.print(f"[{'green' if ok else 'red'}]{s.scenario_id}[/]: {answer[:160]!r}")
        app.flush()
    finally:
        app.close()
        if team is not None:
            team.close()
    dataset, report = mine_with_report(args.trace_dir)
    console.print(f"{correct}/{len(chosen)} answers contain the reference; traces in {args.trace_dir}: "
                  f"{report.episodes} episodes, {report.actions} actions {report.actions_per_agent}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
