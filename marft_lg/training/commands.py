"""`marft-lg train --config train.yaml [--resume]` (registered in marft_lg/cli.py). Heavy imports stay inside.

train.yaml:

    model: embedded:smollm2-135m-instruct   # or a local transformers directory, or {role: model} (below)
    agents: [reasoner, actor]
    registry: registry                      # new adapter versions are written here
    versions: live                          # starting adapters: an alias, {role: ref}, or null (fresh)
    run_dir: runs/train                     # metrics.jsonl, plots, checkpoints
    reward: reward.yaml                     # CompositeReward YAML (or the mapping inline)
    scenarios: scenarios.jsonl              # references for the reward; the online phase runs them (split train)
                                            # or users' inputs: {from_traces: traces, input_keys: [question],
                                            # heldout: 0.2} (no references: a judge or feedback scores them)
    data: traces                            # offline data: a traces directory/glob or a parquet dataset dir
    phases: [offline, online]               # [warm_start, offline, online]: first teach each agent its team's best
    warm_start: {keep: best_of_group, epochs: 2}   # episodes (`data`, else K fresh rollouts per train scenario)
    online: {app: "marft_lg.examples.math_team.graph:build_graph", iterations: 10, max_tokens: 64, split: train}
    marft: {learning_rate: 5.0e-5, ...}     # MARFTConfig keys
    report_to: [mlflow]                     # trackers (tensorboard, mlflow, wandb, none); overrides marft.report_to
    ray: {address: local, rollout_workers: 2, worker: {num_cpus: 1, num_gpus: 0}, async: false}  # optional

`model` may be a mapping ``{role: model spec}`` (a team of several base models, `MixedTeam`): then `agents` may be
omitted (the mapping's roles) or must name the same roles.

`online.app` is `module:function` or `file.py:function`, loaded relative to train.yaml's folder (a module or
file next to it needs no PYTHONPATH); `online.node_roles: {node: role}` maps app nodes to agent roles.
With a `ray:` section the online phase's episodes run on Ray rollout workers (docs/distributed.md); the learner
stays in this process.
"""

from __future__ import annotations

import glob
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import typer

from marft_lg._config import ConfigError, YamlDoc, check_fields, convert, load_yaml
from marft_lg.loading import LoadError, check_model_mapping, check_roles, load_object, parse_node_roles
from marft_lg.tracking.settings import TrackingUnavailable, check_report_to, parse_report_to, require_all

DEFAULT_APP = "marft_lg.examples.math_team.graph:build_graph"
ONLINE_KEYS = ("app", "node_roles", "split", "iterations", "max_tokens", "temperature", "recursion_limit",
               "resume")
PHASES = ("warm_start", "offline", "online")
EXIT_BAD_INPUT = 2
EXIT_ROLLOUTS = 1  # the online phase's episodes failed (or missed the versions under test): nothing published
EXIT_NO_DATA = 1  # the data held no usable episode, or an iteration had no action to train: nothing published


@dataclass
class TrainFile:
    """The train.yaml sections. Types and values are checked when it is loaded; every error is a
    `ConfigError` naming ``train.yaml:line: key``."""

    model: str | dict[str, str] = "embedded:smollm2-135m-instruct"
    agents: list[str] = field(default_factory=list)
    registry: str = "registry"
    versions: Any = "live"
    run_dir: str = "runs/train"
    reward: Any = None
    scenarios: Any = None
    """A scenario file, or ``{from_traces: DIR, input_keys: [...], heldout: 0.2, ...}``
    (`trajectories.scenario_sets.check_scenario_source`)."""
    data: str | None = None
    phases: list[str] = field(default_factory=lambda: ["offline"])
    online: dict[str, Any] = field(default_factory=dict)
    warm_start: dict[str, Any] = field(default_factory=dict)
    """`training.warm_start.WarmStartConfig` keys, for the phase ``warm_start``."""
    marft: dict[str, Any] = field(default_factory=dict)
    ray: Any = None
    report_to: list[str] | None = None
    """Trackers of the run (docs/tracking.md); set, it overrides `marft.report_to`."""
    max_line_mb: float = 64.0
    """Trace lines of `data` longer than this are skipped unread (quarantined, named in a warning)."""
    server_records_only: bool = False
    """Mine `data`'s server records that joined no app span as episodes (an app that was not wrapped); by default
    they are another run's and are only counted (docs/mining.md)."""
    path: Path | None = field(default=None, init=False, repr=False)
    """The train.yaml this was read from (not a key)."""
    doc: YamlDoc | None = field(default=None, init=False, repr=False)
    """Its parsed YAML with line numbers (not a key)."""

    @property
    def base_dir(self) -> Path | None:
        return None if self.path is None else self.path.parent

    def _doc(self) -> YamlDoc:
        return self.doc if self.doc is not None else YamlDoc.of({}, self.path or "train.yaml")

    def _source(self, *key: Any) -> str:
        """`train.yaml:line` of a key, for messages built elsewhere (app loading, node_roles)."""
        doc = self._doc()
        line, _ = doc.line_of(key)
        return doc.source + (f":{line}" if line else "")

    def app_factory(self) -> Any:
        """`online.app` loaded (relative to train.yaml's folder); a bad spec is a `LoadError` naming the file."""
        return load_object(self.online.get("app", DEFAULT_APP), base_dir=self.base_dir, what="online.app",
                           source=self._source("online", "app"))

    def app_spec(self, cfg: Any = None) -> Any:
        """The team and the online phase's app as an `AppSpec` (`cfg`: the `MARFTConfig`, for its seed and the
        sampling of an ``f(llm)`` app's `TeamChatModel`)."""
        from marft_lg.graph.app_spec import AppSpec

        cfg = cfg if cfg is not None else self.config()
        return AppSpec(app=self.online.get("app", DEFAULT_APP), model=self.model, agents=list(self.agents),
                       registry=self.registry, versions=self.versions, seed=cfg.seed,
                       node_roles=self.online.get("node_roles"), recursion_limit=self.online.get("recursion_limit"),
                       resume=self.online.get("resume"),
                       chat_model={"max_tokens": int(self.online.get("max_tokens", cfg.max_new_tokens)),
                                   "temperature": float(self.online.get("temperature", cfg.temperature))},
                       base_dir=None if self.base_dir is None else str(self.base_dir),
                       source=self._source("online", "app"), what="online.app")

    def config(self) -> Any:
        """The `marft` section as a `MARFTConfig` (checked, errors name train.yaml's line)."""
        from marft_lg.training.config import MARFTConfig

        cfg = MARFTConfig.from_dict(self.marft, doc=self._doc().at("marft"))
        if self.report_to is not None:
            try:
                cfg.report_to = check_report_to(self.report_to)
            except ConfigError as exc:
                raise self._doc().locate(exc) from None
        return cfg

    def load_reward(self) -> Any:
        """The `reward` (a CompositeReward YAML path or an inline mapping) built; errors name the file and line."""
        from marft_lg.rewards.composite import CompositeReward
        from marft_lg.rewards.registry import relative_to

        if isinstance(self.reward, str):
            return CompositeReward.from_yaml(self.reward)
        with relative_to(self.base_dir):  # an inline reward's custom components load relative to train.yaml
            return CompositeReward.from_yaml(self.reward, doc=self._doc().at("reward"))

    def check_inputs(self) -> None:
        """The files the phases need exist (`ConfigNotFound` naming train.yaml's line otherwise)."""
        doc = self._doc()
        if "offline" in self.phases and not self.data:
            raise doc.error("phase offline needs data: <traces dir or parquet dataset dir>", ("phases",))
        if "warm_start" in self.phases and not self.data and not self.scenarios:
            raise doc.error("phase warm_start needs data (mined episodes) or scenarios (K fresh rollouts each)",
                            ("phases",))
        if "online" in self.phases and not self.scenarios:
            raise doc.error("phase online needs scenarios: <jsonl or parquet>", ("phases",))
        if isinstance(self.reward, str) and not Path(self.reward).is_file():
            raise doc.not_found(f"reward file {self.reward} does not exist", ("reward",))
        if isinstance(self.scenarios, str) and not Path(self.scenarios).exists():
            raise doc.not_found(f"scenario file {self.scenarios} does not exist", ("scenarios",))
        if isinstance(self.scenarios, dict) and not Path(self.scenarios["from_traces"]).exists():
            raise doc.not_found(f"{self.scenarios['from_traces']} does not exist", ("scenarios", "from_traces"))
        if self.data and self.reads_data and not glob.has_magic(self.data) and not Path(self.data).exists():
            raise doc.not_found(f"{self.data} does not exist (a traces dir/glob or a `marft-lg mine --out` dir)",
                                ("data",))

    @classmethod
    def load(cls, path: Path) -> TrainFile:
        doc = load_yaml(path, what="train config")
        data = doc.data if doc.data is not None else {}
        checked = check_fields(cls, data, doc, what="train.yaml", skip=("versions", "reward", "ray", "scenarios"))
        out = cls(**checked)
        out.path, out.doc = Path(path).resolve(), doc
        base = Path(path).parent
        for name in ("registry", "run_dir", "scenarios", "data"):
            value = getattr(out, name)
            if isinstance(value, str) and not Path(value).is_absolute():
                setattr(out, name, str(base / value))
        out._check_scenarios(doc, base)
        out._check_agents(doc)
        out._check_versions(doc)
        out._check_reward(doc, base)
        unknown = [p for p in out.phases if p not in PHASES]
        if unknown:
            raise doc.error(f"phases {unknown} unknown; use offline and/or online, e.g. phases: [offline, online]",
                            ("phases",))
        if not out.phases:
            raise doc.error("phases is empty; use offline and/or online", ("phases",))
        if not out.max_line_mb > 0:
            raise doc.error(f"must be > 0, got {out.max_line_mb}", ("max_line_mb",))
        out.phases = [p for p in PHASES if p in out.phases]  # always warm start, then offline, then online
        out._check_online(doc)
        try:
            out.warm_start_config()
        except ValueError as exc:
            key = str(exc).partition(":")[0].split(".")[-1].split(" ")[0]
            raise doc.error(str(exc), ("warm_start", key) if key in (out.warm_start or {}) else ("warm_start",)) from None
        cfg = out.config()  # the marft section, checked now (line numbers) rather than when training starts
        unknown = [r for r in cfg.train_agents or [] if r not in out.agents]
        if unknown:
            raise doc.error(f"train_agents names {unknown}, which are not among the agents {out.agents}; agents "
                            "outside the team (an external API) are frozen anyway", ("marft", "train_agents"))
        if out.ray is not None:
            from marft_lg.distributed.config import RayConfig

            out.ray = RayConfig.from_doc(doc.at("ray"))
        return out

    def _check_scenarios(self, doc: YamlDoc, base: Path) -> None:
        from marft_lg.trajectories.scenario_sets import check_scenario_source

        try:
            self.scenarios = check_scenario_source(self.scenarios)
        except ValueError as exc:
            key = str(exc).partition(":")[0].split(".")
            raise doc.error(str(exc).partition(": ")[2], tuple(key)) from None
        if isinstance(self.scenarios, dict):
            self.scenarios = {**self.scenarios, "from_traces": str(base / self.scenarios["from_traces"])}

    @property
    def reads_data(self) -> bool:
        """Whether a phase reads `data`: offline, or a warm start given data."""
        return bool(self.data) and ("offline" in self.phases or "warm_start" in self.phases)

    def warm_start_config(self) -> Any:
        """The `warm_start` section as a `WarmStartConfig` (a ValueError names a bad key)."""
        from marft_lg.training.warm_start import WarmStartConfig

        return WarmStartConfig.from_dict(self.warm_start)

    def load_scenarios(self) -> Any:
        """The `ScenarioSet` of `scenarios` (a file, or users' inputs from traces), None without any."""
        from marft_lg.trajectories.scenario_sets import load_scenarios

        return None if self.scenarios is None else load_scenarios(
            self.scenarios, max_line_bytes=int(self.max_line_mb * 2**20))

    def _check_agents(self, doc: YamlDoc) -> None:
        try:
            if isinstance(self.model, dict):
                self.agents = check_model_mapping(self.model, self.agents)
            if not self.agents:
                raise ConfigError("agents is empty; list the agent roles, e.g. agents: [reasoner, actor]", key="agents")
            check_roles(self.agents)
        except ConfigError as exc:
            raise doc.locate(exc) from None

    def _check_versions(self, doc: YamlDoc) -> None:
        v = self.versions
        if v is None or (isinstance(v, str) and v):
            return
        if isinstance(v, dict):
            for role, ref in v.items():
                if role not in self.agents:
                    raise doc.error(f"role {role!r} is not one of the agents {self.agents}", ("versions", role))
                if not isinstance(ref, str) or not ref:
                    raise doc.error(f"expected a version (e.g. v3) or an alias, got {type(ref).__name__} {ref!r}",
                                    ("versions", role))
            return
        raise doc.error("expected an alias name (e.g. live), a {role: version} mapping or null (fresh adapters), "
                        f"got {type(v).__name__} {v!r:.60}", ("versions",))

    def _check_reward(self, doc: YamlDoc, base: Path) -> None:
        from marft_lg.rewards.loading import parse_config

        if self.reward is None:
            raise doc.error("reward is missing; give a CompositeReward YAML path or mapping", ("reward",))
        if isinstance(self.reward, str):
            if not self.reward:
                raise doc.error("reward is empty; give a CompositeReward YAML path or mapping", ("reward",))
            if not Path(self.reward).is_absolute():
                self.reward = str(base / self.reward)
            return
        if not isinstance(self.reward, dict):
            raise doc.error(f"expected a reward YAML path or an inline mapping, got {type(self.reward).__name__} "
                            f"{self.reward!r:.60}", ("reward",))
        parse_config(self.reward, doc=doc.at("reward"))

    def _check_online(self, doc: YamlDoc) -> None:
        unknown = [k for k in self.online if k not in ONLINE_KEYS]
        if unknown:
            raise doc.error(f"unknown online key {unknown[0]!r}; known: {list(ONLINE_KEYS)}", ("online", unknown[0]))
        o = self.online
        types_ = {"app": str, "split": str | None, "iterations": int, "max_tokens": int, "temperature": float,
                  "recursion_limit": int | None}
        for key, tp in types_.items():
            if key in o:
                o[key] = convert(o[key], tp, doc, ("online", key))
        for key, low in (("iterations", 0), ("max_tokens", 1), ("recursion_limit", 1)):
            if o.get(key) is not None and o[key] < low:
                raise doc.error(f"must be >= {low}, got {o[key]}", ("online", key))
        if "temperature" in o and o["temperature"] < 0:
            raise doc.error(f"must be >= 0, got {o['temperature']}", ("online", "temperature"))
        if o.get("resume") is not None:
            from marft_lg.graph.interrupts import ResumePolicy

            try:
                ResumePolicy.of(o["resume"], "online.resume")
            except (TypeError, ValueError) as exc:
                raise doc.error(str(exc), ("online", "resume")) from None
        try:
            o["node_roles"] = parse_node_roles(o.get("node_roles"), source=self._source("online", "node_roles"),
                                               key="online.node_roles", roles=self.agents)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


def _load_dataset(spec: str, max_line_mb: float, server_records_only: bool = False) -> Any:
    """`data` as a dataset: a `marft-lg mine --out` folder read back, else its traces mined (lines over
    `max_line_mb` skipped unread, with a warning naming them)."""
    from marft_lg.trajectories.dataset import TrajectoryDataset

    p = Path(spec)
    if p.is_dir() and (p / "episodes.parquet").exists():
        return TrajectoryDataset.from_parquet(p)
    from marft_lg.trajectories.mining import mine_with_report

    dataset, report = mine_with_report([spec], max_line_bytes=int(max_line_mb * 2**20),
                                       server_records_only=server_records_only)
    note = report.long_lines_note("max_line_mb in train.yaml")
    if note:
        typer.echo(f"warning: data: {note}", err=True)
    if report.server_records_unjoined:
        typer.echo(f"warning: data: {report.server_records_unjoined} server record(s) joined no app span and were "
                   "left out (another run's); set server_records_only: true to mine an unwrapped app's", err=True)
    return dataset


def _no_usable_data(spec: str, dataset: Any) -> str | None:
    """Why the offline data cannot train anything (no episode with an action), naming what was read; None if it can.
    Without this check an empty folder "trains" on nothing and publishes the starting weights as `candidate`."""
    episodes, actions = len(dataset), len(dataset.actions)
    if episodes and actions:
        return None
    p = Path(spec)
    if p.is_dir() and (p / "episodes.parquet").exists():
        read = f"the dataset {spec}"
    else:
        from marft_lg.tracing.files import trace_files

        read = f"{len(trace_files([spec]))} trace file(s) under {spec}"
    return (f"data: no usable episodes in {read}: {episodes} episode(s), {actions} action(s) found; nothing trained, "
            "alias 'candidate' not set")


def _input_errors() -> tuple[type[BaseException], ...]:
    """What bad input (a config, a named file, a damaged run directory) raises: printed, exit 2, no traceback."""
    from marft_lg.training.checkpoint import CheckpointError
    from marft_lg.training.metrics import MetricsError
    from marft_lg.training.run_files import RunDirError

    return (ConfigError, LoadError, FileNotFoundError, CheckpointError, MetricsError, RunDirError, TrackingUnavailable)


def _fail(message: str, code: int = EXIT_BAD_INPUT) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def train(
    config: Path = typer.Option(..., "--config", "-c", exists=True, dir_okay=False, help="train.yaml"),
    resume: bool = typer.Option(False, "--resume", help="continue from the run directory's newest usable checkpoint"),
    overwrite: bool = typer.Option(False, "--overwrite",
                                   help="delete the run directory's run files (metrics, checkpoints, plots) first"),
    report_to: str | None = typer.Option(None, "--report-to", help="trackers, comma-separated: tensorboard, mlflow, "
                                         "wandb (offline) or none; overrides train.yaml's report_to"),
) -> None:
    """Train the team's adapters with MARFT (offline from traces and/or on-policy through the graph).

    Exit codes: 0 trained; 1 the offline data held no usable episode, an iteration had no action to train (no scored
    episode, no action of the trained agents, all failed the data checks), no adapter took a step, or the online
    phase's episodes failed (fewer than half succeeded, or they were not served by the adapters being trained),
    nothing published; 2 bad input (train.yaml, a file it names, a run
    directory that already holds another run, a damaged checkpoint or metrics file), printed without a traceback."""
    from rich.console import Console

    from marft_lg.serving.errors import ServingError
    from marft_lg.training.run_files import check_fresh_run_dir, clear_run_files

    console = Console(soft_wrap=True)
    errors = _input_errors()
    if resume and overwrite:
        raise _fail("--resume continues the run in run_dir and --overwrite deletes it; give one of them")
    try:
        spec = TrainFile.load(config)
        cfg = spec.config()
        if report_to is not None:
            cfg.report_to = parse_report_to(report_to)
        require_all(cfg.trackers())  # a missing tracker package stops here, one line naming its extra
        app = spec.app_spec(cfg)
        if "online" in spec.phases or ("warm_start" in spec.phases and not spec.data):
            app.check_app()  # a bad online.app fails before any work
        spec.check_inputs()
        reward = spec.load_reward()
        scenarios = spec.load_scenarios()
        if isinstance(spec.scenarios, dict):
            sides = {s: len(scenarios.split(s)) for s in ("train", "heldout")}
            console.print(f"scenarios: {len(scenarios)} users' inputs from {spec.scenarios['from_traces']} "
                          f"({sides['train']} train, {sides['heldout']} held out), no references")
        if not resume and not overwrite:
            check_fresh_run_dir(spec.run_dir)
        dataset = (_load_dataset(spec.data, spec.max_line_mb, spec.server_records_only)
                   if spec.reads_data else None)
    except errors as exc:
        raise _fail(str(exc)) from None
    except ValueError as exc:  # a scenario or dataset file that cannot be read
        raise _fail(str(exc)) from None
    if "online" in spec.phases or ("warm_start" in spec.phases and not spec.data):
        from marft_lg.rewards.requirements import reward_needs, uncomputable

        split = spec.online.get("split", "train")
        problems = uncomputable(reward, scenarios=list(scenarios.split(split) if split else scenarios), fresh=True,
                                resumes=app.resume_policy() is not None)
        if problems:
            raise _fail(f"{config}: reward: it can never be computed on the online phase's new episodes: "
                        + "; ".join(problems))
        policy = app.resume_policy()
        stand_in = [name for name, needs in reward_needs(reward).items() if "resume" in needs]
        if policy is not None and stand_in:
            who = (f"call {policy.call if isinstance(policy.call, str) else getattr(policy.call, '__name__', policy.call)}"
                   if policy.call is not None else f"the fixed value {policy.value!r}")
            console.print(f"online: {', '.join(stand_in)} scores what the resume policy answers at each interrupt "
                          f"({who}): a stand-in for the user, not a user", markup=False, highlight=False)
    if dataset is not None and isinstance(spec.scenarios, dict):  # production traffic: group a question's episodes
        from marft_lg.trajectories.scenario_sets import label_with_inputs

        dataset, labelled = label_with_inputs(dataset, spec.scenarios["input_keys"])
        if labelled:
            console.print(f"data: {labelled} episode(s) without a scenario grouped by their input "
                          f"({spec.scenarios['input_keys']})")
    empty = _no_usable_data(spec.data, dataset) if dataset is not None else None
    if empty:
        raise _fail(empty, code=EXIT_NO_DATA)
    if overwrite:
        removed = clear_run_files(spec.run_dir)
        if removed:
            console.print(f"--overwrite: deleted {', '.join(removed)} from {spec.run_dir}")
    try:
        team = app.build_team()
    except (OSError, ValueError, ServingError) as exc:
        raise _fail(f"{config}: cannot build the team: {exc}") from None
    try:
        _train(spec, cfg, app, team, reward, scenarios, dataset, resume, console, errors)
    finally:
        team.close()


def _ray_collector(spec: TrainFile, app: Any, cfg: Any, team: Any, run_id: str) -> Any:
    """The online phase's collector on Ray: every worker builds `online.app` and the team's engine itself and loads
    the versions the learner's `team` serves before each iteration (from the registry folder, which it shares)."""
    from marft_lg.distributed.rollout import RayCollector
    from marft_lg.distributed.worker import WorkerSpec

    worker = WorkerSpec.of(app, concurrency=cfg.rollout_concurrency, trace_dir=str(Path(spec.run_dir) / "traces"))
    return RayCollector(spec.ray, worker, versions=team.versions, run_id=run_id)


def _train(spec: TrainFile, cfg: Any, app: Any, team: Any, reward: Any, scenarios: Any, dataset: Any, resume: bool,
           console: Any, errors: tuple[type[BaseException], ...]) -> None:
    from marft_lg.graph.collect import RolloutError
    from marft_lg.tracking.lineage import data_window
    from marft_lg.training.checks import TrainingDataError
    from marft_lg.training.trainer import MARFTTrainer

    try:
        trainer = MARFTTrainer(team, reward, cfg, spec.run_dir)
    except ValueError as exc:  # e.g. a critic_base that names none of the team's bases
        raise _fail(f"{spec.path}: {exc}") from None
    if trainer.frozen_roles:
        console.print(f"frozen (served, never updated): {', '.join(trainer.frozen_roles)}; trained: "
                      f"{', '.join(trainer.roles)}")
    if resume:
        try:
            report = trainer.resume()
        except errors as exc:
            raise _fail(str(exc)) from None
        for line in report.lines():
            console.print(line, markup=False, highlight=False)
        if not report:
            console.print(f"[yellow]no checkpoint under {spec.run_dir}; starting from iteration 0[/]")
    status = "FAILED"
    try:
        try:
            if dataset is not None:
                trainer.tracker.context["data_window"] = data_window(dataset, spec.data)
            if "warm_start" in spec.phases:
                _warm_start(spec, cfg, app, team, trainer, dataset, scenarios, console)
            if dataset is not None and "offline" in spec.phases:
                console.print(f"offline: {len(dataset)} episodes, {len(dataset.actions)} actions from {spec.data}")
                _offline(spec, cfg, app, team, trainer, dataset, scenarios)
            if "online" in spec.phases:
                try:
                    _online(spec, cfg, app, team, trainer, scenarios, console)
                except RolloutError as exc:
                    raise _fail(f"the online phase stopped; alias 'candidate' not set: {exc}",
                                code=EXIT_ROLLOUTS) from None
        except TrainingDataError as exc:
            raise _fail(f"training stopped; alias 'candidate' not set: {exc}", code=EXIT_NO_DATA) from None
        _publish(spec, team, trainer, console, resumed=resume)
        status = "FINISHED"
    finally:
        trainer.close(status)


def _warm_start(spec: TrainFile, cfg: Any, app: Any, team: Any, trainer: Any, dataset: Any, scenarios: Any,
                console: Any) -> None:
    """The warm start on `data`, else on `group_size` fresh rollouts of each train scenario through `online.app`
    (skipped when a resumed run already did it)."""
    if trainer.warm_started:
        console.print("warm start: done before this resume")
        return
    if dataset is None:
        from marft_lg.graph.collect import GraphCollector

        chosen = list(scenarios.split(spec.online.get("split", "train")) or scenarios)
        with _traced_app(spec, app, team) as wrapped:
            collector = GraphCollector(wrapped, concurrency=cfg.rollout_concurrency, run_id=trainer.run_id)
            dataset = collector.collect(chosen, cfg.group_size, trainer.iteration, cfg.seed)
        where = f"{cfg.group_size} fresh rollouts of each of {len(chosen)} scenarios"
    else:
        where = str(spec.data)
    row = trainer.fit_warm_start(dataset, scenarios, spec.warm_start_config())
    if row is not None:
        trained = ", ".join(f"{a} ({v['actions']} actions, NLL {v['nll_first']:.3f} -> {v['nll_last']:.3f})"
                            for a, v in row["warm_start_agents"].items() if v["steps"])
        console.print(f"warm start: kept {row['kept_episodes']} of {row['episodes']} episodes from {where} "
                      f"(keep: {row['keep']}); trained {trained}", markup=False, highlight=False)


def _offline(spec: TrainFile, cfg: Any, app: Any, team: Any, trainer: Any, dataset: Any, scenarios: Any) -> None:
    """The offline phase; under ``credit: counterfactual`` the recorded episodes' steps are replayed through
    `online.app` (in this process, traced beside the online phase's episodes) from their scenarios' inputs. Without
    an `online.app` in train.yaml the trainer warns and uses the group baseline (the default app is the math team's,
    not the one that recorded the data)."""
    if cfg.credit != "counterfactual" or "app" not in spec.online:
        trainer.fit_offline(dataset, scenarios)
        return
    with _traced_app(spec, app, team) as wrapped:
        trainer.fit_offline(dataset, scenarios, replay_app=wrapped)


@contextmanager
def _traced_app(spec: TrainFile, app: Any, team: Any) -> Iterator[Any]:
    """`online.app` on `team`, traced into the run folder, for the length of a phase (closed after)."""
    wrapped = app.build_app(team, Path(spec.run_dir) / "traces")
    try:
        yield wrapped
    finally:
        wrapped.close()


def _online(spec: TrainFile, cfg: Any, app: Any, team: Any, trainer: Any, scenarios: Any, console: Any) -> None:
    opts = dict(spec.online)
    split = opts.get("split", "train")
    iterations = int(opts.get("iterations", 10))
    chosen = list(scenarios.split(split) if split else scenarios)
    if spec.ray is not None:
        with _ray_collector(spec, app, cfg, team, trainer.run_id) as collector:
            console.print(f"online: {spec.ray.rollout_workers} Ray rollout workers at {spec.ray.address}")
            trainer.fit_online(collector, chosen, iterations)
        return
    with _traced_app(spec, app, team) as wrapped:
        trainer.fit_online(wrapped, chosen, iterations)


def _published_before(spec: TrainFile, team: Any, trainer: Any) -> dict[str, str] | None:
    """What this run published when it already did (a `--resume` of a finished run): ``{role: version}`` when every
    role it would save has a version this run saved at this iteration, else None."""
    from marft_lg.serving.team import FRESH

    found, serving = {}, team.versions()
    for role in spec.agents:
        if role in trainer.unpublished:
            found[role] = team.registry.saved_by(team.slot(role), trainer.run_id, trainer.iteration)
            if found[role] is None:
                return None
        elif serving.get(role, FRESH) != FRESH:
            found[role] = serving[role]
    return found


def _publish(spec: TrainFile, team: Any, trainer: Any, console: Any, *, resumed: bool = False) -> None:
    """Save the trained roles as new versions and point `candidate` at them; say which roles were never updated. A
    resumed run that had published already publishes nothing new; a run's last checkpoint is its end."""
    from marft_lg.serving.team import FRESH
    from marft_lg.tracking.lineage import record_published

    if trainer.iteration and trainer.iteration % trainer.cfg.checkpoint_every:
        trainer.save_checkpoint()  # a resume starts from the end, never re-runs (and re-publishes) the last ones
    before = _published_before(spec, team, trainer) if resumed else None
    if before is not None:
        if team.registry.alias("candidate") != before:  # it died between saving and setting the alias
            team.registry.set_alias("candidate", before, reason=f"marft-lg train run {trainer.run_id}")
        console.print(f"run {trainer.run_id} in {spec.run_dir} had finished (iteration {trainer.iteration}) and "
                      f"published {before} as alias 'candidate'; nothing new to publish", markup=False,
                      highlight=False)
        return
    published = {}
    serving = team.versions()
    for role in spec.agents:  # a new version only for an adapter an update changed; the others keep theirs
        if role in trainer.unpublished:
            published[role] = team.save_version(role, run_id=trainer.run_id,
                                                metrics={"iteration": float(trainer.iteration)})
            record_published(trainer.tracker, team.registry, role, published[role], iteration=trainer.iteration)
        elif serving.get(role, FRESH) != FRESH:
            published[role] = serving[role]
    steps = trainer.update_steps
    updated = [r for r in trainer.roles if steps.get(r, 0) > 0]
    never = [r for r in trainer.roles if steps.get(r, 0) == 0]
    if not updated:
        raise _fail(f"trained {trainer.iteration} iterations but no role's adapter took an optimizer step (every "
                    "step cut by kl_cut or skipped as non-finite; see metrics.jsonl); alias 'candidate' not set",
                    code=EXIT_NO_DATA)
    team.registry.set_alias("candidate", published, reason=f"marft-lg train run {trainer.run_id}")
    console.print(f"[green]trained[/] {trainer.iteration} iterations; updated {', '.join(updated) or 'no role'}; "
                  f"adapters {published} saved as alias 'candidate' in {spec.registry}; metrics and plots in "
                  f"{spec.run_dir}")
    if never:
        why = (f"the {trainer.cfg.update_scheme} scheme trains one role per {trainer.cfg.agent_iteration_interval} "
               f"iteration(s) and {trainer.update_count} updates did not reach them, they had no actions, or kl_cut "
               "cut every step" if trainer.cfg.update_scheme == "sequential"
               else "they had no actions in the episodes, or kl_cut cut every step")
        kept = {r: serving.get(r, FRESH) for r in never}
        console.print(f"[yellow]warning: never updated: {', '.join(never)} ({why}); no new version saved for them, "
                      f"they keep {kept} ('{FRESH}': their initial weights, no version in the candidate)[/]")

