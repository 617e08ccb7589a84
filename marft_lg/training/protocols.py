"""What the trainer needs of its collaborators, as small Protocols (checked with `isinstance`, never probed).

- `TrainablePolicy`: one base model with one LoRA adapter per role (a single-base `Team`, `LocalPolicy`);
- `TrainableTeam`: the roles of a team and the base each sits on (`Team`, `MixedTeam`, `LocalPolicy`);
- `Publisher`: a team that saves adapters as registry versions and hot-swaps them (`Team`, `MixedTeam`);
- (`Scorer`, a reward that scores a whole dataset, is `marft_lg.rewards.base.Scorer`, shared with the comparison;
  a plain ``episode -> float`` works too);
- `Collector`: where on-policy episodes come from (`GraphCollector`, `RayCollector`, `ChainCollector`);
  `ReportingCollector`: one that reports progress and stats into the metrics, and may prefetch the next
  iteration's rollouts while the update runs (`RayCollector`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch

from marft_lg.trajectories.dataset import TrajectoryDataset
from marft_lg.trajectories.scenarios import Scenario


@runtime_checkable
class TrainablePolicy(Protocol):
    """One base model in this process: its PeftModel (one adapter per role), tokenizer, and a pause of serving."""

    @property
    def model(self) -> torch.nn.Module: ...

    @property
    def tokenizer(self) -> Any: ...

    def agents(self) -> list[str]: ...

    def adapter_name(self, role: str, version: str | None = None) -> str: ...

    def exclusive(self) -> AbstractContextManager[Any]: ...


@runtime_checkable
class TrainableTeam(Protocol):
    """A team's roles and its bases: ``{base name: TrainablePolicy}`` (one entry for a one-base team)."""

    @property
    def bases(self) -> Mapping[str, TrainablePolicy]: ...

    def agents(self) -> list[str]: ...


@runtime_checkable
class Publisher(Protocol):
    """A team whose adapters become registry versions (`save_version`) served by a hot swap (`load_version`)."""

    registry: Any

    def save_version(self, role: str, *, parent: str | None = None, run_id: str | None = None,
                     metrics: dict[str, float] | None = None) -> str: ...

    def load_version(self, role: str, ref: str) -> str: ...

    def adapter_name(self, role: str, version: str | None = None) -> str: ...


@runtime_checkable
class Collector(Protocol):
    """K on-policy episodes per scenario, with the token ids and behaviour log-probs the engine produced."""

    def collect(self, scenarios: list[Scenario], k: int, iteration: int, seed: int) -> TrajectoryDataset: ...


@runtime_checkable
class ReportingCollector(Collector, Protocol):
    """A collector that shows progress (`progress(text)`), reports `last_stats` (e.g. episodes per rollout worker)
    into the iteration's metrics, and with `async_` prefetches the next iteration's rollouts during the update."""

    progress: Callable[[str], None] | None
    last_stats: dict[str, Any]

    @property
    def async_(self) -> bool: ...

    def prefetch(self, scenarios: list[Scenario], k: int, iteration: int, seed: int) -> None: ...
