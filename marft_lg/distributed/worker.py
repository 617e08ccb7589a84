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

from marft_lg.graph.collect import EpisodeJob, GraphCollector
from marft_lg.trajectories.dataset import TrajectoryDataset

AdapterFiles = dict[str, bytes]  # file name -> content of one registry version's folder


@dataclass
class WorkerSpec:
    """How every rollout worker builds its engine and app: the same `module:attr` factory the config names.

    `registry` is the adapter registry's folder. With `shared_registry` the workers read versions from it (a shared
    filesystem); without, the driver sends each version's files through the object store and a worker keeps its
    own copy. `engine` (a `module:attr` factory taking this spec) replaces the embedded `Team`, e.g. with a client
    of a vLLM server or a fake for tests.
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
    max_tokens: int = 64
    temperature: float = 1.0
    concurrency: int = 8
    trace_dir: str | None = None
    engine: str | None = None
    serving: str = "hf"
    """The `Team` engine: `hf` (embedded transformers) or `vllm` (a vLLM server the worker starts)."""
    engine_options: dict[str, Any] = field(default_factory=dict)


class RolloutWorker:
    """Builds the team and the wrapped app once; `run(jobs)` returns their trajectories (from the app's own records)."""

    def __init__(self, spec: WorkerSpec, index: int):
        from marft_lg.graph.chat_model import TeamChatModel
        from marft_lg.graph.wrap import wrap
        from marft_lg.loading import load_object

        self.spec, self.index = spec, index
        self._scratch = Path(tempfile.mkdtemp(prefix=f"marft-worker{index}-"))
        registry = spec.registry
        if registry is not None and not spec.shared_registry:
            registry = str(self._scratch / "registry")  # versions arrive as files (`load`)
        build = load_object(spec.app, base_dir=spec.base_dir, what="online.app")
        if spec.engine is not None:
            self.team = load_object(spec.engine, base_dir=spec.base_dir, what="ray engine")(spec)
        else:
            from marft_lg.serving.team import Team

            versions = spec.versions if spec.shared_registry else None  # a private registry starts empty
            self.team = Team(spec.model, spec.agents, engine=spec.serving, registry=registry, versions=versions,
                             seed=spec.seed, engine_options=spec.engine_options or None)
        llm = TeamChatModel(team=self.team, max_tokens=spec.max_tokens, temperature=spec.temperature)
        trace_dir = Path(spec.trace_dir) / f"worker-{index}" if spec.trace_dir else self._scratch / "traces"
        self.app = wrap(build(llm), team=self.team, trace_dir=trace_dir, node_roles=spec.node_roles)
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

    def run(self, jobs: list[EpisodeJob]) -> tuple[int, TrajectoryDataset, list[str]]:
        """(this worker's index, the jobs' trajectories in job order, the episodes that raised)."""
        self.collector.errors = []
        dataset = self.collector.run(jobs)
        return self.index, dataset, list(self.collector.errors)

    def close(self) -> None:
        self.app.close()
        close = getattr(self.team, "close", None)
        if close is not None:
            close()
        shutil.rmtree(self._scratch, ignore_errors=True)


def version_files(registry_root: str | Path, role: str, version: str) -> AdapterFiles:
    """One registry version's folder as {relative name: bytes} (what a worker without the registry receives)."""
    root = Path(registry_root) / role / version
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
