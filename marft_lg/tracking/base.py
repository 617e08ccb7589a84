"""The `Tracker` protocol a run logs through, and `open_tracker`, which builds one from `report_to`.

A tracker is best effort: training must never stop because a tracker failed. `open_tracker` wraps each backend in
a guard that logs one warning for its first error and keeps the run going (as the OTLP exporters do); only a
missing package stops a run, before any work, with one line naming the pip extra.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from marft_lg.tracking.settings import require

log = logging.getLogger("marft_lg.tracking")


@runtime_checkable
class Tracker(Protocol):
    """One run in one or several trackers: params, per-step metrics, files (plots, reports), adapter lineage,
    child runs (a retraining job's train and compare stages)."""

    context: dict[str, Any]
    """What later records of this run inherit (e.g. `data_window`, the episodes a trainer learnt from)."""

    def log_params(self, params: Mapping[str, Any]) -> None: ...

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...

    def log_file(self, path: Path, folder: str = "") -> None: ...

    def log_text(self, text: str, name: str) -> None: ...

    def log_adapter(self, lineage: Mapping[str, Any], path: Path) -> None: ...

    def child(self, name: str, run_dir: Path, params: Mapping[str, Any] | None = None) -> Tracker: ...

    def finish(self, status: str = "FINISHED") -> None: ...


class NullTracker:
    """`report_to: none`: every call does nothing (children too)."""

    def __init__(self, context: dict[str, Any] | None = None):
        self.context: dict[str, Any] = dict(context or {})

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Nothing to log to."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Nothing to log to."""

    def log_file(self, path: Path, folder: str = "") -> None:
        """Nothing to log to."""

    def log_text(self, text: str, name: str) -> None:
        """Nothing to log to."""

    def log_adapter(self, lineage: Mapping[str, Any], path: Path) -> None:
        """Nothing to log to."""

    def child(self, name: str, run_dir: Path, params: Mapping[str, Any] | None = None) -> Tracker:
        """Another tracker that does nothing, inheriting the context."""
        return NullTracker(self.context)

    def finish(self, status: str = "FINISHED") -> None:
        """Nothing to close."""


class Guarded:
    """One backend behind a guard: its first error is logged as one warning, later ones at debug level, and the
    run goes on; `name` says which tracker failed."""

    def __init__(self, backend: Any, name: str):
        self.backend, self.name = backend, name
        self.context: dict[str, Any] = {}
        self._warned = False

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:  # a tracker must never stop training
            if not self._warned:
                self._warned = True
                log.warning("tracker %s failed to %s (%s: %s); training goes on, further %s errors are logged at "
                            "debug level", self.name, what, type(exc).__name__, exc, self.name)
            else:
                log.debug("tracker %s failed to %s: %s", self.name, what, exc)
            return None

    def log_params(self, params: Mapping[str, Any]) -> None:
        """The backend's `log_params`, guarded."""
        self._call("log params", self.backend.log_params, params)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """The backend's `log_metrics`, guarded."""
        self._call("log metrics", self.backend.log_metrics, metrics, step)

    def log_file(self, path: Path, folder: str = "") -> None:
        """The backend's `log_file`, guarded."""
        self._call(f"log {path}", self.backend.log_file, path, folder)

    def log_text(self, text: str, name: str) -> None:
        """The backend's `log_text`, guarded."""
        self._call(f"log {name}", self.backend.log_text, text, name)

    def log_adapter(self, lineage: Mapping[str, Any], path: Path) -> None:
        """The backend's `log_adapter`, guarded."""
        self._call(f"log adapter {lineage.get('role')}@{lineage.get('version')}", self.backend.log_adapter,
                   lineage, path)

    def child(self, name: str, run_dir: Path, params: Mapping[str, Any] | None = None) -> Tracker:
        """A guarded child run; a backend that cannot start one leaves a tracker that does nothing."""
        made = self._call(f"start child run {name}", self.backend.child, name, run_dir, params)
        return NullTracker(self.context) if made is None else Guarded(made, self.name)

    def finish(self, status: str = "FINISHED") -> None:
        """The backend's `finish`, guarded."""
        self._call("finish the run", self.backend.finish, status)


class Fanout:
    """Several trackers as one: every call goes to each (`report_to: [mlflow, tensorboard]`)."""

    def __init__(self, trackers: list[Tracker], context: dict[str, Any] | None = None):
        self.trackers = trackers
        self.context: dict[str, Any] = dict(context or {})
        for t in trackers:
            t.context = self.context  # one shared context

    def log_params(self, params: Mapping[str, Any]) -> None:
        """To every tracker."""
        for t in self.trackers:
            t.log_params(params)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """To every tracker."""
        for t in self.trackers:
            t.log_metrics(metrics, step)

    def log_file(self, path: Path, folder: str = "") -> None:
        """To every tracker."""
        for t in self.trackers:
            t.log_file(path, folder)

    def log_text(self, text: str, name: str) -> None:
        """To every tracker."""
        for t in self.trackers:
            t.log_text(text, name)

    def log_adapter(self, lineage: Mapping[str, Any], path: Path) -> None:
        """To every tracker."""
        for t in self.trackers:
            t.log_adapter(lineage, path)

    def child(self, name: str, run_dir: Path, params: Mapping[str, Any] | None = None) -> Tracker:
        """A child run in every tracker, inheriting the context."""
        return Fanout([t.child(name, run_dir, params) for t in self.trackers], dict(self.context))

    def finish(self, status: str = "FINISHED") -> None:
        """Close every tracker's run."""
        for t in self.trackers:
            t.finish(status)


def _backend(name: str, run_dir: Path, *, run_name: str, params: Mapping[str, Any], uri: str | None,
             experiment: str | None, tags: Mapping[str, str]) -> Any:
    """Start one backend's run (its package imported only now)."""
    require(name)
    if name == "tensorboard":
        from marft_lg.tracking.tensorboard_backend import TensorBoardTracker as cls
    elif name == "mlflow":
        from marft_lg.tracking.mlflow_backend import MlflowTracker as cls
    else:
        from marft_lg.tracking.wandb_backend import WandbTracker as cls
    return cls.start(run_dir, name=run_name, params=params, uri=uri, experiment=experiment, tags=tags)


def open_tracker(report_to: list[str], run_dir: str | Path, *, name: str, params: Mapping[str, Any] | None = None,
                 uri: str | None = None, experiment: str | None = None, tags: Mapping[str, str] | None = None,
                 context: dict[str, Any] | None = None) -> Tracker:
    """A run named `name` in every tracker of `report_to` (a `NullTracker` for none), its files under `run_dir`.

    `uri`: the MLflow tracking URI (default: ``sqlite:///<run_dir>/mlflow.db``, artifacts beside it);
    `experiment`: the MLflow experiment / W&B project (default ``marft-lg``). A missing package raises
    `TrackingUnavailable`; a backend that fails to start is warned about and left out.
    """
    if not report_to:
        return NullTracker(context)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    trackers: list[Tracker] = []
    for backend in report_to:
        require(backend)
        try:
            started = _backend(backend, run_dir, run_name=name, params=params or {}, uri=uri, experiment=experiment,
                               tags=tags or {})
        except Exception as exc:  # a tracker that cannot start must not stop training either
            log.warning("tracker %s could not start (%s: %s); training goes on without it", backend,
                        type(exc).__name__, exc)
            continue
        trackers.append(Guarded(started, backend))
    return Fanout(trackers, context)


def flat_metrics(row: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The finite numbers of a metrics row, nested keys joined by ``/`` (``agents/actor/approx_kl``,
    ``components/outcome``); text, lists and booleans are left out."""
    out: dict[str, float] = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flat_metrics(value, name + "/"))
        elif isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            out[name] = float(value)
    return out


def flat_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Config values as text parameters, nested keys joined by ``.`` (lists as JSON)."""
    out: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flat_params(value, name + "."))
        else:
            out[name] = value if isinstance(value, str) else json.dumps(value, default=str)
    return out
