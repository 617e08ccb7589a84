"""`RetrainJob`: everything one scheduled retraining job needs, loaded from `job.yaml`.

Relative paths in the YAML are resolved against the YAML file's folder, so a job folder can be
moved (or mounted into a container) as a whole.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import date, datetime
from pathlib import Path
from typing import Any

from marft_lg._config import ConfigError, YamlDoc, check_fields, check_int, check_range, load_yaml
from marft_lg.loading import check_model_mapping, check_roles, parse_node_roles
from marft_lg.tracking.settings import check_report_to

_PATH_FIELDS = ("traces", "registry", "reward", "trainer", "scenarios", "gate", "output_dir", "store", "lock")


@dataclass
class RetrainJob:
    """One retraining job: where traces come from, what to train, how to judge, when to run.

    Reward / trainer / gate may each be a path to their own YAML or an inline mapping; they are
    handed unchanged to `CompositeReward.from_yaml`, `MARFTConfig.from_yaml`, `PromotionGate.from_yaml`.
    """

    name: str = "retrain"
    """Job id: keys the watermark, the run records and the scheduler entry."""
    traces: list[str] = field(default_factory=lambda: ["traces"])
    """Trace sources: OTLP/JSON-lines files, folders of `*.jsonl`, or glob patterns."""
    model: str | dict[str, str] = "embedded:smollm2-135m-instruct"
    """Base model spec (`resolve_model`): the one model every adapter sits on; or ``{role: model spec}`` for a
    team of several base models (then `agents` may be omitted, or must name the same roles)."""
    agents: list[str] = field(default_factory=list)
    """Agent roles to train; empty = every role the registry's `live` alias names (the `model` mapping's roles
    when `model` is a mapping)."""
    registry: str = "adapters"
    """AdapterRegistry root. Only the registry's atomic `live` alias flip ever changes what serves."""
    app: str | None = None
    """`module:function` or `file.py:function` returning the LangGraph app (compiled graph) used for shadow
    compare and online training; relative files and modules next to job.yaml load without PYTHONPATH."""
    node_roles: dict[str, str] | None = None
    """`{node: role}` for app nodes whose name is not their agent role (passed to `wrap(..., node_roles=)`)."""
    chat_model: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the app's `TeamChatModel` (e.g. `max_tokens`, `temperature`) in compare / online runs."""
    recursion_limit: int | None = None
    """LangGraph step limit of each compare / online episode (None: LangGraph's own); one stopped there is truncated."""
    resume: dict[str, Any] | None = None
    """How compare / online episodes answer the app's `interrupt()`: ``{value: ...}`` or ``{call: module:function}``
    (a simulated user, relative to job.yaml), optionally ``max_resumes``; None: such episodes stay paused (an error)."""
    reward: str | dict[str, Any] = "reward.yaml"
    """CompositeReward config (path or inline mapping): scores mined episodes and shadow-compare episodes."""
    trainer: str | dict[str, Any] = "trainer.yaml"
    """MARFTConfig (path or inline mapping)."""
    online_iterations: int = 0
    """On-policy MARFT iterations after the offline phase (0 = offline only)."""
    scenarios: str | dict[str, Any] = "scenarios.jsonl"
    """Frozen scenario set for the shadow comparison (and online training, split `train`), or the users' own inputs:
    ``{from_traces: DIR, input_keys: [...], heldout: 0.2}`` (split by hash into `train` and `heldout`; no
    references: score with a judge or the users' feedback)."""
    compare_split: str | None = "heldout"
    """Scenario split the shadow comparison uses (None = all scenarios)."""
    samples_per_scenario: int = 1
    """Paired replays per scenario in the shadow comparison."""
    seed: int = 0
    """Seed of the Team and of the paired comparison runs."""
    gate: str | dict[str, Any] = "gate.yaml"
    """PromotionGate (path or inline mapping): the candidate goes live only if every check passes."""
    server_url: str | None = None
    """A running `marft-lg serve` / vLLM server to hot-swap to the promoted adapters (None = registry only)."""
    schedule: str = "0 2 * * *"
    """Cron expression (5 fields: min hour dom month dow; a 6th leading field is seconds)."""
    timezone: str = "UTC"
    """Time zone the cron expression is read in."""
    misfire_grace_s: int = 3600
    """A run missed while the scheduler was down still starts if it is at most this late (coalesced to one)."""
    min_new_episodes: int = 20
    """Fewer new episodes than this: the run is skipped and the watermark stays, so they accumulate."""
    settle_s: float = 60.0
    max_line_mb: float = 64.0
    """Trace lines longer than this are skipped unread when mining (quarantined with their file:line)."""
    """Episodes ending in the last `settle_s` seconds are left for the next run (spans may still be in flight)."""
    initial_watermark: str | None = None
    """ISO time to start from on the very first run (None = all traces)."""
    advance_on_reject: bool = True
    """A rejected candidate still consumes its window (else the same episodes are retrained next run)."""
    server_records_only: bool = False
    """Mine server records that joined no app span as episodes (an app that was not wrapped); else they are left out."""
    unsettled_wait_s: float = 600.0
    """How long past the window's end an episode still waiting for a server record of a call holds the watermark back
    (later it is taken as it is)."""
    output_dir: str = "retrain_runs"
    """One folder per run (`<output_dir>/<run_id>/`): mined data, trainer output, report, error log."""
    store: str | None = None
    """SQLite file for run records, watermark and scheduler state (default `<output_dir>/jobs.sqlite`)."""
    lock: str | None = None
    """Single-flight lock file (default `<output_dir>/<name>.lock`); put it on storage every runner shares."""
    lock_stale_after_s: float = 600.0
    """A lock held from another host counts as stale when its heartbeat is older than this."""
    ray: Any = None
    """The `ray:` section (as in train.yaml): online training and the comparison's replays run on Ray rollout
    workers (docs/distributed.md). None: everything in the job's process."""
    report_to: list[str] = field(default_factory=list)
    """Trackers of each run (tensorboard, mlflow, wandb offline, none): one parent run per retraining run, with the
    train and compare stages as its children (docs/tracking.md)."""
    tracking_uri: str | None = None
    """MLflow tracking URI; None: one SQLite store for all the job's runs, `<output_dir>/mlflow.db`."""
    experiment: str | None = None
    """MLflow experiment / W&B project; None: `marft-lg`."""
    stages: str = "marft_lg.jobs.stages:LibraryStages"
    """`module:Class` (or `file.py:Class`) implementing the pipeline stages (swap for custom mining/training/evaluation)."""
    config_path: str | None = field(default=None, init=False, repr=False, compare=False)
    """The job.yaml this job was read from (set by `from_yaml`; not a setting). Its folder is where `app`
    and `stages` are loaded from, and error messages name it."""

    config_doc: YamlDoc | None = field(default=None, init=False, repr=False, compare=False)
    """job.yaml parsed with line numbers (set by `from_yaml`), for error messages that name a key's line."""

    @property
    def base_dir(self) -> Path | None:
        """The job file's folder (None for a job built in Python)."""
        return Path(self.config_path).parent if self.config_path else None

    @property
    def store_path(self) -> Path:
        return Path(self.store) if self.store else Path(self.output_dir) / "jobs.sqlite"

    @property
    def lock_path(self) -> Path:
        return Path(self.lock) if self.lock else Path(self.output_dir) / f"{self.name}.lock"

    def where(self, key: str) -> str | None:
        """``job.yaml:line`` of a setting (for messages about its value), or the job file, or None."""
        if self.config_doc is None:
            return self.config_path
        line, _ = self.config_doc.line_of((key,))
        return f"{self.config_path}:{line}" if line else self.config_path

    def error(self, problem: str, key: str) -> ConfigError:
        """A `ConfigError` about setting `key`, naming job.yaml and its line when known."""
        if self.config_doc is None:
            return ConfigError(problem, path=self.config_path, key=key)
        line, _ = self.config_doc.line_of((key,))
        return ConfigError(problem, path=self.config_path, line=line, key=key)

    def __post_init__(self) -> None:
        """Check values and ranges; a bad one raises `ConfigError` naming the setting."""
        if isinstance(self.traces, str):
            self.traces = [self.traces]
        if not isinstance(self.name, str) or not self.name or any(c in self.name for c in "/\\ "):
            raise ConfigError(f"must be a non-empty word without slashes or spaces, got {self.name!r}", key="name")
        check_int("min_new_episodes", self.min_new_episodes, low=0)
        check_int("online_iterations", self.online_iterations, low=0)
        check_int("samples_per_scenario", self.samples_per_scenario, low=1)
        check_int("misfire_grace_s", self.misfire_grace_s, low=0)
        check_int("seed", self.seed, low=0)
        check_int("recursion_limit", self.recursion_limit, low=1, allow_none=True)
        from marft_lg.trajectories.scenario_sets import check_scenario_source

        try:
            check_scenario_source(self.scenarios)
        except ValueError as exc:
            raise ConfigError(str(exc).partition(": ")[2], key="scenarios") from None
        if self.resume is not None:
            from marft_lg.graph.interrupts import ResumePolicy

            try:
                ResumePolicy.of(self.resume, "resume")
            except (TypeError, ValueError) as exc:
                raise ConfigError(str(exc), key="resume") from None
        check_range("settle_s", self.settle_s, low=0.0)
        check_range("unsettled_wait_s", self.unsettled_wait_s, low=0.0)
        check_range("max_line_mb", self.max_line_mb, low=0.0, low_open=True)
        check_range("lock_stale_after_s", self.lock_stale_after_s, low=0.0, low_open=True)
        self.report_to = check_report_to(self.report_to)
        if not isinstance(self.stages, str) or ":" not in self.stages:
            raise ConfigError(f"must be 'module:Class' or 'file.py:Class', got {self.stages!r}", key="stages")
        if self.app is not None and (not isinstance(self.app, str) or ":" not in self.app):
            raise ConfigError(f"must be 'module:function' or 'file.py:function', got {self.app!r}", key="app")
        if not self.traces:
            raise ConfigError("is empty; list the trace files, folders or globs", key="traces")
        self._check_model()
        try:
            self.node_roles = parse_node_roles(self.node_roles, key="node_roles", roles=self.agents or None)
        except ValueError as exc:
            raise ConfigError(str(exc).removeprefix("node_roles").lstrip(": "), key="node_roles") from None
        if self.initial_watermark is not None:
            try:
                datetime.fromisoformat(str(self.initial_watermark))
            except (TypeError, ValueError):
                raise ConfigError(f"not an ISO time such as 2026-01-31T00:00:00Z: {self.initial_watermark!r}",
                                  key="initial_watermark") from None
        try:
            import zoneinfo

            zoneinfo.ZoneInfo(self.timezone)
        except (ValueError, KeyError, zoneinfo.ZoneInfoNotFoundError):
            raise ConfigError(f"unknown time zone {self.timezone!r} (an IANA name such as UTC or Europe/Paris)",
                              key="timezone") from None

    def _check_model(self) -> None:
        """`model` as a ``{role: model spec}`` mapping (`loading.check_model_mapping`), and the agents' names."""
        if isinstance(self.model, dict):
            self.agents = check_model_mapping(self.model, self.agents)
        check_roles(self.agents)

    @classmethod
    def from_yaml(cls, path: str | Path) -> RetrainJob:
        """Load `job.yaml`; unknown keys, wrong types and values raise `ConfigError` naming job.yaml:line: key
        (a missing file: `ConfigNotFound`, also a FileNotFoundError)."""
        p = Path(path)
        doc = load_yaml(p, what="job file")
        if doc.data is not None and not isinstance(doc.data, dict):
            raise doc.error(f"a job file must be a mapping of settings, got {type(doc.data).__name__}")
        job = cls.from_dict(doc.data or {}, base_dir=p.resolve().parent, doc=doc)
        job.config_path = str(p.resolve())
        job.config_doc = doc
        return job

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, base_dir: str | Path | None = None,
                  doc: YamlDoc | None = None) -> RetrainJob:
        """Build from a mapping; relative paths are taken relative to `base_dir` when given. Inline `reward`,
        `trainer` and `gate` mappings are checked too (their own loaders, with line numbers)."""
        doc = doc if doc is not None else YamlDoc.of(data, "<job>")
        if not isinstance(data, dict):
            raise doc.error(f"a job must be a mapping of settings, got {type(data).__name__}")
        data = {k: (v.isoformat() if isinstance(v, date) else v) for k, v in data.items()}  # YAML reads bare times
        values = check_fields(cls, data, doc, what="job", skip=("ray",))
        _check_inline(values, doc)
        if values.get("ray") is not None:
            from marft_lg.distributed.config import RayConfig

            values["ray"] = RayConfig.from_doc(doc.at("ray"))
        if base_dir is not None:
            for key in _PATH_FIELDS:
                value = values.get(key, _default(key))
                if value is not None:
                    values[key] = _resolve(value, Path(base_dir))
            if isinstance(values.get("scenarios"), dict) and isinstance(values["scenarios"].get("from_traces"), str):
                values["scenarios"] = {**values["scenarios"],
                                       "from_traces": _resolve(values["scenarios"]["from_traces"], Path(base_dir))}
        try:
            return cls(**values)
        except ConfigError as exc:
            raise doc.locate(exc) from None

    def to_dict(self) -> dict[str, Any]:
        """The settings (what `from_dict` accepts)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}


def _check_inline(values: dict[str, Any], doc: YamlDoc) -> None:
    """Inline reward / trainer / gate mappings are checked when the job loads (not when a run reaches them)."""
    if isinstance(values.get("reward"), dict):
        from marft_lg.rewards.loading import parse_config

        parse_config(values["reward"], doc=doc.at("reward"))
    if isinstance(values.get("trainer"), dict):
        from marft_lg.training.config import MARFTConfig

        MARFTConfig.from_dict(values["trainer"], doc=doc.at("trainer"))
    if isinstance(values.get("gate"), dict):
        from marft_lg.evaluation.gate import PromotionGate

        PromotionGate.from_dict(values["gate"], doc=doc.at("gate"))


def _default(name: str) -> Any:
    f = next(f for f in dataclasses.fields(RetrainJob) if f.name == name)
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _resolve(value: Any, base: Path) -> Any:
    if isinstance(value, dict):
        return value
    if isinstance(value, list):
        return [_resolve(v, base) for v in value]
    p = Path(str(value)).expanduser()
    return str(p if p.is_absolute() else base / p)
