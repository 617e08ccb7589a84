"""`marft-lg feedback`: record a file of users' feedback (thumbs, approvals, CSAT) beside the app's traces."""

from __future__ import annotations

from pathlib import Path

import typer


def feedback(
    file: Path = typer.Argument(..., help="JSONL: one object per line, {\"thread_id\" | \"episode_id\" | "
                                "\"trace_id\", \"turn\"?, \"name\", \"value\", \"comment\"?, \"metadata\"?}."),
    trace_dir: Path = typer.Option(Path("traces"), help="The folder mined with the app's traces."),
) -> None:
    """Record every line of FILE as feedback about an episode (by episode, LangGraph thread or trace id); mining
    joins each to its episode. A bad line is named (file:line) and nothing is recorded."""
    from marft_lg.tracing.feedback import record_feedback_file

    try:
        n = record_feedback_file(file, trace_dir)
    except (OSError, ValueError) as e:
        typer.echo(f"marft-lg feedback: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"recorded {n} feedback item(s) in {trace_dir}")
