"""CLI commands for marft_lg.evaluation (registered in marft_lg/cli.py). Keep top-level imports light."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import typer

EXIT_SERVER_NOT_CONFIRMED = 4  # promote/rollback: the alias moved (recorded), the server's follow-up check failed


def _versions(spec: str) -> str | dict[str, str]:
    """``live`` (an alias) or ``planner=v2,writer=latest`` (a map), parsed as `marft-lg serve --versions` is."""
    from marft_lg.serving.commands import parse_versions

    try:
        return parse_versions(spec) or spec.strip()
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def _formats(items: list[str] | None) -> dict[str, str]:
    out = {}
    for item in items or []:
        role, sep, pattern = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"--format {item!r}: use ROLE=REGEX (or *=REGEX for every agent)")
        out[role] = pattern
    return out


def baseline_versions(spec: str | dict[str, str], registry: Any, roles: list[str]) -> tuple[str | dict[str, str], str | None]:
    """The baseline to compare against, and a note to print when it is not what was asked for.

    ``live`` on a registry without a live version for some roles (a first project: nothing promoted yet)
    compares against those roles' initial adapters (``role=init``, what the Team serves for them) and says so.
    Any other alias that is not set is a BadParameter telling what to pass instead.
    """
    from marft_lg.serving.team import FRESH

    if not isinstance(spec, str):
        return spec, None
    if registry is None:
        raise typer.BadParameter(
            f"{spec!r} is an alias and needs --registry DIR; without a registry name the versions, e.g. "
            f"--baseline {','.join(f'{r}={FRESH}' for r in roles)} (the initial adapters)", param_hint="--baseline")
    mapping = registry.alias(spec)
    missing = [r for r in roles if r not in mapping]
    if not missing:
        return spec, None
    if spec == "live":
        versions = {r: mapping.get(r, FRESH) for r in roles}
        note = (f"registry {registry.root} has no live version for {missing} (nothing promoted yet): comparing "
                f"against their initial adapters, i.e. --baseline {_format_versions(versions)}")
        return versions, note
    raise typer.BadParameter(
        f"alias {spec!r} has no version for {missing} in registry {registry.root} (aliases: "
        f"{sorted(registry.aliases()) or 'none'}); pass role=ref,... instead, e.g. "
        f"--baseline {','.join(f'{r}={FRESH}' for r in roles)} for the initial adapters", param_hint="--baseline")


def _format_versions(versions: dict[str, str]) -> str:
    return ",".join(f"{r}={v}" for r, v in versions.items())


def _load_gate(gate_path: Path | None) -> Any:
    """The promotion gate of --gate (the default gate without one); a bad file is a usage error naming it."""
    from marft_lg.evaluation.gate import PromotionGate

    try:
        return PromotionGate.from_yaml(gate_path) if gate_path else PromotionGate()
    except (ValueError, OSError) as exc:
        raise typer.BadParameter(str(exc), param_hint="--gate") from None


def _track(report_to: list[str], result: Any, decision: Any, out: Path) -> None:
    """The comparison (report, decision, CIs) as a run of its own in the `--report-to` trackers."""
    if not report_to:
        return
    from marft_lg.evaluation.report import log_comparison
    from marft_lg.tracking.base import open_tracker

    log_comparison(open_tracker(report_to, out, name=f"compare {out.name}"), result, decision, out, finish=True)


def _finish(result: Any, gate: Any, out: Path, console: Any, sections: list[str] | None = None) -> Any:
    from marft_lg.evaluation.report import print_summary, write_report

    decision = gate.evaluate(result, context={"run_dir": str(out)})
    result.save(out)
    decision_path = decision.write(out / "decision.json")
    paths = write_report(result, out, decision, sections)
    print_summary(result, decision, console)
    console.print(f"report: {paths['markdown']}  {paths['html']}\ndecision: {decision_path}")
    return decision


@contextmanager
def _ray_runner(ray: str | None, workers: int, app: Any, team: Any) -> Iterator[Any]:
    """`compare --ray`: rollout workers that build `--app` (an `AppSpec`) and the team's engine and replay there
    (None without)."""
    if ray is None:
        yield None
        return
    from marft_lg._config import ConfigError, load_yaml
    from marft_lg.distributed.config import RayConfig
    from marft_lg.distributed.rollout import RayCollector
    from marft_lg.distributed.worker import WorkerSpec

    try:
        if ray.endswith((".yaml", ".yml")) and Path(ray).is_file():
            cfg = RayConfig.from_doc(load_yaml(ray).at("ray"))
            if cfg is None:
                raise ConfigError(f"{ray} has no ray: section")
        else:
            cfg = RayConfig(address=ray, rollout_workers=workers)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc), param_hint="--ray") from None
    with RayCollector(cfg, WorkerSpec.of(app), versions=team.versions, run_id="compare") as collector:
        yield collector


def compare(
    scenarios: Path | None = typer.Option(None, help="Scenario file (JSONL or parquet) to replay through both teams, "
                                          "or a trace directory to sample real inputs from (see --input-keys)."),
    input_keys: str = typer.Option("question", help="With a trace directory as --scenarios: the graph input keys, comma-separated."),
    n_scenarios: int | None = typer.Option(None, help="With a trace directory as --scenarios: sample this many inputs."),
    baseline: str = typer.Option("live", help="Alias or role=ref,... of the team to compare against."),
    candidate: str = typer.Option("candidate", help="Alias or role=ref,... of the team to try (unlisted roles keep the baseline's)."),
    app: str | None = typer.Option(None, help="The LangGraph app: FILE.py:NAME or module:NAME (a compiled graph, a WrappedGraph, a factory f() -> graph, or f(llm) -> graph given a TeamChatModel); ChatOpenAI calls for the team's roles are served the versions under test."),
    reward: Path = typer.Option(..., help="Reward YAML (CompositeReward) scoring both sides."),
    from_traces: Path | None = typer.Option(None, "--from-traces", help="Compare the live/shadow pairs mirrored into this trace dir instead of replaying."),
    registry: Path | None = typer.Option(None, help="Adapter registry directory (resolves aliases, loads versions). "
                                         "It must exist unless --create-registry."),
    create_registry: bool = typer.Option(False, "--create-registry",
                                         help="Create --registry DIR (empty) if it does not exist."),
    model: str = typer.Option("embedded:smollm2-135m-instruct",
                              help="Base model spec for the team (of every role --agents gives no model)."),
    agents: str | None = typer.Option(None, help="Comma-separated agent roles (default: the registry's roles); "
                                      "ROLE=MODEL puts a role on its own base model."),
    samples: int = typer.Option(1, help="Runs per scenario and side (paired runs share a seed)."),
    seed: int = typer.Option(0, help="Seed of the paired runs and of the bootstrap."),
    gate: Path | None = typer.Option(None, help="Promotion gate YAML (default: the built-in gate)."),
    out: Path | None = typer.Option(None, help="Run directory for the report (default runs/compare-<time>)."),
    format: list[str] | None = typer.Option(None, "--format", help="ROLE=REGEX its completions must match (repeatable; *=REGEX for all)."),
    drift: bool = typer.Option(True, help="Measure per-agent policy drift (KL) between the two versions."),
    temperature: float = typer.Option(1.0, help="Sampling temperature of the replayed LLM calls (0: greedy) of an "
                                      "f(llm) app; an app on its own chat models keeps their settings."),
    max_tokens: int = typer.Option(256, help="Most tokens per replayed LLM call of an f(llm) app (as --temperature)."),
    promote_if_passed: bool = typer.Option(False, "--promote", help="Promote the candidate to live when the gate passes."),
    server: str | None = typer.Option(None, help="Running server to hot-swap on --promote (e.g. http://127.0.0.1:8000)."),
    node_roles: str | None = typer.Option(None, "--node-roles", help="node=role,... for app nodes whose name is not their agent role (passed to wrap)."),
    recursion_limit: int | None = typer.Option(None, "--recursion-limit", min=1, help="LangGraph step limit of each replayed episode (default: LangGraph's own); an episode stopped there counts as truncated, not failed."),
    resume_value: str | None = typer.Option(None, "--resume-value", help="Answer every interrupt() of the app with this value (JSON, else the text), resuming the episode on its thread."),
    resume_with: str | None = typer.Option(None, "--resume-with", help="Answer each interrupt() with FILE.py:FUNC / module:FUNC called on its payload (a simulated user)."),
    ray: str | None = typer.Option(None, "--ray", help="Replay on Ray rollout workers: an address (local, auto, ray://host:port) or a YAML file with a ray: section; --app must then be a factory f(llm) -> graph."),
    ray_workers: int = typer.Option(2, "--ray-workers", help="Rollout workers with --ray ADDRESS (a ray: section says its own)."),
    report_to: str | None = typer.Option(None, "--report-to", help="Trackers for the report and decision, comma-separated: tensorboard, mlflow, wandb (offline) or none."),
    attribute: int = typer.Option(0, "--attribute", min=0, help="Blame section: replay each step of the candidate's "
                                  "episodes N times with that role's baseline version (0: off)."),
) -> None:
    """Shadow-compare a candidate team against the baseline, gate it, and write the report.

    With no `live` version in the registry yet (a first project), `--baseline live` compares against the
    initial adapters (role=init) and says so."""
    from rich.console import Console

    from marft_lg.tracking.commands import report_to_option

    console = Console()
    roles_of_nodes = _check_flags(registry, create_registry, from_traces, node_roles)
    trackers = report_to_option(report_to)
    out = out or Path("runs") / f"compare-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    scorer = _load_reward(reward)
    gate_spec = _load_gate(gate)  # before any work: a bad gate file fails at once
    scenario_set = _scenario_set(scenarios, input_keys, n_scenarios, seed, out, console)
    if from_traces is not None:
        from marft_lg.evaluation.shadow import compare_mirrored

        try:
            with console.status(f"mining mirrored pairs from {from_traces}"):
                result = compare_mirrored(from_traces, scorer, scenarios=scenario_set, formats=_formats(format),
                                          seed=seed)
        except (FileNotFoundError, ValueError) as exc:  # no trace files, no mirrored pairs in them
            raise typer.BadParameter(str(exc), param_hint="--from-traces") from None
        _track(trackers, result, _finish(result, gate_spec, out, console), out)
        return
    if scenario_set is None or app is None:
        raise typer.BadParameter("replay needs --scenarios FILE and --app FILE.py:NAME (or use --from-traces DIR)")
    spec, reg = _replay_spec(app, model, agents, registry, roles_of_nodes, max_tokens, temperature, recursion_limit,
                             _resume_option(resume_value, resume_with))
    base_spec, note = baseline_versions(_versions(baseline), reg, spec.agents)
    cand_spec = _candidate_versions(candidate, reg)
    if note:
        console.print(f"[yellow]{note}[/]")
    with console.status(f"loading {model if isinstance(spec.model, str) else 'the base models'} for "
                        f"{', '.join(spec.agents)}"):
        team = spec.build_team(registry=reg)
    try:
        decision, result = _replay_and_gate(spec, team, out, ray, ray_workers, base_spec, cand_spec, scenario_set, scorer,
                                            samples, seed, _formats(format), drift, gate_spec, console, trackers,
                                            attribute)
    finally:
        team.close()
    if promote_if_passed and decision.promote:
        _promote_candidate(reg, result, decision, server, out, console)


def _check_flags(registry: Path | None, create_registry: bool, from_traces: Path | None, node_roles: str | None) -> Any:
    """The paths and `--node-roles` checked before anything is created (the report folder included): usage errors
    naming the flag. Returns the parsed node roles."""
    from marft_lg.loading import parse_node_roles
    from marft_lg.serving.registry.store import missing_registry

    missing = missing_registry(registry, create=create_registry)
    if missing:
        raise typer.BadParameter(missing, param_hint="--registry")
    try:
        roles_of_nodes = parse_node_roles(node_roles, key="--node-roles")
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--node-roles") from None
    if from_traces is not None and not from_traces.is_dir():
        raise typer.BadParameter(f"{from_traces} is not a trace directory", param_hint="--from-traces")
    return roles_of_nodes


def _load_reward(path: Path) -> Any:
    from marft_lg.rewards.composite import CompositeReward

    try:
        return CompositeReward.from_yaml(path)
    except (ValueError, FileNotFoundError) as exc:
        raise typer.BadParameter(str(exc), param_hint="--reward") from None


def _scenario_set(scenarios: Path | None, input_keys: str, n: int | None, seed: int, out: Path, console: Any) -> Any:
    """--scenarios: a scenario file, or a trace folder whose real inputs are sampled (saved beside the report)."""
    if scenarios is None:
        return None
    if not scenarios.is_dir():
        from marft_lg.trajectories.scenarios import ScenarioSet

        try:
            return ScenarioSet.load(scenarios)
        except (ValueError, OSError) as exc:
            raise typer.BadParameter(str(exc), param_hint="--scenarios") from None
    from marft_lg.trajectories.mining import mine
    from marft_lg.trajectories.scenario_sets import scenarios_from_dataset

    keys = [k.strip() for k in input_keys.split(",") if k.strip()]
    scenario_set = scenarios_from_dataset(mine(scenarios), keys, n=n, seed=seed)
    if not len(scenario_set):
        raise typer.BadParameter(f"no successful episodes with inputs {keys} under {scenarios}")
    scenario_set.save(out / "scenarios.jsonl")
    console.print(f"{len(scenario_set)} scenarios sampled from {scenarios} -> {out / 'scenarios.jsonl'}")
    return scenario_set


def _resume_option(value: str | None, call: str | None) -> Any:
    """The `ResumePolicy` of ``--resume-value`` / ``--resume-with`` (None when neither is given)."""
    from marft_lg.graph.interrupts import policy_from_flags

    try:
        return policy_from_flags(value, call)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--resume-value / --resume-with") from None


def _replay_spec(app: str, model: str, agents: str | None, registry: Path | None, node_roles: Any, max_tokens: int,
                 temperature: float, recursion_limit: int | None = None, resume: Any = None) -> tuple[Any, Any]:
    """The `AppSpec` the replay flags describe (its app loaded and checked before any model loads), and the
    registry."""
    from marft_lg._config import ConfigError
    from marft_lg.graph.app_spec import AppSpec
    from marft_lg.loading import parse_node_roles
    from marft_lg.serving.registry.store import AdapterRegistry

    reg = AdapterRegistry(registry) if registry else None
    model_spec: str | dict[str, str] = model
    if not agents:
        roles = reg.roles() if reg else []
    else:
        from marft_lg.serving.commands import parse_agents

        try:
            parsed = parse_agents(agents, model)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--agents") from None
        roles = list(parsed)
        if "=" in agents:  # role=MODEL items: a {role: model} mapping (maybe several base models)
            model_spec = parsed
    if not roles:
        raise typer.BadParameter("no agent roles: pass --agents planner,writer or a --registry that has versions")
    try:
        node_roles = parse_node_roles(node_roles, key="--node-roles", roles=roles)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--node-roles") from None
    spec = AppSpec(app=app, model=model_spec, agents=roles, registry=None if reg is None else str(reg.root),
                   node_roles=node_roles, what="--app", chat_model={"max_tokens": max_tokens, "temperature": temperature},
                   recursion_limit=recursion_limit, resume=resume)
    try:
        spec.check_app()
        spec.resume_policy()
    except ConfigError as exc:
        raise typer.BadParameter(str(exc), param_hint="--app") from None
    return spec, reg


def _candidate_versions(candidate: str, reg: Any) -> str | dict[str, str]:
    cand_spec = _versions(candidate)
    if isinstance(cand_spec, str) and (reg is None or not reg.alias(cand_spec)):
        raise typer.BadParameter(
            f"alias {cand_spec!r} is not set" + (f" in registry {reg.root}" if reg else " (no --registry given)")
            + "; train first (`marft-lg train` sets `candidate`) or pass role=ref,..., e.g. writer=v2 or writer=latest",
            param_hint="--candidate")
    return cand_spec


def _promote_candidate(reg: Any, result: Any, decision: Any, server: str | None, out: Path, console: Any) -> None:
    from marft_lg.evaluation.promotion import PromotionError, ServerNotConfirmed
    from marft_lg.evaluation.promotion import promote as do_promote
    from marft_lg.serving.errors import ServingError

    try:
        rec = do_promote(reg, result.meta["candidate"], decision=decision, server_url=server, run_dir=out,
                         reason=f"gate passed ({out})")
    except ServerNotConfirmed as exc:
        console.print(f"promoted, server not confirmed: {exc}", style="yellow", markup=False, highlight=False)
        raise typer.Exit(EXIT_SERVER_NOT_CONFIRMED) from None
    except (PromotionError, ServingError) as exc:
        console.print(f"not promoted: {exc}", style="red", markup=False, highlight=False)
        raise typer.Exit(1) from None
    console.print(f"promoted: live = {rec.after}" + (f"; {server} now serves {rec.swapped}" if server else ""))


def _replay_and_gate(spec: Any, team: Any, out: Path, ray: str | None, ray_workers: int, baseline: Any, candidate: Any,
                     scenarios: Any, scorer: Any, samples: int, seed: int, formats: dict[str, str], drift: bool,
                     gate: Any, console: Any, report_to: list[str] | None = None,
                     attribute: int = 0) -> tuple[Any, Any]:
    """The replays (here or on Ray workers), the gate and the report; a comparison whose episodes failed or missed
    the versions under test is an error, not a report."""
    from marft_lg._config import ConfigError
    from marft_lg.evaluation.shadow import shadow_compare
    from marft_lg.graph.collect import RolloutError

    try:
        wrapped = spec.build_app(team, out / "traces")
    except ConfigError as exc:
        raise typer.BadParameter(str(exc), param_hint="--app") from None
    try:
        with _ray_runner(ray, ray_workers, spec, team) as runner:
            result = shadow_compare(wrapped, baseline, candidate, scenarios, scorer, samples_per_scenario=samples,
                                    seed=seed, formats=formats, drift=drift, runner=runner)
            if runner is not None:
                console.print(f"replayed on Ray rollout workers: {_episodes_per_worker(result)}", markup=False,
                              highlight=False)
            sections = _blame_section(result, wrapped, runner, scenarios, scorer, attribute, seed, out, console)
    except RolloutError as exc:
        console.print(f"compare failed, no report: {exc}", style="red", markup=False, highlight=False)
        raise typer.Exit(1) from None
    finally:
        wrapped.close()
    decision = _finish(result, gate, out, console, sections)
    _track(report_to or [], result, decision, out)
    return decision, result


def _blame_section(result: Any, wrapped: Any, runner: Any, scenarios: Any, scorer: Any, replays: int, seed: int,
                   out: Path, console: Any) -> list[str]:
    """`compare --attribute N`: which of the candidate's agents is to blame, each step replaced by its role's baseline
    version (`evaluation.attribution`); its files in ``out/attribution``, its Markdown for the report."""
    if not replays:
        return []
    from marft_lg.evaluation.attribution import attribute as run_attribution
    from marft_lg.evaluation.attribution import blame_markdown, write_blame
    from marft_lg.graph.collect import GraphCollector
    from marft_lg.graph.replays import ReplayBudget

    base, cand = result.meta["baseline"], result.meta["candidate"]
    budget = ReplayBudget(per_action=replays, reference={r: v for r, v in base.items() if v != cand.get(r)},
                          versions=cand)
    with console.status(f"blame: replaying each step of the candidate's episodes {replays}x"):
        blame = run_attribution(runner or GraphCollector(wrapped, run_id="blame"), result.datasets["candidate"],
                                {s.scenario_id: s for s in scenarios}, scorer, budget=budget, seed=seed)
    write_blame(blame, out / "attribution")
    return [blame_markdown(blame)]


def _episodes_per_worker(result: Any) -> str:
    """``w0: 8, w1: 8``: how many of the comparison's episodes each rollout worker ran (from the episodes' tags)."""
    from collections import Counter

    from marft_lg.distributed.rollout import WORKER_KEY

    counts: Counter = Counter()
    for ds in result.datasets.values():
        counts.update(m.get(WORKER_KEY) for m in ds.episodes["metadata"] if isinstance(m, dict) and WORKER_KEY in m)
    return ", ".join(f"w{w}: {n}" for w, n in sorted(counts.items())) or "none tagged"


def promote(
    registry: Path = typer.Option(..., help="Adapter registry directory."),
    decision: Path | None = typer.Option(None, help="decision.json (or its run dir) from `marft-lg compare`; a rejection refuses."),
    versions: str | None = typer.Option(None, help="Alias or role=ref,... to make live (default: the decision's candidate, else 'candidate')."),
    alias: str = typer.Option("live", help="Alias to flip."),
    server: str | None = typer.Option(None, help="Running server to hot-swap (POST /v1/load_lora_adapter)."),
    api_key: str | None = typer.Option(None, envvar="MARFT_LG_API_KEY", help="Bearer key of the server."),
    force: bool = typer.Option(False, help="Promote even though the gate rejected (recorded as forced)."),
    reason: str = typer.Option("", help="Why (kept in the registry log and promotions.jsonl)."),
) -> None:
    """Flip the live alias to the candidate atomically and hot-swap the running server.

    Exit codes: 0 promoted; 1 not promoted (nothing changed, or the message says exactly what did); 4 the alias
    moved (recorded in promotions.jsonl) but the server's follow-up check failed: the message says what it may serve.
    """
    from rich.console import Console

    from marft_lg.evaluation.gate import GateDecision
    from marft_lg.evaluation.promotion import PromotionError, ServerNotConfirmed
    from marft_lg.evaluation.promotion import promote as do_promote
    from marft_lg.serving.errors import ServingError
    from marft_lg.serving.registry.store import AdapterRegistry

    console = Console(soft_wrap=True)
    err = Console(stderr=True, soft_wrap=True)
    try:
        reg = AdapterRegistry(registry, create=False)
    except ServingError as exc:
        err.print(f"not promoted: {exc}", style="red", markup=False, highlight=False)
        raise typer.Exit(1) from None
    try:
        gate_decision = GateDecision.read(decision) if decision else None
    except (FileNotFoundError, ValueError) as exc:
        err.print(f"not promoted: --decision: {exc}", style="red", markup=False, highlight=False)
        raise typer.Exit(1) from None
    target: str | dict[str, str] = "candidate"
    if versions:
        target = _versions(versions)
    elif gate_decision is not None and isinstance(gate_decision.context.get("candidate"), dict):
        # replay decisions hold {role: version}; mirrored ones {role: [versions seen]}: usable when one each
        cand = {r: (v[0] if isinstance(v, list) and len(v) == 1 else v)
                for r, v in gate_decision.context["candidate"].items()}
        if cand and all(isinstance(v, str) for v in cand.values()):
            target = cand
    run_dir = None if decision is None else (decision if decision.is_dir() else decision.parent)
    try:
        rec = do_promote(reg, target, alias=alias, decision=gate_decision, force=force, server_url=server,
                         api_key=api_key, reason=reason, run_dir=run_dir)
    except ServerNotConfirmed as exc:
        err.print(f"promoted, server not confirmed: {exc}", style="yellow", markup=False, highlight=False)
        raise typer.Exit(EXIT_SERVER_NOT_CONFIRMED) from None
    except (PromotionError, ServingError) as exc:
        err.print(f"not promoted: {exc}", style="red", markup=False, highlight=False)
        raise typer.Exit(1) from None
    console.print(f"{alias}: {rec.before} -> {rec.after}" + (f"; {server} swapped {rec.swapped}" if server else ""),
                  markup=False, highlight=False)


def rollback(
    registry: Path = typer.Option(..., help="Adapter registry directory."),
    alias: str = typer.Option("live", help="Alias to restore."),
    server: str | None = typer.Option(None, help="Running server to hot-swap back."),
    api_key: str | None = typer.Option(None, envvar="MARFT_LG_API_KEY", help="Bearer key of the server."),
    reason: str = typer.Option("rollback", help="Why (kept in the registry log and promotions.jsonl)."),
) -> None:
    """Restore exactly the versions the alias served before its last change (roles it did not name then
    go back to their initial adapters) and hot-swap the server.

    Exit codes: 0 rolled back; 1 not rolled back; 4 the alias moved back (recorded) but the server's follow-up
    check failed: the message says what it may serve.
    """
    from rich.console import Console

    from marft_lg.evaluation.promotion import PromotionError, ServerNotConfirmed
    from marft_lg.evaluation.promotion import rollback as do_rollback
    from marft_lg.serving.errors import ServingError
    from marft_lg.serving.registry.store import AdapterRegistry

    console = Console(soft_wrap=True)
    err = Console(stderr=True, soft_wrap=True)
    try:
        rec = do_rollback(AdapterRegistry(registry, create=False), alias=alias, server_url=server, api_key=api_key,
                          reason=reason)
    except ServerNotConfirmed as exc:
        err.print(f"rolled back, server not confirmed: {exc}", style="yellow", markup=False, highlight=False)
        raise typer.Exit(EXIT_SERVER_NOT_CONFIRMED) from None
    except (PromotionError, ServingError) as exc:
        err.print(f"not rolled back: {exc}", style="red", markup=False, highlight=False)
        raise typer.Exit(1) from None
    console.print(f"{alias}: {rec.before} -> {rec.after}" + (f"; {server} swapped {rec.swapped}" if server else ""),
                  markup=False, highlight=False)
