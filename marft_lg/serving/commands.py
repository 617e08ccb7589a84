"""CLI commands for marft_lg.serving (registered in marft_lg/cli.py). Keep top-level imports light."""

from __future__ import annotations

import json
from pathlib import Path

import typer


def serve(
    model: str = typer.Option("embedded:smollm2-135m-instruct", help="Model spec: embedded:NAME or a local HF dir."),
    agents: str = typer.Option(..., help="Comma-separated agent roles, e.g. planner,writer."),
    engine: str = typer.Option("hf", help="hf (embedded transformers + peft) or vllm (managed vLLM server)."),
    registry: Path | None = typer.Option(None, help="Adapter registry directory; roles serve its 'live' versions."),
    versions: str | None = typer.Option(None, help="Alias or role=ref,... to serve (default: live with a registry)."),
    shared_adapter: bool = typer.Option(False, help="All roles share one adapter (parameter sharing)."),
    host: str = typer.Option("127.0.0.1", help="Bind address (loopback by default)."),
    port: int = typer.Option(8000, help="TCP port."),
    api_key: str | None = typer.Option(None, envvar="MARFT_LG_API_KEY", help="Require 'Authorization: Bearer KEY'."),
    max_batch_size: int = typer.Option(32, help="Most requests batched together (hf engine)."),
    threads: int | None = typer.Option(None, help="torch CPU threads (hf engine); 1 is fastest on a busy machine."),
) -> None:
    """Serve an agent team over an OpenAI-compatible API (the endpoints and fields vLLM uses)."""
    import uvicorn
    from rich.console import Console

    from marft_lg.serving.server import create_app
    from marft_lg.serving.team import Team

    console = Console(stderr=True)
    if threads:
        import torch

        torch.set_num_threads(threads)
    roles = [a.strip() for a in agents.split(",") if a.strip()]
    pinned: str | dict[str, str] | None = None
    if versions:
        pinned = dict(kv.split("=", 1) for kv in versions.split(",")) if "=" in versions else versions
    kwargs = {} if pinned is None and registry is not None else {"versions": pinned}
    options = {"max_batch_size": max_batch_size} if engine == "hf" else {}
    from marft_lg.serving.errors import ServingError
    from marft_lg.serving.models import ModelNotFoundError

    try:
        with console.status(f"loading {model} with adapters for {', '.join(roles)} ({engine} engine)"):
            team = Team(model, roles, engine=engine, registry=registry, shared_adapter=shared_adapter,
                        engine_options=options, **kwargs)
    except (ServingError, ModelNotFoundError, ValueError) as e:
        console.print(f"[red]marft-lg serve: {e}")
        raise typer.Exit(1) from None
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        console.print(f"[yellow]warning: binding {host} without --api-key exposes the adapters to the network")
    console.print(f"serving {team.model_name} roles {team.versions()} on http://{host}:{port}/v1")
    try:
        uvicorn.run(create_app(team, api_key=api_key), host=host, port=port, log_level="warning")
    finally:
        team.close()


def adapters(
    registry: Path = typer.Option(..., help="Adapter registry directory."),
    promote: list[str] = typer.Option([], help="role=version to make live (repeatable)."),
    rollback: bool = typer.Option(False, help="Restore the previous 'live' map."),
    alias: str = typer.Option("live", help="Alias that --promote / --rollback change."),
    reason: str = typer.Option("", help="Why (kept in the alias log)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """List adapter versions in a registry; promote versions to an alias or roll it back."""
    from rich.console import Console
    from rich.table import Table

    from marft_lg.serving.errors import RegistryError
    from marft_lg.serving.registry import AdapterRegistry

    console = Console(stderr=as_json)  # with --json, stdout holds only the JSON
    reg = AdapterRegistry(registry)
    try:
        if promote and rollback:
            raise RegistryError("use --promote or --rollback, not both")
        if promote:
            bad = [p for p in promote if "=" not in p]
            if bad:
                raise RegistryError(f"--promote takes role=version, got {bad}")
            mapping = dict(p.split("=", 1) for p in promote)
            console.print(f"{alias}: {reg.set_alias(alias, mapping, reason=reason or 'promote (cli)')}")
        elif rollback:
            console.print(f"{alias} rolled back to {reg.rollback(alias, reason=reason or 'rollback (cli)')}")
    except RegistryError as e:
        console.print(f"[red]error: {e}")
        raise typer.Exit(1) from None
    aliases = reg.aliases()
    rows = []
    for role in reg.roles():
        for v in reg.versions(role):
            m = reg.manifest(role, v)
            tags = [a for a, mp in aliases.items() if mp.get(role) == v]
            rows.append({"role": role, "version": v, "aliases": tags, "parent": m.get("parent"),
                         "run_id": m.get("run_id"), "created": m.get("created"), "metrics": m.get("metrics", {}),
                         "base": m.get("base_fingerprint")})
    if as_json:
        print(json.dumps({"versions": rows, "aliases": aliases}, indent=2))
        return
    table = Table(title=f"adapters in {reg.root}")
    for col in ("role", "version", "aliases", "parent", "run id", "created", "metrics"):
        table.add_column(col)
    for r in rows:
        metrics = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r["metrics"].items())
        table.add_row(r["role"], r["version"], ",".join(r["aliases"]), r["parent"] or "", r["run_id"] or "",
                      r["created"] or "", metrics)
    Console().print(table)
