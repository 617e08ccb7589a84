"""MLflow: a run per training run or stage (children by `mlflow.parentRunId`), through `MlflowClient` only (no
global active run, so threads and nested runs never mix).

Where runs go, as TRL and transformers decide it: an explicit setting (`uri`, `experiment`) wins, then MLflow's own
environment variables ``MLFLOW_TRACKING_URI`` and ``MLFLOW_EXPERIMENT_NAME`` (a team's tracking server), then the
defaults. With no tracking URI the store is ``sqlite:///<run_dir>/mlflow.db`` with artifacts in ``<run_dir>/mlartifacts``:
``mlflow ui --backend-store-uri sqlite:///<run_dir>/mlflow.db`` opens it (runs, metrics, artifacts and the model
registry: SQLite is a store MLflow's model registry works on).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from marft_lg.tracking.base import flat_params

DEFAULT_EXPERIMENT = "marft-lg"
_BATCH = 100  # MLflow's most params / metrics per log_batch call
_PARAM_CHARS = 6000  # MLflow's longest param value
_BAD_KEY = re.compile(r"[^\w\-. :/]")


def _key(name: str) -> str:
    """A param or metric name MLflow accepts (alphanumerics, ``_ - . space : /``; anything else becomes ``_``)."""
    return _BAD_KEY.sub("_", name)[:250]


def default_uri(run_dir: Path) -> str:
    """The local store of a run folder: ``sqlite:///<run_dir>/mlflow.db``."""
    return f"sqlite:///{(Path(run_dir) / 'mlflow.db').resolve()}"


def tracking_uri(explicit: str | None, run_dir: Path) -> str:
    """The explicit URI, else ``MLFLOW_TRACKING_URI``, else the run folder's own store."""
    return explicit or os.environ.get("MLFLOW_TRACKING_URI") or default_uri(run_dir)


def experiment_name(explicit: str | None = None) -> str:
    """The explicit experiment, else ``MLFLOW_EXPERIMENT_NAME``, else ``marft-lg``."""
    return explicit or os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT


def client_for(uri: str) -> Any:
    """An `MlflowClient` on `uri` for both tracking and the model registry."""
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def experiment_id(client: Any, name: str, artifacts: Path | None) -> str:
    """The experiment `name`, created (artifacts under `artifacts` for a local store) when missing."""
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    location = None if artifacts is None else artifacts.resolve().as_uri()
    return client.create_experiment(name, artifact_location=location)


class MlflowTracker:
    """One MLflow run (`Tracker`)."""

    def __init__(self, client: Any, uri: str, experiment: str, run_id: str):
        self.client, self.uri, self.experiment, self.run_id = client, uri, experiment, run_id
        self.context: dict[str, Any] = {}
        self._finished = False

    @classmethod
    def start(cls, run_dir: Path, *, name: str, params: Mapping[str, Any], uri: str | None, experiment: str | None,
              tags: Mapping[str, str], parent: MlflowTracker | None = None) -> MlflowTracker:
        """A new run in `uri` (default: the run folder's SQLite store), a child of `parent` when given."""
        if parent is not None:
            client, uri, experiment = parent.client, parent.uri, parent.experiment
        else:
            uri = tracking_uri(uri, run_dir)
            experiment = experiment_name(experiment)
            client = client_for(uri)
        local = uri.startswith("sqlite:") or uri.startswith("file:") or "://" not in uri
        exp = experiment_id(client, experiment, Path(run_dir) / "mlartifacts" if local and parent is None else None)
        all_tags = {"marft.run_dir": str(Path(run_dir).resolve()), **tags}
        if parent is not None:
            all_tags["mlflow.parentRunId"] = parent.run_id
        run = client.create_run(exp, run_name=name, tags=all_tags)
        out = cls(client, uri, experiment, run.info.run_id)
        out.log_params(params)
        return out

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Config values as MLflow params (nested keys dotted, long values cut to MLflow's limit)."""
        from mlflow.entities import Param

        items = [Param(_key(k), v[:_PARAM_CHARS]) for k, v in flat_params(params).items()]
        for i in range(0, len(items), _BATCH):
            self.client.log_batch(self.run_id, params=items[i:i + _BATCH])

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """One step's metrics in batches."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(_key(k), float(v), now, int(step)) for k, v in metrics.items()]
        for i in range(0, len(items), _BATCH):
            self.client.log_batch(self.run_id, metrics=items[i:i + _BATCH])

    def log_file(self, path: Path, folder: str = "") -> None:
        """A file (plot, report, decision) as an artifact under `folder`."""
        self.client.log_artifact(self.run_id, str(path), folder or None)

    def log_text(self, text: str, name: str) -> None:
        """Text as an artifact file `name`."""
        self.client.log_text(self.run_id, text, name)

    def log_adapter(self, lineage: Mapping[str, Any], path: Path) -> None:
        """The version's files under ``adapters/<role>/<version>``, its lineage as JSON and tags; the registry
        remembers this store so promotions and rollbacks keep MLflow's model registry in step."""
        from marft_lg.tracking.lineage import remember_store

        role, version = lineage["role"], lineage["version"]
        where = f"adapters/{role}/{version}"
        self.client.log_artifacts(self.run_id, str(path), where)
        self.client.log_text(self.run_id, json.dumps(dict(lineage), indent=2, default=str),
                             f"lineage/{role}-{version}.json")
        self.client.set_tag(self.run_id, f"marft.adapter.{role}", version)
        artifact = f"{self.client.get_run(self.run_id).info.artifact_uri}/{where}"
        remember_store(lineage["registry"], self.uri, role, version, {"run_id": self.run_id, "source": artifact})

    def child(self, name: str, run_dir: Path, params: Mapping[str, Any] | None = None) -> MlflowTracker:
        """A nested run in the same store and experiment."""
        return MlflowTracker.start(run_dir, name=name, params=params or {}, uri=None, experiment=None, tags={},
                                   parent=self)

    def finish(self, status: str = "FINISHED") -> None:
        """Close the run (FINISHED, FAILED or KILLED) once."""
        if not self._finished:
            self._finished = True
            self.client.set_terminated(self.run_id, status=status)
