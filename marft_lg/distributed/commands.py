"""`marft-lg mine` (registered in marft_lg/cli.py): trajectories' mining, here or on a Ray cluster (`--ray`), which
is why it lives in the layer that may import both. Keep top-level imports light."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer


def mine(
    paths: list[str] = typer.Argument(..., help="Trace files (.jsonl, .jsonl.gz), directories or globs."),
    out: Path = typer.Option(..., "--out", "-o", help="Directory for episodes.parquet and actions.parquet."),
    since: str | None = typer.Option(None, "--since", help="Only episodes that ended after this ISO-8601 time."),
    quarantine: Path | None = typer.Option(
        None, "--quarantine", help="JSONL file receiving every unusable line/span with its reason and file:line."),
    max_attribute_mb: float = typer.Option(8.0, "--max-attribute-mb", help="Larger attribute values quarantine their span."),
    max_line_mb: float = typer.Option(
        64.0, "--max-line-mb", help="Longer trace lines are skipped unread and quarantined with their file:line."),
    workers: int | None = typer.Option(
        None, "--workers", min=1,
        help="Worker processes, or Ray actors with --ray (default: one per usable core for inputs over 64 MB, else 1;"
             " with --ray the cluster's CPUs, at most 8)."),
    ray: str | None = typer.Option(
        None, "--ray", metavar="ADDRESS",
        help="Mine on a Ray cluster: local, auto or ray://host:port. The files must be readable at the same paths on"
             " every node (a shared filesystem)."),
    server_records_only: bool = typer.Option(
        False, "--server-records-only",
        help="Also mine server records (marft-lg serve's) that joined no app span as episodes: for an app that was"
             " not wrapped, whose only record is the server's. Without it they are counted and left out."),
) -> None:
    """Mine OpenTelemetry traces (marft_lg, OpenInference, OpenLLMetry, GenAI semconv) into trajectories."""
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from marft_lg.distributed.mining import mine_to_parquet
    from marft_lg.trajectories.dataset import TrajectoryDataset

    console = Console(stderr=True, soft_wrap=True)
    problem = _bad_flags(out, quarantine, max_attribute_mb, max_line_mb)
    if problem:
        console.print(f"[red]marft-lg mine: {escape(problem)}[/red]")
        raise typer.Exit(2)
    try:
        with Progress(TextColumn("mining"), BarColumn(), TextColumn("{task.completed:,} spans"), TimeElapsedColumn(),
                      console=console, transient=True) as bar:
            task = bar.add_task("mine", total=None)
            report = mine_to_parquet(
                paths, out, since=since, quarantine=quarantine, max_attribute_bytes=int(max_attribute_mb * 2**20),
                max_line_bytes=int(max_line_mb * 2**20), progress=lambda n: bar.update(task, completed=n),
                workers=workers, ray=ray, server_records_only=server_records_only)
    except (FileNotFoundError, ValueError) as exc:
        console.print(f"[red]marft-lg mine: {escape(str(exc))}[/red]")  # "marft_lg[ray]" is not markup
        raise typer.Exit(2) from exc

    out_console = Console()
    _print_report(report, quarantine, out_console)
    if report.episodes == 0 and (report.episodes_before_since or report.files_before_since):
        out_console.print(f"no episode ended after --since {since}; writing empty tables")
        TrajectoryDataset().to_parquet(out)
    elif report.episodes == 0:
        console.print(f"[red]marft-lg mine: nothing usable in {', '.join(paths)}: no episode with an LLM call"
                      f" ({report.spans_read:,} spans read, {report.quarantined_total:,} quarantined)."
                      " Are these OTLP/JSON trace lines from an instrumented LangGraph/LangChain app?[/red]")
        raise typer.Exit(1)
    out_console.print(f"wrote {out / 'episodes.parquet'} and {out / 'actions.parquet'}")


def _bad_flags(out: Path, quarantine: Path | None, max_attribute_mb: float, max_line_mb: float) -> str | None:
    """What is wrong with the output flags, checked before any file is read (a traceback after minutes of mining
    otherwise), or None."""
    if out.exists() and not out.is_dir():
        return f"--out {out} is a file; give a directory for episodes.parquet and actions.parquet"
    if quarantine is not None and quarantine.is_dir():
        return f"--quarantine {quarantine} is a directory; give a JSONL file to write the quarantined input to"
    if not max_attribute_mb > 0:
        return f"--max-attribute-mb must be > 0, got {max_attribute_mb}"
    if not max_line_mb > 0:
        return f"--max-line-mb must be > 0, got {max_line_mb}"
    return None


def _print_report(report: Any, quarantine: Path | None, out_console: Any) -> None:
    """The mining table: what was read, kept, joined and quarantined (and why), with the warnings that go with it."""
    from rich.markup import escape
    from rich.table import Table

    from marft_lg.trajectories.quarantine import REASONS

    table = Table(title=f"mined {report.files} file(s), {report.spans_read:,} spans")
    table.add_column("what")
    table.add_column("count", justify="right")
    table.add_row("episodes", f"{report.episodes:,}")
    table.add_row("actions", f"{report.actions:,}")
    for agent, n in report.actions_per_agent.items():
        table.add_row(f"  actions by {agent}", f"{n:,}")
    table.add_row("spans kept", f"{report.spans_kept:,}")
    for fmt, n in report.formats.items():
        table.add_row(f"  format {fmt}", f"{n:,}")
    if report.served_merged:
        table.add_row("LLM calls joined to the server's record", f"{report.served_merged:,}")
    if report.replays:
        table.add_row("counterfactual replays left out (not production data)", f"{report.replays:,}")
    if report.shadows:
        table.add_row("shadow (mirrored) runs left out (not production data)", f"{report.shadows:,}")
    if report.server_records_unjoined:
        table.add_row("server records joined to no app span (left out)", f"{report.server_records_unjoined:,}",
                      style="yellow")
    if report.repaired_parents:
        table.add_row("parents repaired (orphans re-attached)", f"{report.repaired_parents:,}")
    if report.non_utf8_lines:
        table.add_row("lines with non-UTF-8 bytes (replaced by U+FFFD)", f"{report.non_utf8_lines:,}", style="yellow")
    if report.episodes_before_since:
        table.add_row("episodes before --since (skipped)", f"{report.episodes_before_since:,}")
    if report.files_before_since:
        table.add_row("files written before --since (not read)", f"{report.files_before_since:,}")
    table.add_row("spans/lines quarantined", f"{report.quarantined_total:,}")
    for reason, n in report.quarantined.items():
        table.add_row(f"  {reason}", f"{n:,}", style="yellow")
    out_console.print(table)
    for reason in report.quarantined:
        where = ", ".join(report.first_quarantined.get(reason, []))
        out_console.print(f"  [yellow]{reason}[/yellow]: {REASONS.get(reason, '')}"
                          + (f" (first at {escape(where)})" if where else ""))
    if report.quarantined_total and quarantine is None:
        out_console.print("[yellow]pass --quarantine FILE to keep the quarantined input for inspection[/yellow]")
    for note in report.notes():
        out_console.print(f"[yellow]warning: {escape(note)}[/yellow]")
    if report.actions_without_token_ids:
        counts = ", ".join(f"{agent}: {n:,}" for agent, n in report.actions_without_token_ids.items())
        out_console.print(f"[yellow]warning: actions without exact token ids ({escape(counts)}): the trainer re-renders "
                          "their prompts, which may differ from what the model saw. Mine the server's traces too "
                          "(`marft-lg serve` records what it sampled), or use TeamChatModel.[/yellow]")
