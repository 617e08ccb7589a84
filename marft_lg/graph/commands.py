"""`marft-lg run --app FILE.py:NAME --scenarios F`: run an app on scenarios, traced (registered in marft_lg/cli.py).

This is how a project gets its first traces from the CLI: the app as the user wrote it (a compiled
graph, a wrapped app, or a zero-argument factory), each scenario's `inputs` run `--samples` times,
every run one episode in `--trace-dir`. Heavy imports stay inside the command.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import typer


def _graph_of(obj: Any, spec: str) -> Any:
    """The compiled graph (or wrapped app) an --app object stands for; a factory is called with no argument."""
    from langchain_core.runnables import Runnable

    if isinstance(obj, Runnable):
        return obj
    if callable(obj):
        try:
            built = obj()
        except TypeError as exc:
            raise typer.BadParameter(f"{spec} is a factory that needs arguments ({exc}); name the compiled graph "
                                     "instead, or a factory callable with no argument", param_hint="--app") from None
        if isinstance(built, Runnable):
            return built
        obj = built
    raise typer.BadParameter(f"{spec} is a {type(obj).__name__}, not a compiled LangGraph graph or a factory of one",
                             param_hint="--app")


def run(
    app: str = typer.Option(..., "--app", help="The LangGraph app: FILE.py:NAME or module:NAME (a compiled graph, a wrapped app, or a zero-argument factory)."),
    scenarios: Path = typer.Option(..., "--scenarios", exists=True, dir_okay=False, help="Scenario JSONL (see docs/compare.md#scenario-files)."),
    trace_dir: Path = typer.Option(Path("traces"), "--trace-dir", help="Where the app's OTLP/JSON-lines traces go. An app on ChatOpenAI / openai against `marft-lg serve` has a second record, what the server sampled, in the server's own --trace-dir: mine both folders together (marft-lg mine APP_DIR SERVER_DIR)."),
    split: str | None = typer.Option(None, "--split", help="Only scenarios of this split (e.g. train)."),
    samples: int = typer.Option(1, "--samples", min=1, help="Runs per scenario."),
    node_roles: str | None = typer.Option(None, "--node-roles", help="node=role,... for app nodes whose name is not their agent role."),
    concurrency: int = typer.Option(4, "--concurrency", min=1, help="Runs at once."),
    seed: int = typer.Option(0, "--seed", help="Seed of the runs (passed to each episode)."),
    recursion_limit: int | None = typer.Option(None, "--recursion-limit", min=1, help="LangGraph step limit of each run (default: LangGraph's own); a run stopped there is kept as truncated."),
    resume_value: str | None = typer.Option(None, "--resume-value", help="Answer every interrupt() of the app with this value (JSON, else the text), resuming the run on its thread: one episode per conversation."),
    resume_with: str | None = typer.Option(None, "--resume-with", help="Answer each interrupt() with FILE.py:FUNC / module:FUNC called on the interrupt's payload (a simulated user)."),
) -> None:
    """Run the app on every scenario (traced, one episode per run) to record traces to mine and train from."""
    from rich.console import Console
    from rich.progress import Progress

    from marft_lg.graph.collect import EpisodeJob, GraphCollector
    from marft_lg.graph.interrupts import policy_from_flags
    from marft_lg.graph.routing import derive_seed
    from marft_lg.graph.wrap import WrappedGraph, wrap
    from marft_lg.loading import LoadError, load_object, parse_node_roles
    from marft_lg.trajectories.scenarios import ScenarioSet

    console = Console()
    try:
        obj = load_object(app, what="--app")
        roles = parse_node_roles(node_roles, key="--node-roles")
        scenario_set = ScenarioSet.load(scenarios)
        resume = policy_from_flags(resume_value, resume_with)
        resume = resume.loaded(what="--resume-with") if resume is not None else None
    except (LoadError, ValueError, TypeError) as exc:
        raise typer.BadParameter(str(exc)) from None
    chosen = list(scenario_set.split(split) if split else scenario_set)
    if not chosen:
        raise typer.BadParameter(f"{scenarios}: no scenarios" + (f" in split {split!r}" if split else ""))
    graph = _graph_of(obj, app)
    wrapped = graph if isinstance(graph, WrappedGraph) else wrap(graph, trace_dir=trace_dir, node_roles=roles)
    if recursion_limit is not None:
        wrapped.recursion_limit = recursion_limit
    if resume is not None:
        wrapped.resume = resume
    run_id = uuid.uuid4().hex[:8]
    jobs = [EpisodeJob(s, f"run-{run_id}-{s.scenario_id}-{j}", derive_seed(seed, s.scenario_id, j))
            for s in chosen for j in range(samples)]
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("running scenarios", total=len(jobs))
        collector = GraphCollector(wrapped, concurrency=concurrency, progress=lambda: bar.advance(task))
        collector.execute(jobs)  # a failed or truncated run is traced as far as it went; the others go on
    failures, truncated = collector.failures, collector.truncated
    wrapped.flush()
    for failure in failures[:5]:
        console.print(f"[yellow]failed[/] {failure}")
    cut = f", {len(truncated)} stopped at the recursion limit" if truncated else ""
    if collector.resumes:
        cut += f", {collector.resumes} interrupt(s) answered by the resume policy"
    if collector.paused:
        cut += (f", {len(collector.paused)} paused at an interrupt" +
                ("" if wrapped.resume is not None else ": give --resume-value or --resume-with to resume them"))
    console.print(f"ran {len(jobs)} episodes ({len(failures)} failed{cut}) of {len(chosen)} scenarios; traces in "
                  f"{wrapped.trace_dir or trace_dir}")

    if failures and len(failures) == len(jobs):
        raise typer.Exit(1)

