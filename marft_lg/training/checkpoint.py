"""Atomic training checkpoints: adapters, value head, optimizer states, RNG states and the data cursor.

A checkpoint is written to `<run>/checkpoints/.tmp-<name>` and renamed into place, then the
`latest` pointer is replaced atomically, so a crash never leaves a half-written checkpoint behind.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from marft_lg.training.policy import adapter_parameters


def rng_state(generator: torch.Generator) -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
            "generator": generator.get_state()}


def set_rng_state(state: dict[str, Any], generator: torch.Generator) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    generator.set_state(state["generator"])


def save_checkpoint(run_dir: str | Path, iteration: int, *, model: torch.nn.Module, adapter_names: dict[str, str],
                    state: dict[str, Any]) -> Path:
    """Write checkpoint `iter_<iteration>` (adapter tensors by role + `state`) and point `latest` at it."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    name = f"iter_{iteration:06d}"
    tmp = root / f".tmp-{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    adapters = {role: [p.detach().to("cpu", copy=True) for p in adapter_parameters(model, adapter)]
                for role, adapter in adapter_names.items()}
    torch.save({"adapters": adapters, "adapter_names": dict(adapter_names), **state}, tmp / "state.pt")
    final = root / name
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    pointer = root / ".latest.tmp"
    pointer.write_text(name)
    os.replace(pointer, root / "latest")
    return final


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    pointer = Path(run_dir) / "checkpoints" / "latest"
    if not pointer.exists():
        return None
    path = pointer.parent / pointer.read_text().strip()
    return path if (path / "state.pt").exists() else None


def load_checkpoint(path: str | Path, *, model: torch.nn.Module, adapter_names: dict[str, str]) -> dict[str, Any]:
    """Copy the saved adapter tensors into the live adapters and return the rest of the state."""
    state = torch.load(Path(path) / "state.pt", weights_only=False, map_location="cpu")  # GPU or CPU run alike
    with torch.no_grad():
        for role, tensors in state.pop("adapters").items():
            if role not in adapter_names:
                raise ValueError(f"checkpoint {path} has an adapter for role {role!r} the team does not have "
                                 f"(team roles: {sorted(adapter_names)})")
            params = adapter_parameters(model, adapter_names[role])
            if len(params) != len(tensors):
                raise ValueError(f"checkpoint {path}: adapter of {role!r} has {len(tensors)} tensors, the live "
                                 f"one {len(params)}; was the LoRA shape changed since?")
            for p, t in zip(params, tensors, strict=True):
                p.copy_(t)
    return state
