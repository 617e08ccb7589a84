"""One rollout worker: a Ray actor that owns an engine and the user's app, loads adapter versions by name, and runs
its share of an iteration's episodes. Plain Python: `ray.remote(RolloutWorker)` makes it an actor; a test or a
single machine can call it directly."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from marft_lg.graph.app_spec import AppSpec
from marft_lg.graph.collect import EpisodeFailure, EpisodeJob, GraphCollector
from marft_lg.trajectories.dataset import TrajectoryDataset

AdapterFiles = dict[str, bytes]  # file name -> content of one registry version's folder


@dataclass
class WorkerSpec:
    """How every rollout worker builds its engine and app: the same `module:attr` factory the config names.

    `registry` is the adapter registry's folder. With `shared_registry` the workers read versions from it (a shared
    filesystem); without, the driver sends each version's files through the object store and a worker keeps its
    own copy. `engine` (a `module:attr` factory taking the worker's `AppSpec`) replaces the embedded `Team`, e.g.
    with a client of a vLLM server or a fake for tests. `WorkerSpec.of(app_spec)` makes one from the `AppSpec` every
    config produces.
    """

    app: str
    agents: list[str]
    model: str | dict[str, str] = "embedded:smollm2-135m-instruct"
    """The base model spec, or ``{role: model spec}`` for a team of several base models (a `MixedTeam`)."""
    registry: str | None = None
    shared_registry: bool = True
    versions: Any = None
    seed: int = 0
    base_dir: str | None = None
    node_roles: dict[str, str] | None = None
    recursion_limit: int | None = None
    resume: Any = None
    """The app's resume policy as its config gives it (`AppSpec.resume`): workers load its function themselves."""
    max_tokens: int = 64
    temperature: float = 1.0
    concurrency: int = 8
    trace_dir: str | None = None
    engine: str | None = None
    serving: str = "hf"
    """The `Team` engine: `hf` (embedded transformers) or `vllm` (a vLLM server the worker starts)."""
    engine_options: dict[str, Any] = field(default_factory=dict)
    chat_model: dict[str, Any] = field(default_factory=dict)
    """More keyword arguments of an ``f(llm)`` app's `TeamChatModel` (they win over `max_tokens`/`temperature`)."""

    @classmethod
    def of(cls, app: AppSpec, **worker: Any) -> WorkerSpec:
        """The workers' spec for an `AppSpec` (whose `app` must be a ``module:attr`` / ``file.py:attr`` string: the
        workers load it themselves), plus worker settings (`trace_dir`, `concurrency`, `shared_registry`)."""
        if not isinstance(app.app, str):
            raise TypeError("Ray rollout workers load the app themselves: give it as module:attr or file.py:attr")
        custom = app.engine not in ("hf", "vllm")
        fields = dict(app=app.app, agents=list(app.agents), model=app.model, registry=app.registry,
                      versions=app.versions, seed=app.seed, base_dir=app.base_dir, node_roles=app.node_roles,
                      recursion_limit=app.recursion_limit, resume=app.resume,
                      engine=app.engine if custom else None, serving="hf" if custom else app.engine,
                      engine_options=dict(app.engine_options), chat_model=dict(app.chat_model))
        return cls(**{**fields, **worker})

    def app_spec(self, registry: str | None = None, versions: Any = ...) -> AppSpec:
        """The `AppSpec` a worker builds its team and app from (its own `registry` copy and starting `versions` when
        it does not share the registry)."""
        return AppSpec(app=self.app, model=self.model, agents=list(self.agents),
                       registry=self.registry if registry is None else registry,
                       versions=self.versions if versions is ... else versions,
                       engine=self.engine or self.serving, engine_options=dict(self.engine_options), seed=self.seed,
                       node_roles=self.node_roles, recursion_limit=self.recursion_limit, resume=self.resume,
                       base_dir=self.base_dir,
                       what="online.app",
                       chat_model={"max_tokens": self.max_tokens, "temperature": self.temperature, **self.chat_model})


class RolloutWorker:
    """Builds the team and the wrapped app once; `run(jobs)` returns their trajectories (from the app's own records)."""

    def __init__(self, spec: WorkerSpec, index: int):
        self.spec, self.index = spec, index
        self._scratch = Path(tempfile.mkdtemp(prefix=f"marft-worker{index}-"))
        if spec.registry is not None and not spec.shared_registry:  # versions arrive as files (`load`), into a
            app = spec.app_spec(registry=str(self._scratch / "registry"), versions=None)  # registry that starts empty
        else:
            app = spec.app_spec()
        app.check_app()
        self.team = app.build_team()
        trace_dir = worker_trace_dir(spec, index) or self._scratch / "traces"
        self.app = app.build_app(self.team, trace_dir)
        self.collector = GraphCollector(self.app, concurrency=spec.concurrency)

    def ready(self) -> dict[str, Any]:
        """Who this worker is: its index, process and node (answered once it is built)."""
        import socket

        return {"index": self.index, "pid": os.getpid(), "host": socket.gethostname()}

    def versions(self) -> dict[str, str]:
        return dict(self.team.versions())

    def load(self, versions: dict[str, str], files: dict[str, dict[str, AdapterFiles]] | None = None) -> dict[str, str]:
        """Serve `versions` ({role: "v<k>"}) from now on. `files` ({role: {version: {name: bytes}}}) carries the
        versions' folders when the workers share no filesystem with the registry."""
        for role, by_version in (files or {}).items():
            for version, contents in by_version.items():
                folder = self._scratch / "registry" / role / version
                if folder.exists():
                    continue
                partial = folder.with_name(folder.name + ".partial")
                shutil.rmtree(partial, ignore_errors=True)
                for name, data in contents.items():
                    target = partial / name
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(data)
                partial.rename(folder)
        for role, version in versions.items():
            self.team.load_version(role, version)
        return self.versions()

    def run(self, jobs: list[EpisodeJob]) -> tuple[int, TrajectoryDataset, list[EpisodeFailure]]:
        """(this worker's index, the jobs' trajectories in job order, the episodes that raised). Episodes left paused
        at an interrupt are not returned (`GraphCollector.without_paused`)."""
        dataset = self.collector.without_paused(self.collector.run(jobs), len(jobs), f"rollout worker {self.index}")
        return self.index, dataset, list(self.collector.failures)

    def close(self) -> None:
        self.app.close()
        close = getattr(self.team, "close", None)
        if close is not None:
            close()
        shutil.rmtree(self._scratch, ignore_errors=True)


def worker_trace_dir(spec: WorkerSpec, index: int) -> Path | None:
    """Where worker `index` writes its spans under the spec's `trace_dir` (None: a private folder of its own)."""
    return Path(spec.trace_dir) / f"worker-{index}" if spec.trace_dir else None


def version_files(registry_root: str | Path, role: str, version: str) -> AdapterFiles:
    """One registry version's folder as {relative name: bytes} (what a worker without the registry receives)."""
    root = Path(registry_root) / role / version
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
