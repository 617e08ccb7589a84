"""`marft-lg attribute`: the blame report of a LangGraph app's agents (`evaluation.attribution`), from the command
line. Useful without training: it answers which agent to fix first."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import typer

from marft_lg.evaluation.commands import (
    _load_reward,
    _replay_spec,
    _resume_option,
    _scenario_set,
    _versions,
    baseline_versions,
)


def attribute(
    app: str = typer.Option(..., help="The LangGraph app: FILE.py:NAME or module:NAME (as `compare --app`)."),
    scenarios: Path = typer.Option(..., help="Scenario file (JSONL or parquet): the episodes' inputs, or a trace "
                                   "directory to sample real inputs from (see --input-keys)."),
    reward: Path = typer.Option(..., help="Reward YAML (CompositeReward) scoring the episodes and their replays."),
    from_traces: Path | None = typer.Option(None, "--from-traces", help="Attribute the episodes mined from this trace "
                                            "dir (their scenario ids must be in --scenarios) instead of fresh runs."),
    input_keys: str = typer.Option("question", help="With a trace directory as --scenarios: the graph input keys."),
    registry: Path | None = typer.Option(None, help="Adapter registry directory (resolves aliases, loads versions)."),
    model: str = typer.Option("embedded:smollm2-135m-instruct", help="Base model spec for the team."),
    agents: str | None = typer.Option(None, help="Comma-separated agent roles (default: the registry's roles)."),
    node_roles: str | None = typer.Option(None, "--node-roles", help="node=role,... for nodes not named as roles."),
    recursion_limit: int | None = typer.Option(None, "--recursion-limit", min=1, help="LangGraph step limit of each "
                                               "episode and replay (default: LangGraph's own)."),
    resume_value: str | None = typer.Option(None, "--resume-value", help="Answer every interrupt() of the app with "
                                            "this value (JSON, else the text)."),
    resume_with: str | None = typer.Option(None, "--resume-with", help="Answer each interrupt() with FILE.py:FUNC / "
                                           "module:FUNC called on its payload."),
    versions: str = typer.Option("live", help="Alias or role=ref,... the team runs (and replays by default)."),
    episodes: int = typer.Option(1, "--episodes", min=1, help="Fresh episodes per scenario."),
    replays: int = typer.Option(4, min=1, help="Replays of each action's step."),
    reference: str = typer.Option("self", help="What a replayed step is drawn from: self (the agent's own adapter), "
                                  "base (no adapter), a version (v3, live) or the URL of an OpenAI-compatible server "
                                  "answering model=<role>."),
    replay_agents: str | None = typer.Option(None, "--replay-agents", help="Roles to replay (default: all)."),
    tools: str = typer.Option("refuse", help="refuse: skip steps whose upstream called tools (a replay would run them "
                              "again); rerun: replay them, running the tools again (no side effects only)."),
    success_at: float = typer.Option(1.0, "--success-at", help="An episode whose return is below this failed."),
    temperature: float = typer.Option(1.0, help="Sampling temperature of an f(llm) app's calls."),
    max_tokens: int = typer.Option(256, help="Most tokens per LLM call of an f(llm) app."),
    seed: int = typer.Option(0, help="Seed of the episodes, the replays and the bootstrap."),
    out: Path | None = typer.Option(None, help="Folder for the report (default runs/attribute-<time>)."),
) -> None:
    """Which agent is to blame: replay each agent's step with the upstream held, from a reference policy, and
    report how much the team's return moves (table, attribution.md/.html/.png/.json)."""
    from rich.console import Console

    from marft_lg.evaluation.attribution import attribute as run_attribution
    from marft_lg.evaluation.attribution import print_blame, write_blame
    from marft_lg.graph.collect import GraphCollector, plan_episodes
    from marft_lg.graph.replays import ReplayBudget

    console = Console()
    if tools not in ("refuse", "rerun"):
        raise typer.BadParameter(f"{tools!r}: use refuse or rerun", param_hint="--tools")
    out = out or Path("runs") / f"attribute-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    scorer = _load_reward(reward)
    scenario_set = _scenario_set(scenarios, input_keys, None, seed, out, console)
    spec, reg = _replay_spec(app, model, agents, registry, node_roles, max_tokens, temperature, recursion_limit,
                             _resume_option(resume_value, resume_with))
    pins = _pins(versions, reg, spec.agents, console)
    with console.status(f"loading {model} for {', '.join(spec.agents)}"):
        team = spec.build_team(registry=reg)
    wrapped = None
    try:
        for role, ref in pins.items():
            team.load_version(role, ref)
        wrapped = spec.build_app(team, out / "traces")
        ref_name = _reference(reference, wrapped)
        collector = GraphCollector(wrapped, run_id="blame")
        by_id = {s.scenario_id: s for s in scenario_set}
        if from_traces is not None:
            dataset = _mined(from_traces, by_id)
        else:
            with console.status(f"running {len(by_id) * episodes} episodes"):
                dataset = collector.run(plan_episodes("blame", list(by_id.values()), episodes, 0, seed))
        picked = [r.strip() for r in replay_agents.split(",")] if replay_agents else None
        budget = ReplayBudget(per_action=replays, agents=picked, tools=tools, reference=ref_name)
        with console.status(f"replaying each step of {len(dataset)} episodes {replays}x"):
            result = run_attribution(collector, dataset, by_id, scorer, budget=budget, seed=seed,
                                     success_at=success_at)
    finally:
        if wrapped is not None:
            wrapped.close()
        team.close()
    print_blame(result, console)
    files = write_blame(result, out)
    console.print(f"report: {files['markdown']} ({files['plot'].name}, {files['json'].name})")


def _pins(versions: str, reg: Any, roles: list[str], console: Any) -> dict[str, str]:
    """``{role: ref}`` the team serves (an alias resolved through the registry; `live` unset: the initial adapters)."""
    spec, note = baseline_versions(_versions(versions), reg, roles) if reg is not None else (_versions(versions), None)
    if note:
        console.print(f"[yellow]{note}[/]")
    if isinstance(spec, str):
        if reg is None:
            return {}  # no registry: the team's own adapters
        return dict(reg.alias(spec))
    return dict(spec)


def _reference(reference: str, wrapped: Any) -> str | None:
    """`ReplayPlan.reference` of --reference (a URL becomes the app's reference engine)."""
    if reference == "self":
        return None
    if reference.startswith(("http://", "https://")):
        from marft_lg.graph.remote import RemoteEngine

        wrapped.replay_reference = RemoteEngine(reference)
        return "engine"
    return reference


def _mined(trace_dir: Path, scenarios: dict[str, Any]) -> Any:
    from marft_lg.trajectories.mining import mine

    try:
        dataset = mine([trace_dir])
    except (FileNotFoundError, ValueError) as exc:
        raise typer.BadParameter(str(exc), param_hint="--from-traces") from None
    known = dataset.episodes["scenario_id"].isin(set(scenarios))
    if not known.any():
        raise typer.BadParameter(f"no episode under {trace_dir} has a scenario id of --scenarios (their inputs are "
                                 "needed to replay them)", param_hint="--from-traces")
    return dataset.select(list(dataset.episodes.loc[known, "episode_id"]))
