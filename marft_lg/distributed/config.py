"""The one `ray:` config section (train.yaml, job.yaml, `marft-lg compare --ray`), and connecting to the cluster it
names. Without the section nothing changes: everything runs in this process."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from marft_lg._config import ConfigError, YamlDoc, check_fields

_LOCAL_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # Ray's switch: "0" keeps every address of a cluster on loopback
_ADDRESS = re.compile(r"^(local|auto|ray://[^\s:/]+(:\d+)?|[^\s:/]+:\d+)$")


@dataclass
class WorkerResources:
    """What one rollout worker reserves on the cluster, and its engine: `hf` (the embedded transformers engine, in
    the worker) or `vllm` (a vLLM server the worker starts and stops)."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    engine: str = "hf"


@dataclass
class RayConfig:
    """Where and how wide to run.

    `address`: ``local`` starts a private cluster on this machine (127.0.0.1, no dashboard) and stops it at the end;
    ``auto`` joins the cluster this machine belongs to (``ray start``); ``ray://host:port`` a remote one through Ray
    Client. `rollout_workers` actors run the on-policy episodes (each builds the app and its own engine);
    `async_` (``async:`` in YAML) overlaps the rollouts of iteration k+1 with the update of k (one step off-policy).
    `shared_registry`: the workers read adapter versions from the registry's folder (a filesystem every node
    mounts); false sends each version's files to them through the object store.
    """

    address: str = "local"
    rollout_workers: int = 2
    worker: WorkerResources = field(default_factory=WorkerResources)
    async_: bool = False
    shared_registry: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.address, str) or not _ADDRESS.match(self.address):
            raise ConfigError(f"ray address {self.address!r}: use local, auto or ray://host:port", key=("address",))
        if not isinstance(self.rollout_workers, int) or self.rollout_workers < 1:
            raise ConfigError(f"rollout_workers must be an integer >= 1, got {self.rollout_workers!r}",
                              key=("rollout_workers",))
        if isinstance(self.worker, dict):
            self.worker = WorkerResources(**self.worker)
        if self.worker.num_cpus < 0 or self.worker.num_gpus < 0:
            raise ConfigError("worker num_cpus and num_gpus must be >= 0", key=("worker",))
        if self.worker.engine not in ("hf", "vllm"):
            raise ConfigError(f"worker engine {self.worker.engine!r}: use hf or vllm", key=("worker", "engine"))

    @classmethod
    def from_doc(cls, doc: YamlDoc) -> RayConfig | None:
        """The section at `doc` (None when absent), every error naming file:line: key."""
        if doc.data is None:
            return None
        data = dict(doc.data) if isinstance(doc.data, dict) else doc.data
        if isinstance(data, dict) and "async" in data:
            data["async_"] = data.pop("async")
        values = check_fields(cls, data, doc, what="ray", skip=("worker",))
        worker = values.pop("worker", None)
        if worker is not None:
            values["worker"] = WorkerResources(**check_fields(WorkerResources, worker, doc.at("worker"),
                                                              what="ray.worker"))
        try:
            return cls(**values)
        except ConfigError as exc:
            raise doc.locate(exc) from None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["async"] = out.pop("async_")
        return out


@contextlib.contextmanager
def _loopback_only() -> Iterator[None]:
    """While a private cluster starts, Ray's single-machine switch: without it Ray turns ``127.0.0.1`` into the
    machine's reachable address and its GCS, raylet and workers listen on every interface. The cluster's processes
    inherit it; this process gets its old value back for any later connection."""
    from ray._private import ray_constants

    old_env, old_flag = os.environ.get(_LOCAL_ONLY), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_LOCAL_ONLY], ray_constants.ENABLE_RAY_CLUSTER = "0", False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = old_flag
        if old_env is None:
            os.environ.pop(_LOCAL_ONLY, None)
        else:
            os.environ[_LOCAL_ONLY] = old_env


def connect(cfg: RayConfig, *, num_cpus: int | None = None) -> Any:
    """`ray.init` for `cfg.address` (a no-op when this process is already connected); returns the `ray` module. A
    `local` cluster binds to 127.0.0.1, has no dashboard, and is sized for the rollout workers (or `num_cpus`)."""
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - the extra is installed by `make test`
        raise ConfigError("the ray: section needs Ray: pip install 'marft_lg[ray]'") from exc
    if ray.is_initialized():
        return ray
    if cfg.address == "local":
        cpus = num_cpus if num_cpus is not None else max(1, int(round(cfg.rollout_workers * cfg.worker.num_cpus)) + 1)
        with _loopback_only():
            ray.init(num_cpus=cpus, num_gpus=int(cfg.rollout_workers * cfg.worker.num_gpus + 0.999) or None,
                     include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
                     configure_logging=False)
    else:
        ray.init(address=cfg.address, log_to_driver=False, configure_logging=False)
    return ray
