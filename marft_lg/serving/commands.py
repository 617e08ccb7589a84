"""CLI commands for marft_lg.serving (registered in marft_lg/cli.py). Keep top-level imports light."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from marft_lg.loading import role_problem


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve to any interface


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 2000 else text[:2000] + "..."


def _bind(host: str, port: int):
    """The listening socket, bound before the model loads: a port in use fails in a second, not after a minute."""
    import socket

    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except BaseException:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def parse_versions(spec: str | None) -> str | dict[str, str] | None:
    """``live`` (an alias) or ``planner=v2,writer=latest`` (a map); None for none. A bad item is a ValueError."""
    if not spec:
        return None
    if "=" not in spec:
        return spec.strip()
    out = {}
    for item in spec.split(","):
        role, sep, ref = item.partition("=")
        if not sep or not role.strip() or not ref.strip():
            raise ValueError(f"--versions {spec!r}: {item!r} is not role=ref; use an alias name or role=ref,...")
        out[role.strip()] = ref.strip()
    return out


def parse_agents(spec: str, default_model: str) -> dict[str, str]:
    """``--agents planner=MODEL_A,writer=MODEL_B,critic`` -> ``{role: model spec}`` (an item without ``=`` runs on
    `default_model`, the ``--model``). Empty roles or models, a role the registry would refuse, and a role named
    twice, are ValueErrors."""
    from marft_lg.serving.errors import RegistryError
    from marft_lg.serving.registry.store import _check_name

    out: dict[str, str] = {}
    for item in spec.split(","):
        if not item.strip():
            continue
        role, sep, model = item.partition("=")
        role, model = role.strip(), model.strip() if sep else default_model
        if not role or not model:
            raise ValueError(f"--agents {spec!r}: {item.strip()!r} is not ROLE or ROLE=MODEL")
        if role_problem(role):
            raise ValueError(f"--agents {spec!r}: {role_problem(role)}")
        try:
            _check_name(role, "agent role")  # the registry's rule: a role is a folder its versions are saved in
        except RegistryError as e:
            raise ValueError(f"--agents {spec!r}: {e}") from None
        if role in out:
            raise ValueError(f"--agents {spec!r}: role {role!r} is named twice")
        out[role] = model
    if not out:
        raise ValueError("--agents is empty; name the roles, e.g. --agents planner,writer (or planner=MODEL,...)")
    return out


def serve(
    model: str = typer.Option("embedded:smollm2-135m-instruct",
                              help="Model spec: embedded:NAME or a local HF dir (of every role --agents gives no model)."),
    agents: str = typer.Option(..., help="Comma-separated agent roles, e.g. planner,writer; ROLE=MODEL puts a role "
                                         "on its own base model, e.g. planner=embedded:smollm2-135m-instruct,writer=./w."),
    engine: str = typer.Option("hf", help="hf (embedded transformers + peft) or vllm (managed vLLM server)."),
    registry: Path | None = typer.Option(None, help="Adapter registry directory; roles serve its 'live' versions. "
                                         "It must exist unless --create-registry."),
    create_registry: bool = typer.Option(False, "--create-registry",
                                         help="Create --registry DIR (empty) if it does not exist."),
    versions: str | None = typer.Option(None, help="Alias or role=ref,... to serve (default: live with a registry)."),
    shared_adapter: bool = typer.Option(False, help="All roles share one adapter (parameter sharing)."),
    host: str = typer.Option("127.0.0.1", help="Bind address (loopback by default)."),
    port: int = typer.Option(8000, help="TCP port (0: any free port)."),
    api_key: str | None = typer.Option(None, envvar="MARFT_LG_API_KEY", help="Require 'Authorization: Bearer KEY'."),
    insecure_no_auth: bool = typer.Option(False, "--insecure-no-auth",
                                          help="Allow a non-loopback --host without --api-key."),
    max_body_mb: float = typer.Option(8.0, help="Largest request body in MB; larger ones get 413 unread."),
    request_timeout: float = typer.Option(600.0, help="Seconds a generation may run before it is cancelled (504)."),
    read_timeout: float = typer.Option(30.0, help="Seconds a client has to send its request (else 408) and may "
                                       "leave a stream unread before it is dropped."),
    lora: Path | None = typer.Option(None, help="LoRA settings YAML of the fresh (initial) adapters."),
    max_batch_size: int = typer.Option(32, help="Most requests batched together (hf engine)."),
    threads: int | None = typer.Option(None, help="torch CPU threads (hf engine); 1 is fastest on a busy machine."),
    trace_dir: Path = typer.Option(Path("traces"), help="Where each answered request's record goes (rendered prompt "
                                   "token ids, completion ids, log-probs, adapter version), joined at mining to the "
                                   "app's spans (OTLP/JSON lines, files served-*.jsonl); feedback posted to "
                                   "/v1/feedback goes there too (feedback-*.jsonl)."),
    no_trace: bool = typer.Option(False, "--no-trace", help="Record nothing (apps on ChatOpenAI then train on "
                                  "re-rendered prompts)."),
    capture_messages: bool = typer.Option(True, help="Keep the requests' messages and the completions' text in "
                                          "the records (--no-capture-messages: token ids and log-probs only)."),
) -> None:
    """Serve an agent team over an OpenAI-compatible API (the endpoints and fields vLLM uses).

    A start-up failure (port in use, missing model, bad registry, damaged adapter) prints one line
    naming the cause and exits with code 2. With ``--agents role=MODEL`` items the roles may run on several
    base models (one engine each); the start-up lines say which base each role is on.
    """
    from rich.console import Console

    console = Console(stderr=True, soft_wrap=True)
    try:
        models = parse_agents(agents, model)
        pinned = parse_versions(versions)
    except ValueError as e:
        raise _serve_failed(str(e)) from None
    if not _is_loopback(host) and not api_key and not insecure_no_auth:
        raise _serve_failed(f"refusing to bind {host} without --api-key: anyone who can reach it could use and swap "
                            "the adapters; pass --api-key KEY (or MARFT_LG_API_KEY), bind 127.0.0.1, or pass "
                            "--insecure-no-auth")
    for flag, value in (("--max-body-mb", max_body_mb), ("--request-timeout", request_timeout),
                        ("--read-timeout", read_timeout)):
        if not value > 0:
            raise _serve_failed(f"{flag} must be > 0, got {value}")
    if not 0 <= port <= 65535:
        raise _serve_failed(f"--port must be 0..65535 (0: any free port), got {port}")
    from marft_lg.serving.registry.store import missing_registry

    missing = missing_registry(registry, create=create_registry)
    if missing:
        raise _serve_failed(missing)
    settings = _lora_settings(lora)
    try:
        sock = _bind(host, port)
    except OSError as e:
        raise _serve_failed(f"cannot listen on {host}:{port}: {e.strerror or e}"
                            + (" (another server is using it: pick another --port)" if e.errno in (98, 48) else "")
                            ) from None
    from marft_lg.serving.team_factory import TeamSpec

    spec = TeamSpec(model=models if "=" in agents else model, agents=list(models), registry=registry, engine=engine,
                   engine_options={"max_batch_size": max_batch_size} if engine == "hf" else {}, lora=settings,
                   shared_adapter=shared_adapter)
    team = _load_team(spec, "live" if pinned is None and registry is not None else pinned, threads, sock, console)
    _announce(team, host, sock.getsockname()[1], api_key, console)
    recorder = None if no_trace else _recorder(trace_dir, capture_messages, console)
    _run(team, sock, host, recorder, api_key=api_key, max_body_bytes=int(max_body_mb * 2**20),
         request_timeout_s=request_timeout, read_timeout_s=read_timeout, feedback_dir=None if no_trace else trace_dir)


def _serve_failed(message: str) -> typer.Exit:
    typer.echo(f"marft-lg serve: {message}", err=True)
    return typer.Exit(2)


def _lora_settings(path: Path | None) -> Any:
    if path is None:
        return None
    from marft_lg.serving.registry.lora import LoraSettings

    try:
        return LoraSettings.from_yaml(path)
    except ValueError as e:
        raise _serve_failed(_one_line(e)) from None


def _load_team(spec: Any, versions: Any, threads: int | None, sock: Any, console: Any) -> Any:
    """The team the flags describe (`AppSpec.build_team`); any failure closes the socket and is one line, exit 2."""
    try:
        if threads:
            import torch

            torch.set_num_threads(threads)
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # the status line says what loads; stderr stays for errors
        models = spec.model.values() if isinstance(spec.model, dict) else [spec.model]
        with console.status(f"loading {', '.join(dict.fromkeys(models))} with adapters for "
                            f"{', '.join(spec.agents)} ({spec.engine} engine)"):
            return spec.build_team(versions=versions)
    except KeyboardInterrupt:
        sock.close()
        raise typer.Exit(130) from None
    except Exception as e:  # noqa: BLE001 - start-up errors are one line naming the cause, never a traceback
        sock.close()
        raise _serve_failed(_one_line(e)) from None


def _announce(team: Any, host: str, port: int, api_key: str | None, console: Any) -> None:
    if not _is_loopback(host) and not api_key:
        console.print(f"warning: serving {host} without an API key (--insecure-no-auth)", style="yellow", markup=False)
    console.print(f"serving {team.model_name} roles {team.versions()} on http://{host}:{port}/v1",
                  markup=False, highlight=False)
    for name, base in team.bases.items():
        console.print(f"  base {name}: {', '.join(base.agents())}", markup=False, highlight=False)


def _recorder(trace_dir: Path, capture_messages: bool, console: Any) -> Any:
    """What the server records every answered request into (`served_spans`): files served-*.jsonl in `trace_dir`."""
    from marft_lg.serving.http.served_spans import ServedRecorder
    from marft_lg.tracing.sink import make_record_sink

    console.print(f"recording what it samples in {trace_dir}", markup=False, highlight=False)
    return ServedRecorder(make_record_sink(trace_dir, service_name="marft_lg.serve", file_prefix="served"),
                          capture_messages=capture_messages, owns_sink=True)


def uvicorn_config(app: Any, host: str, port: int, read_timeout_s: float) -> Any:
    """How `serve` runs uvicorn: the read timeout also bounds the request line and headers (`header_deadline_protocol`)."""
    import uvicorn

    from marft_lg.serving.http.transport import header_deadline_protocol

    return uvicorn.Config(app, host=host, port=port, log_level="warning", http=header_deadline_protocol(read_timeout_s))


def _run(team: Any, sock: Any, host: str, recorder: Any, **app_options: Any) -> None:
    """Serve until stopped (`app_options`: `create_app`'s); the recorder, the team and the socket are closed
    whatever happens."""
    import logging

    import uvicorn

    from marft_lg.serving.http.server import DEFAULT_READ_TIMEOUT_S, create_app

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app = create_app(team, recorder=recorder, **app_options)
        server = uvicorn.Server(uvicorn_config(app, host, sock.getsockname()[1],
                                               app_options.get("read_timeout_s", DEFAULT_READ_TIMEOUT_S)))
        server.run(sockets=[sock])
    finally:
        if recorder is not None:
            recorder.close()
        team.close()
        sock.close()


def adapters(
    registry: Path = typer.Option(..., help="Adapter registry directory."),
    promote: list[str] = typer.Option([], help="role=version to make live (repeatable)."),
    rollback: bool = typer.Option(False, help="Restore the previous 'live' map."),
    alias: str = typer.Option("live", help="Alias that --promote / --rollback change."),
    reason: str = typer.Option("", help="Why (kept in the alias log)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """List adapter versions in a registry (damaged ones marked); promote versions to an alias or roll it back.

    The registry must exist (nothing is created). A damaged version (files changed since they were
    saved, truncated, not LoRA-shaped) is listed as DAMAGED with the file and the reason.
    """
    from rich.console import Console
    from rich.table import Table

    from marft_lg.serving.errors import AdapterIntegrityError, RegistryError, ServingError
    from marft_lg.serving.registry.store import AdapterRegistry

    console = Console(stderr=as_json, soft_wrap=True)  # with --json, stdout holds only the JSON
    err = Console(stderr=True, soft_wrap=True)
    try:
        reg = AdapterRegistry(registry, create=False)
        if promote and rollback:
            raise RegistryError("use --promote or --rollback, not both")
        if promote:
            bad = [p for p in promote if "=" not in p]
            if bad:
                raise RegistryError(f"--promote takes role=version, got {bad}")
            mapping = dict(p.split("=", 1) for p in promote)
            console.print(f"{alias}: {reg.set_alias(alias, mapping, reason=reason or 'promote (cli)')}",
                          markup=False, highlight=False)
        elif rollback:
            console.print(f"{alias} rolled back to {reg.rollback(alias, reason=reason or 'rollback (cli)')}",
                          markup=False, highlight=False)
        aliases = reg.aliases()
    except ServingError as e:
        err.print(f"error: {_one_line(e)}", style="red", markup=False, highlight=False)
        raise typer.Exit(1) from None
    _warn_incomplete(reg, aliases, err)
    rows = []
    damaged = []
    for role in reg.roles():
        for v in reg.versions(role):
            m: dict = {}
            try:
                m = reg.manifest(role, v)
                check = reg.verify(role, v)
                integrity = {"status": "ok" if check.hash == "ok" else "unrecorded", "file": None, "reason": None}
            except AdapterIntegrityError as e:
                integrity = {"status": "damaged", "file": e.file, "reason": e.reason}
            except ServingError as e:  # corrupt manifest, a version directory that escapes the registry
                integrity = {"status": "damaged", "file": str(reg.root / role / v), "reason": _one_line(e)}
            if integrity["status"] == "damaged":
                damaged.append((role, v, integrity))
            tags = [a for a, mp in aliases.items() if mp.get(role) == v]
            rows.append({"role": role, "version": v, "aliases": tags, "parent": m.get("parent"),
                         "run_id": m.get("run_id"), "created": m.get("created"), "metrics": m["metrics"] if isinstance(m.get("metrics"), dict) else {},
                         "base": m.get("base_fingerprint"), "base_name": m.get("base_name"),
                         "integrity": integrity})
    if as_json:
        print(json.dumps({"versions": rows, "aliases": aliases}, indent=2))
    else:
        table = Table(title=f"adapters in {reg.root}")
        for col in ("role", "version", "aliases", "parent", "run id", "created", "metrics", "integrity"):
            table.add_column(col, overflow="fold")
        for r in rows:
            metrics = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r["metrics"].items())
            status = {"ok": "ok", "unrecorded": "ok (hash unrecorded)", "damaged": "DAMAGED"}[r["integrity"]["status"]]
            table.add_row(r["role"], r["version"], ",".join(r["aliases"]), r["parent"] or "", r["run_id"] or "",
                          r["created"] or "", metrics, status)
        out = Console(soft_wrap=True)
        if not out.is_terminal:  # a pipe or a log file: no reason to squeeze the columns
            out = Console(soft_wrap=True, width=200)
        out.print(table)
    for role, v, integrity in damaged:
        err.print(f"warning: {role}/{v} is DAMAGED: {integrity['file']}: {integrity['reason']}", style="yellow",
                  markup=False, highlight=False)


def _warn_incomplete(reg: Any, aliases: dict[str, dict[str, str]], err: Any) -> None:
    """Name each version folder without a manifest (not a version any more, so not in the table), loudest when an
    alias still names it: such a version must not vanish from `adapters` without a word."""
    for role, version in reg.incomplete():
        folder = reg.root / role / version
        named = sorted(a for a, mp in aliases.items() if mp.get(role) == version)
        if named:
            err.print(f"warning: {folder} has no manifest.json, yet alias {', '.join(named)} names it for {role}: "
                      f"that alias cannot be served or promoted; restore the manifest or point the alias elsewhere",
                      style="red", markup=False, highlight=False)
        else:
            err.print(f"warning: {folder} has no manifest.json (deleted, or a save that never finished); it is not "
                      "listed as a version", style="yellow", markup=False, highlight=False)
