"""Mining over Ray: `mine(paths, ray=...)` runs the byte ranges of the input on Ray actors instead of local worker
processes, and gives the tables that mining in one process gives.

It is the multi-core miner of `marft_lg.trajectories.parallel` with Ray as the transport: each actor plays the
`RangeWorker` role (read and interpret a group of line-aligned byte ranges, send each trace's episode key, ship the
traces the driver asks for, assemble its own episodes), its replies travel through the object store (streaming
generators), and this process (the driver) plays `ParallelRun`'s part: merge the traces cut between actors, decide
the episodes, assemble those that cross actors, write the tables. An actor's files (rows for `mine`, quarantine
records) are streamed back to the driver at the end, so they need no shared directory.

The input files must be readable at the same paths on the driver and on every node of the cluster (a shared
filesystem): the driver plans the ranges and numbers their lines, the actors read them.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from marft_lg.distributed.config import RayConfig, connect
from marft_lg.trajectories import mining as _mining
from marft_lg.trajectories.otlp import DEFAULT_MAX_LINE_BYTES, FileRange
from marft_lg.trajectories.pipeline import gc_paused
from marft_lg.trajectories.range_worker import Channel, RangeWorker
from marft_lg.trajectories.ranges import default_workers

if TYPE_CHECKING:
    from marft_lg.trajectories.dataset import TrajectoryDataset
    from marft_lg.trajectories.mining import MiningReport, PathsLike

RayLike = RayConfig | str | None
MAX_RAY_WORKERS = 8
_CHUNK = 8 * 1024 * 1024  # bytes of an actor's file per object-store message


def mine(paths: PathsLike, *, ray: RayLike = None, **options: Any) -> TrajectoryDataset:
    """`marft_lg.trajectories.mining.mine` (the same options), on the Ray cluster `ray` names (see `on_ray`)."""
    return mine_with_report(paths, ray=ray, **options)[0]


def mine_with_report(paths: PathsLike, *, ray: RayLike = None,
                     **options: Any) -> tuple[TrajectoryDataset, MiningReport]:
    """`marft_lg.trajectories.mining.mine_with_report` on the Ray cluster `ray` names (see `on_ray`)."""
    with on_ray(ray, options.pop("workers", None)) as run:
        return _mining.mine_with_report(paths, **run, **options)


def mine_to_parquet(paths: PathsLike, out: str | Path, *, ray: RayLike = None, **options: Any) -> MiningReport:
    """`marft_lg.trajectories.mining.mine_to_parquet` on the Ray cluster `ray` names (see `on_ray`)."""
    with on_ray(ray, options.pop("workers", None)) as run:
        return _mining.mine_to_parquet(paths, out, **run, **options)


@contextlib.contextmanager
def on_ray(ray: RayLike, workers: int | None) -> Iterator[dict[str, Any]]:
    """The `workers=` and `executor=` that make trajectories' mining functions run on Ray.

    `ray`: None mines here as usual (`workers` processes); a `RayConfig`, or its address (``local``, ``auto``,
    ``ray://host:port``), mines on that cluster, in `workers` Ray actors (default: the cluster's CPUs, at most 8),
    each reserving a CPU (a share of one when there are more actors than CPUs). A process already connected to
    Ray (`ray.is_initialized()`) mines on that connection; a connection opened here is closed at the end (a
    ``local`` cluster, sized to this machine's usable cores, is stopped).
    """
    if ray is None:
        yield {"workers": workers}
        return
    cfg = RayConfig(address=ray) if isinstance(ray, str) else ray
    owned = "ray" not in sys.modules or not sys.modules["ray"].is_initialized()
    rt = connect(cfg, num_cpus=default_workers())  # says how to install Ray when it is missing
    try:
        cpus = int(rt.cluster_resources().get("CPU", 1))
        n = workers or max(1, min(MAX_RAY_WORKERS, cpus))
        share = math.floor(max(cpus, 1) / n * 10_000) / 10_000  # Ray counts CPUs to 4 decimals: n shares fit
        yield {"workers": n, "executor": RayExecutor(rt, num_cpus=min(1.0, share))}
    finally:
        if owned:
            rt.shutdown()


class RayExecutor:
    """A `RangeExecutor` whose workers are Ray actors, one per range group, each reserving `num_cpus` and spread
    over the nodes."""

    def __init__(self, ray: Any, *, num_cpus: float = 1.0):
        self.ray = ray
        self._actor = ray.remote(num_cpus=num_cpus, scheduling_strategy="SPREAD", max_restarts=0,
                                 concurrency_groups={"progress": 1})(_MiningActor)

    def start(self, index: int, ranges: list[FileRange], *, max_attribute_bytes: int, tmp: Path,
              quarantine: bool, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> _RayChannel:
        return _RayChannel(self.ray, index, self._actor.remote(index, ranges, max_attribute_bytes, quarantine,
                                                               max_line_bytes))

    def wait(self, channels: list[Channel], timeout: float | None) -> list[Channel]:
        replies = [c.replies for c in channels]  # type: ignore[attr-defined]
        ready, _ = self.ray.wait(replies, num_returns=1, timeout=timeout)
        return [c for c, r in zip(channels, replies, strict=True) if any(r is x for x in ready)]


class _MiningActor:
    """A `RangeWorker` in a Ray actor: `handle` streams its replies; its files live in a directory of its own."""

    def __init__(self, index: int, ranges: list[FileRange], max_attribute_bytes: int, quarantine: bool,
                 max_line_bytes: int = DEFAULT_MAX_LINE_BYTES):
        self._gc = contextlib.ExitStack()
        self._gc.enter_context(gc_paused())  # for the actor's life: it holds its spans between commands
        self._tmp = Path(tempfile.mkdtemp(prefix="marft-mine-"))
        self._read = 0
        self._worker = RangeWorker(index, ranges, max_attribute_bytes, self._tmp, quarantine, self._progress,
                                   max_line_bytes)

    def _progress(self, n: int) -> None:
        self._read = n

    def handle(self, cmd: str, arg: Any = None) -> Iterator[Any]:
        if cmd == "parse":
            self._check_files()
        yield from self._worker.handle(cmd, arg)

    def _check_files(self) -> None:
        """Fail loudly when a file is not where the driver saw it (one process would quarantine it as unreadable,
        which here would quietly drop this node's share of the input)."""
        for path in dict.fromkeys(r.path for r in self._worker.ranges):
            if not os.access(path, os.R_OK):
                raise FileNotFoundError(f"{path} is not readable on the Ray node {socket.gethostname()}: mining over Ray"
                                        " needs the files at the same paths on every node (a shared filesystem)")

    def spans_read(self) -> int:
        return self._read

    def fetch(self, name: str) -> Iterator[bytes]:
        """The file `name` of this actor (nothing when it does not exist), a chunk at a time; then it is deleted."""
        path = self._tmp / name
        if not path.exists():
            return
        with path.open("rb") as fh:
            yield b""  # it exists, also when empty
            while chunk := fh.read(_CHUNK):
                yield chunk
        path.unlink()

    def close(self) -> None:
        shutil.rmtree(self._tmp, ignore_errors=True)
        self._gc.close()


class _RayChannel:
    """The driver's end of one `_MiningActor`: each command is a streaming call, `recv` takes its next reply."""

    def __init__(self, ray: Any, index: int, actor: Any):
        self.ray, self.index, self.actor = ray, index, actor
        self.replies: Any = None  # the current command's replies (an ObjectRefGenerator)
        self._read = 0
        self._asked: Any = None  # a pending `spans_read` call

    def send(self, cmd: str, arg: Any = None) -> None:
        self.replies = self.actor.handle.options(num_returns="streaming").remote(cmd, arg)

    def recv(self) -> Any:
        try:
            return self.ray.get(next(self.replies))
        except StopIteration:
            raise RuntimeError(f"mining worker {self.index} (a Ray actor) sent no reply") from None
        except self.ray.exceptions.RayError as exc:
            raise RuntimeError(f"mining worker {self.index} (a Ray actor) failed: {exc}") from exc

    def spans_read(self) -> int:
        """The count of the last answered request; asks again (without waiting) when that one was answered."""
        if self._asked is not None and self.ray.wait([self._asked], timeout=0)[0]:
            self._read, self._asked = self.ray.get(self._asked), None
        if self._asked is None:
            self._asked = self.actor.spans_read.options(concurrency_group="progress").remote()
        return self._read

    def release(self, names: list[str], tmp: Path) -> None:
        for name in names:
            with contextlib.ExitStack() as stack:
                out = None
                for ref in self.actor.fetch.options(num_returns="streaming").remote(name):
                    if out is None:  # only a file the actor has
                        out = stack.enter_context((tmp / name).open("wb"))
                    out.write(self.ray.get(ref))
        self.close()

    def close(self) -> None:
        if self.actor is None:
            return
        with contextlib.suppress(Exception):  # a dead actor has nothing left to clean up
            self.ray.get(self.actor.close.remote(), timeout=30)
        self.ray.kill(self.actor)
        self.actor = None
