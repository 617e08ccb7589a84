"""Training checkpoints without pickle: adapters, value head, optimizer states, RNG states, the data cursor.

A checkpoint is a folder `<run>/checkpoints/iter_<N>/` (N = iterations done) holding

- `tensors.safetensors`: every tensor (adapter weights, value head, optimizer moments and steps, torch RNG
  states), read back with safetensors, which runs no code;
- `state.json`: everything else (counters, config, run id, optimizer hyper-parameters, numpy / python RNG
  states as lists and base64 bytes), with each tensor replaced by a reference into the tensor file;
- `manifest.json`, written last: format version, iteration, size and SHA-256 of the two files above.

It is written to `.tmp-iter_<N>`, every file and the folder fsynced, renamed into place, then the
`latest` pointer is replaced atomically (`marft_lg._durable`). `resume` does not trust `latest` alone:
`find_resumable` walks the checkpoints newest first and takes the first one whose manifest, sizes,
hashes and contents check out, saying why it skipped any newer one (missing, truncated, damaged, from
an older marft_lg). A checkpoint in the old pickle format (`state.pt`) is never unpickled (that could run
code planted in the run directory); it is refused with a message saying so.
"""

from __future__ import annotations

import base64
import json
import random
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from marft_lg._durable import fsync_dir, fsync_tree, rename_durable, sha256_file, write_atomic

FORMAT = "marft_lg-checkpoint"
VERSION = 2
TENSORS = "tensors.safetensors"
STATE = "state.json"
MANIFEST = "manifest.json"
LEGACY_STATE = "state.pt"
_NAME = re.compile(r"^iter_(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (damaged, incomplete, from an older marft_lg, or for another team)."""


# --- RNG state ------------------------------------------------------------------------------------------

def rng_state(generator: torch.Generator) -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
            "generator": generator.get_state()}


def set_rng_state(state: dict[str, Any], generator: torch.Generator) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    generator.set_state(state["generator"])


# --- encoding: tensors to safetensors, the rest to tagged JSON ------------------------------------------

def _encode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        key = f"state/{len(tensors)}"
        tensors[key] = value.detach().to("cpu", copy=True).contiguous()
        return {"__tensor__": key}
    if isinstance(value, np.ndarray):
        arr = np.ascontiguousarray(value)
        return {"__ndarray__": base64.b64encode(arr.tobytes()).decode("ascii"), "dtype": arr.dtype.str,
                "shape": list(arr.shape)}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, bytes | bytearray):
        return {"__bytes__": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, tensors) for v in value]}
    if isinstance(value, list):
        return [_encode(v, tensors) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: _encode(v, tensors) for k, v in value.items()}
        return {"__items__": [[_encode(k, tensors), _encode(v, tensors)] for k, v in value.items()]}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"cannot write {type(value).__name__} into a checkpoint (tensors, numbers, text, lists, "
                    "tuples, dicts, bytes and numpy arrays only)")


def _decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tensor__" in value:
        return tensors[value["__tensor__"]]
    if "__ndarray__" in value:
        raw = base64.b64decode(value["__ndarray__"], validate=True)
        return np.frombuffer(raw, dtype=np.dtype(value["dtype"])).reshape(value["shape"]).copy()
    if "__bytes__" in value:
        return base64.b64decode(value["__bytes__"], validate=True)
    if "__tuple__" in value:
        return tuple(_decode(v, tensors) for v in value["__tuple__"])
    if "__items__" in value:
        return {_hashable(_decode(k, tensors)): _decode(v, tensors) for k, v in value["__items__"]}
    return {k: _decode(v, tensors) for k, v in value.items()}


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


# --- writing --------------------------------------------------------------------------------------------

Adapters = Mapping[str, Sequence[torch.Tensor]]
"""``{role: the tensors of its adapter, in a stable order}`` (`adapter_parameters`), whatever base each is on."""


def save_checkpoint(run_dir: str | Path, iteration: int, *, adapters: Adapters, adapter_names: Mapping[str, str],
                    state: dict[str, Any]) -> Path:
    """Write checkpoint `iter_<iteration>` (adapter tensors by role + `state`) and point `latest` at it."""
    from safetensors.torch import save_file

    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    name = f"iter_{iteration:06d}"
    tmp = root / f".tmp-{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    tensors: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    for role, params in adapters.items():
        counts[role] = len(params)
        for i, p in enumerate(params):
            tensors[f"adapters/{role}/{i}"] = p.detach().to("cpu", copy=True).contiguous()
    body = {"iteration": iteration, "adapters": counts, "adapter_names": dict(adapter_names),
            "state": _encode(state, tensors)}
    save_file(tensors, str(tmp / TENSORS), metadata={"format": FORMAT, "version": str(VERSION)})
    (tmp / STATE).write_text(json.dumps(body))
    files = {n: {"bytes": (tmp / n).stat().st_size, "sha256": sha256_file(tmp / n)} for n in (TENSORS, STATE)}
    (tmp / MANIFEST).write_text(json.dumps({"format": FORMAT, "version": VERSION, "iteration": iteration,
                                            "files": files}, indent=2))
    fsync_tree(tmp)
    final = root / name
    if final.exists():  # a run redoing an iteration after a resume from an older checkpoint
        shutil.rmtree(final)
        fsync_dir(root)
    rename_durable(tmp, final)
    write_atomic(root / "latest", name)
    return final


# --- reading --------------------------------------------------------------------------------------------

@dataclass
class Checkpoint:
    """A checkpoint read and checked in full (nothing applied to a model yet)."""

    path: Path
    iteration: int
    adapters: dict[str, list[torch.Tensor]]
    state: dict[str, Any]


def checkpoint_iteration(path: Path) -> int | None:
    m = _NAME.match(path.name)
    return int(m.group(1)) if m else None


def read_checkpoint(path: str | Path) -> Checkpoint:
    """Read and verify one checkpoint folder; `CheckpointError` says what is wrong with it."""
    from safetensors import SafetensorError
    from safetensors.torch import load as load_tensors

    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"{p} does not exist")
    if not (p / MANIFEST).exists():
        if (p / LEGACY_STATE).exists():
            raise CheckpointError(f"{p} was written by an older version of marft_lg (a pickle file, {LEGACY_STATE}); "
                                  "it is not loaded, since unpickling a file can run code. Start the run again "
                                  "(--overwrite) or resume it with the marft_lg version that wrote it")
        raise CheckpointError(f"{p} is incomplete: no {MANIFEST}")
    try:
        manifest = json.loads((p / MANIFEST).read_text())
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise CheckpointError(f"{p / MANIFEST} is not a marft_lg checkpoint manifest")
        if manifest.get("version") != VERSION:
            raise CheckpointError(f"{p} has checkpoint format version {manifest.get('version')!r}; this marft_lg "
                                  f"reads version {VERSION}")
        for name in (TENSORS, STATE):
            expect = manifest["files"][name]
            f = p / name
            if not f.exists():
                raise CheckpointError(f"{f} is missing")
            size = f.stat().st_size
            if size != expect["bytes"]:
                raise CheckpointError(f"{f} is truncated or damaged ({size} bytes, {expect['bytes']} written)")
            if sha256_file(f) != expect["sha256"]:
                raise CheckpointError(f"{f} is damaged (its SHA-256 differs from the one written)")
        tensors = load_tensors((p / TENSORS).read_bytes())
        body = json.loads((p / STATE).read_text())
        adapters = {role: [tensors[f"adapters/{role}/{i}"] for i in range(int(n))]
                    for role, n in body["adapters"].items()}
        state = _decode(body["state"], tensors)
        state["adapter_names"] = body.get("adapter_names", {})
        iteration = int(body["iteration"])
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError, SafetensorError) as exc:
        raise CheckpointError(f"{p} cannot be read ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{p / STATE} holds no state mapping")
    return Checkpoint(p, iteration, adapters, state)


def check_compatible(ckpt: Checkpoint, *, adapters: Adapters) -> None:
    """Raise `CheckpointError` unless every saved adapter matches a live one tensor for tensor."""
    for role, tensors in ckpt.adapters.items():
        if role not in adapters:
            raise CheckpointError(f"checkpoint {ckpt.path} has an adapter for role {role!r} the team does not train "
                                  f"(trained roles: {sorted(adapters)})")
        params = adapters[role]
        if len(params) != len(tensors):
            raise CheckpointError(f"checkpoint {ckpt.path}: adapter of {role!r} has {len(tensors)} tensors, the live "
                                  f"one {len(params)}; was the LoRA shape changed since?")
        for i, (p, t) in enumerate(zip(params, tensors, strict=True)):
            if tuple(p.shape) != tuple(t.shape):
                raise CheckpointError(f"checkpoint {ckpt.path}: tensor {i} of {role!r} has shape {tuple(t.shape)}, "
                                      f"the live adapter {tuple(p.shape)}; was the LoRA shape changed since?")


def apply_adapters(ckpt: Checkpoint, *, adapters: Adapters) -> None:
    """Copy the saved adapter tensors into the live adapters (after `check_compatible`)."""
    with torch.no_grad():
        for role, tensors in ckpt.adapters.items():
            for p, t in zip(adapters[role], tensors, strict=True):
                p.copy_(t)


def load_checkpoint(path: str | Path, *, adapters: Adapters) -> dict[str, Any]:
    """Read, verify and apply one checkpoint's adapters; return the rest of the state."""
    ckpt = read_checkpoint(path)
    check_compatible(ckpt, adapters=adapters)
    apply_adapters(ckpt, adapters=adapters)
    return ckpt.state


# --- choosing the checkpoint to resume from -------------------------------------------------------------

@dataclass
class Skipped:
    path: Path
    reason: str


@dataclass
class Resumable:
    """The newest checkpoint that loads (`checkpoint`, None when there is none) and why newer ones were skipped."""

    checkpoint: Checkpoint | None
    skipped: list[Skipped] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """The run's `iter_<N>` folders, newest first (temporary `.tmp-*` folders are not checkpoints)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(checkpoint_iteration(p), p) for p in root.iterdir() if p.is_dir()]
    return [p for it, p in sorted(((it, p) for it, p in found if it is not None), reverse=True)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The folder the `latest` pointer names, when it exists (see `find_resumable` for what resume uses)."""
    pointer = Path(run_dir) / "checkpoints" / "latest"
    try:
        name = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    path = pointer.parent / name
    return path if name and _NAME.match(name) and path.is_dir() else None


def find_resumable(run_dir: str | Path, *, adapters: Adapters) -> Resumable:
    """The newest checkpoint of `run_dir` that reads, verifies and fits the team; newer broken ones are skipped
    with their reason. Raises `CheckpointError` when checkpoints exist but none can be used."""
    root = Path(run_dir) / "checkpoints"
    out = Resumable(None)
    pointer = root / "latest"
    if pointer.exists():
        try:
            name = pointer.read_text().strip()
        except (OSError, UnicodeDecodeError):
            name = ""
        if not _NAME.match(name):
            out.notes.append(f"{pointer} is damaged ({name[:40]!r}); looking at the checkpoints themselves")
        elif not (root / name).is_dir():
            out.notes.append(f"{pointer} names {name}, which does not exist; looking at the checkpoints themselves")
    candidates = list_checkpoints(run_dir)
    for path in candidates:
        try:
            ckpt = read_checkpoint(path)
            check_compatible(ckpt, adapters=adapters)
        except CheckpointError as exc:
            out.skipped.append(Skipped(path, str(exc)))
            continue
        out.checkpoint = ckpt
        return out
    if candidates:
        reasons = "\n".join(f"  - {s.path.name}: {s.reason}" for s in out.skipped)
        legacy = all("older version" in s.reason for s in out.skipped)
        what = ("every checkpoint was written by an older version of marft_lg" if legacy
                else "no checkpoint can be used")
        raise CheckpointError(f"cannot resume {run_dir}: {what}:\n{reasons}\nStart the run again with --overwrite "
                              "(deletes the run's files) or train into another run_dir")
    return out
