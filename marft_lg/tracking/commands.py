"""`marft-lg export` (registered in marft_lg/cli.py), and `--report-to` as every command reads it. Heavy imports
stay inside the command."""

from __future__ import annotations

from pathlib import Path

import typer


def export(
    target: str = typer.Argument(..., help="ROLE, ROLE@VERSION (e.g. actor@v3) or ROLE@ALIAS (default: ROLE@live)."),
    registry: Path = typer.Option(..., help="Adapter registry directory."),
    out: Path = typer.Option(..., help="Folder to write (must not exist or be empty)."),
    merged: bool = typer.Option(False, "--merged", help="Merge the adapter into its base model: a full transformers "
                                "model (safetensors + tokenizer) for serving stacks without LoRA."),
    base: str | None = typer.Option(None, help="With --merged: the base model (transformers folder or embedded:NAME; "
                                    "default: the embedded model the version names)."),
) -> None:
    """Export a role's adapter version as a plain PEFT adapter folder (PEFT and vLLM --lora-modules load it as it
    is) or, with --merged, a merged full model; both with a README.md model card. A damaged version is refused."""
    from marft_lg.tracking.export import ExportError, export_version

    root, dest = registry.resolve(), out.resolve()
    if dest == root or dest.is_relative_to(root) or root.is_relative_to(dest):
        typer.echo(f"error: --out {out} is inside the registry {registry} (or holds it): export to a folder outside "
                   "it, so that the registry holds only its own versions", err=True)
        raise typer.Exit(1)
    try:
        path = export_version(registry, target, out, merged=merged, base=base)
    except ExportError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"exported {target} to {path}" + (" (merged into its base model)" if merged else ""))


def report_to_option(text: str | None) -> list[str]:
    """A command's `--report-to` (comma-separated trackers), checked before any work: an unknown name or a missing
    package is a usage error naming the option (one line)."""
    from marft_lg._config import ConfigError
    from marft_lg.tracking.settings import TrackingUnavailable, parse_report_to, require_all

    try:
        names = parse_report_to(text) if text else []
        require_all(names)
    except (ConfigError, TrackingUnavailable) as exc:
        raise typer.BadParameter(str(exc), param_hint="--report-to") from None
    return names
