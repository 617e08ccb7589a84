"""CLI commands for marft_lg.rewards (registered in marft_lg/cli.py). Keep top-level imports light."""

from __future__ import annotations

from pathlib import Path

import typer


def score(
    dataset_dir: Path = typer.Argument(..., help="Directory written by `marft-lg mine --out` (episodes/actions parquet)."),
    reward: Path = typer.Option(..., "--reward", "-r", help="Reward config YAML (weights, components, credit)."),
    scenarios: Path | None = typer.Option(None, "--scenarios", "-s", help="Scenario set (JSONL or parquet)."),
    out: Path = typer.Option(..., "--out", "-o", help="Where to write per-episode rewards: .parquet, .jsonl or .csv."),
) -> None:
    """Score a trajectory dataset with a composite reward; print a per-component summary."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from marft_lg.rewards.composite import CompositeReward
    from marft_lg.trajectories.dataset import TrajectoryDataset
    from marft_lg.trajectories.scenarios import ScenarioSet

    console = Console(stderr=True)
    try:
        composite = CompositeReward.from_yaml(reward)
        dataset = TrajectoryDataset.from_parquet(dataset_dir)
        scenario_set = ScenarioSet.load(scenarios) if scenarios is not None else None
    except (OSError, ValueError) as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(2) from exc
    result = composite.score(dataset, scenario_set, progress=True)
    try:
        result.save(out)
    except (OSError, ValueError) as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(2) from exc
    s = result.summary()
    table = Table(title=f"reward components ({composite.credit} credit)")
    for col in ("component", "weight", "mean", "errors"):
        table.add_column(col, justify="left" if col == "component" else "right")
    for name, c in s["components"].items():
        table.add_row(escape(name), f"{c['weight']:g}", "-" if c["mean"] is None else f"{c['mean']:.4f}", str(c["errors"]))
    mean = s["reward"]["mean"]
    table.add_row("[bold]reward[/bold]", "", "-" if mean is None else f"{mean:.4f}", str(s["unscored"]))
    console.print(table)
    unfinished = f" ({s['unfinished']} of them not finished: failed or paused)" if s["unfinished"] else ""
    console.print(f"{s['episodes']} episodes: {s['scored']} scored, {s['unscored']} unscored{unfinished}, "
                  f"{s['vetoed']} vetoed; written to {out}", soft_wrap=True)
    for example in s["error_examples"]:
        console.print(f"[yellow]unscored:[/yellow] {escape(example)}", soft_wrap=True)
    if s["episodes"] and not s["scored"]:
        raise typer.Exit(1)
