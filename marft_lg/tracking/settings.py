"""`report_to`: which trackers a run writes to, checked once, and the pip extra each one needs."""

from __future__ import annotations

import importlib.util
from typing import Any

from marft_lg._config import ConfigError

BACKENDS = ("tensorboard", "mlflow", "wandb")
"""The trackers `report_to` may name (besides `none`)."""
EXTRAS = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
"""Backend -> (its Python module, the `marft_lg[<extra>]` that installs it); the extra has the backend's name."""


class TrackingUnavailable(ImportError):
    """A `report_to` backend whose package is not installed; the message names the pip extra."""


def check_report_to(value: Any, key: str = "report_to") -> list[str]:
    """`report_to` as a list of backends: a name or a list of names from `BACKENDS`; `none`, null or [] for none.
    Anything else is a `ConfigError` naming `key`."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(x, str) for x in items):
        raise ConfigError(f"expected a tracker name or a list of them ({', '.join(BACKENDS)}, none), got {value!r:.60}",
                          key=key)
    names = [x.strip().lower() for x in items if x.strip()]
    if "none" in names:
        if len(names) > 1:
            raise ConfigError(f"'none' cannot be combined with other trackers: {list(items)}", key=key)
        return []
    unknown = [x for x in names if x not in BACKENDS]
    if unknown:
        raise ConfigError(f"unknown tracker {unknown[0]!r}; choose from {', '.join(BACKENDS)} or none", key=key)
    return list(dict.fromkeys(names))


def parse_report_to(text: str) -> list[str]:
    """`--report-to mlflow,tensorboard` (comma-separated) as `check_report_to` reads it."""
    return check_report_to([part for part in text.split(",")], key="--report-to")


def require(backend: str) -> None:
    """Raise `TrackingUnavailable` (one line, naming the extra) when `backend`'s package is not installed."""
    module = EXTRAS[backend]
    if importlib.util.find_spec(module) is None:
        raise TrackingUnavailable(f"report_to: {backend} needs the {module} package: "
                                  f"pip install 'marft_lg[{backend}]'")


def require_all(report_to: list[str]) -> None:
    """Check every chosen backend is installed before any work starts (one line for the first missing one)."""
    for backend in report_to:
        require(backend)
