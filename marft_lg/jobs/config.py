"""`RetrainJob`: everything one scheduled retraining job needs, loaded from `job.yaml`.

Relative paths in the YAML are resolved against the YAML file's folder, so a job folder can be
moved (or mounted into a container) as a whole.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from marft_lg.loading import parse_node_roles

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
    model: str = "embedded:smollm2-135m-instruct"
    """Base model spec (`resolve_model`): the one model every adapter sits on."""
    agents: list[str] = field(default_factory=list)
    """Agent roles to train; empty = every role the registry's `live` alias names."""
    registry: str = "adapters"
    """AdapterRegistry root. Only the registry's atomic `live` alias flip ever changes what serves."""
    app: str | None = None
    """`module:function` or `file.py:function` returning the LangGraph app (compiled graph) used for shadow
    compare and online training; relative files and modules next to job.yaml load without PYTHONPATH."""
    node_roles: dict[str, str] | None = None
    """`{node: role}` for app nodes whose name is not their agent role (passed to `wrap(..., node_roles=)`)."""
    chat_model: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the app's `TeamChatModel` (e.g. `max_tokens`, `temperature`) in compare / online runs."""
    reward: str | dict[str, Any] = "reward.yaml"
    """CompositeReward config (path or inline mapping): scores mined episodes and shadow-compare episodes."""
    trainer: str | dict[str, Any] = "trainer.yaml"
    """MARFTConfig (path or inline mapping)."""
    online_iterations: int = 0
    """On-policy MARFT iterations after the offline phase (0 = offline only)."""
    scenarios: str = "scenarios.jsonl"
    """Frozen scenario set for the shadow comparison (and online training, split `train`)."""
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
    """Episodes ending in the last `settle_s` seconds are left for the next run (spans may still be in flight)."""
    initial_watermark: str | None = None
    """ISO time to start from on the very first run (None = all traces)."""
    advance_on_reject: bool = True
    """A rejected candidate still consumes its window (else the same episodes are retrained next run)."""
    output_dir: str = "retrain_runs"
    """One folder per run (`<output_dir>/<run_id>/`): mined data, trainer output, report, error log."""
    store: str | None = None
    """SQLite file for run records, watermark and scheduler state (default `<output_dir>/jobs.sqlite`)."""
    lock: str | None = None
    """Single-flight lock file (default `<output_dir>/<name>.lock`); put it on storage every runner shares."""
    lock_stale_after_s: float = 600.0
    """A lock held from another host counts as stale when its heartbeat is older than this."""
    stages: str = "marft_lg.jobs.stages:LibraryStages"
    """`module:Class` (or `file.py:Class`) implementing the pipeline stages (swap for custom mining/training/evaluation)."""
    config_path: str | None = field(default=None, init=False, repr=False, compare=False)
    """The job.yaml this job was read from (set by `from_yaml`; not a setting). Its folder is where `app`
    and `stages` are loaded from, and error messages name it."""

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

    def __post_init__(self) -> None:
        if isinstance(self.traces, str):
            self.traces = [self.traces]
        problems = []
        if self.min_new_episodes < 0:
            problems.append(f"min_new_episodes must be >= 0, got {self.min_new_episodes}")
        if self.settle_s < 0:
            problems.append(f"settle_s must be >= 0, got {self.settle_s}")
        if self.online_iterations < 0:
            problems.append(f"online_iterations must be >= 0, got {self.online_iterations}")
        if ":" not in self.stages:
            problems.append(f"stages must be 'module:Class' or 'file.py:Class', got {self.stages!r}")
        if self.app is not None and ":" not in self.app:
            problems.append(f"app must be 'module:function' or 'file.py:function', got {self.app!r}")
        try:
            self.node_roles = parse_node_roles(self.node_roles, key="node_roles", roles=self.agents or None)
        except ValueError as exc:
            problems.append(str(exc))
        if not self.name or any(c in self.name for c in "/\\ "):
            problems.append(f"name must be a non-empty word without slashes or spaces, got {self.name!r}")
        if problems:
            raise ValueError("invalid retrain job: " + "; ".join(problems))

    @classmethod
    def from_yaml(cls, path: str | Path) -> RetrainJob:
        """Load `job.yaml`; unknown keys and wrong types raise with the file and key named."""
        import yaml

        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"job file {p} does not exist")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ValueError(f"{p}: not valid YAML ({exc})") from exc
        if not isinstance(data, dict):
            raise ValueError(f"{p}: a job file must be a mapping of settings, got {type(data).__name__}")
        try:
            job = cls.from_dict(data, base_dir=p.resolve().parent)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{p}: {exc}") from exc
        job.config_path = str(p.resolve())
        return job

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, base_dir: str | Path | None = None) -> RetrainJob:
        """Build from a mapping; relative paths are taken relative to `base_dir` when given."""
        settings = [f for f in dataclasses.fields(cls) if f.init]
        known = {f.name for f in settings}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown job settings {unknown}; known: {sorted(known)}")
        for f in settings:
            if f.name in data and data[f.name] is not None:
                _check_type(f.name, data[f.name], f.type)
        values = dict(data)
        if base_dir is not None:
            for key in _PATH_FIELDS:
                value = values.get(key, _default(key))
                if value is not None:
                    values[key] = _resolve(value, Path(base_dir))
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The settings (what `from_dict` accepts)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}


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


_TYPES = {"str": str, "int": int, "float": (int, float), "bool": bool}


def _check_type(name: str, value: Any, annotation: str) -> None:
    ann = str(annotation)
    if ann.startswith("list"):
        if not isinstance(value, list | str):
            raise TypeError(f"setting {name!r} must be a list, got {type(value).__name__}")
        return
    options = [a.strip() for a in ann.split("|")]
    if ann.startswith("dict") or ("dict[str, Any]" in options and isinstance(value, dict)):
        if not isinstance(value, dict):
            raise TypeError(f"setting {name!r} must be a mapping, got {type(value).__name__}")
        return
    for opt in options:
        t = _TYPES.get(opt)
        if t is not None and isinstance(value, t) and not (opt in ("int", "float") and isinstance(value, bool)):
            return
    raise TypeError(f"setting {name!r} must be {ann}, got {type(value).__name__} {value!r}")
