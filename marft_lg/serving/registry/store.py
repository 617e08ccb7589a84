"""Versioned agent adapters on disk, with aliases (``live``, ``candidate``) that can be rolled back.

Layout::

    <root>/<role>/v<k>/adapter_config.json, adapter_model.safetensors, manifest.json
    <root>/aliases.json     {"aliases": {alias: {role: version}}, "history": {alias: [older maps]}, "log": [...]}

Every write goes to a temporary name, is fsynced and renamed into place (`marft_lg._durable`), so
a crash never leaves a half-written version or alias file. Weights are safetensors only; nothing is
ever unpickled. Each manifest records the version's content hashes and LoRA shape (`integrity`), and
`verify` checks a version against it before anything loads it. Alias writes are compare-and-swap:
`set_alias` / `rollback` take the `alias_revision()` a caller read and refuse if the file changed since.
A save works in ``<role>/.tmp-<pid>-<ns>-<host>``; the folders of saves that died (their process is gone) are
removed the next time the registry is opened or saved to (`_clean_stale_saves`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import socket
import time
from collections.abc import Callable
from contextlib import contextmanager, suppress
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from marft_lg._durable import fsync_dir, write_atomic
from marft_lg.serving.errors import (
    AdapterIntegrityError,
    AdapterMismatchError,
    AliasConflictError,
    RegistryError,
)
from marft_lg.serving.registry.integrity import AdapterCheck, BaseShapes, record_adapter, verify_adapter
from marft_lg.serving.registry.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, check_adapter_dir, save_adapter

MANIFEST = "manifest.json"
ALIASES = "aliases.json"
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]{0,127}$")
_VERSION = re.compile(r"^v([1-9][0-9]*)$")
_SAVE_TMP = re.compile(r"^\.tmp-(\d+)-(\d+)(?:-(.+))?$")  # a save's work folder: pid, ns, host (older: no host)
_HOST = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())[:64] or "host"
FOREIGN_SAVE_STALE_S = 24 * 3600  # another host's save folder: its pid means nothing here, so only its age counts
log = logging.getLogger("marft_lg.serving")


def _check_name(name: str, what: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise RegistryError(
            f"invalid {what} {name!r}: use letters, digits, '_' and '-' (no dots, no path separators)"
        )
    return name


def _check_alias_data(data: Any, p: Path) -> dict[str, Any]:
    """The alias file's content, type-checked: a wrong type is an error naming the file and the key."""
    if not isinstance(data, dict):
        raise RegistryError(f"corrupt alias file {p}: expected a JSON object, got {type(data).__name__}; "
                            "restore it from backup or delete it")
    unknown = sorted(set(data) - {"aliases", "history", "log"})
    if unknown:
        raise RegistryError(f"corrupt alias file {p}: unknown keys {unknown}; expected aliases, history, log")

    def check_map(m: Any, where: str) -> None:
        if not isinstance(m, dict):
            raise RegistryError(f"corrupt alias file {p}: {where} must map roles to versions ({{role: \"v<k>\"}}), "
                                f"got {type(m).__name__} {m!r:.80}")
        for role, version in m.items():
            if not (isinstance(role, str) and _NAME.match(role) and isinstance(version, str) and _VERSION.match(version)):
                raise RegistryError(f"corrupt alias file {p}: {where} maps {role!r} to {version!r}; expected "
                                    "role: \"v<k>\"")

    aliases = data.setdefault("aliases", {})
    history = data.setdefault("history", {})
    log = data.setdefault("log", [])
    if not isinstance(aliases, dict):
        raise RegistryError(f"corrupt alias file {p}: 'aliases' must be an object {{alias: {{role: version}}}}, "
                            f"got {type(aliases).__name__}")
    for name, m in aliases.items():
        check_map(m, f"aliases.{name}")
    if not isinstance(history, dict):
        raise RegistryError(f"corrupt alias file {p}: 'history' must be an object {{alias: [maps]}}, "
                            f"got {type(history).__name__}")
    for name, stack in history.items():
        if not isinstance(stack, list):
            raise RegistryError(f"corrupt alias file {p}: history.{name} must be a list of maps, got "
                                f"{type(stack).__name__}")
        for i, m in enumerate(stack):
            check_map(m, f"history.{name}[{i}]")
    if not isinstance(log, list):
        raise RegistryError(f"corrupt alias file {p}: 'log' must be a list, got {type(log).__name__}")
    return data


def missing_registry(path: str | os.PathLike | None, *, create: bool) -> str | None:
    """Why a command's `--registry` cannot be used (it does not exist and `--create-registry` was not given), or
    None: the one refusal of `serve` and `compare`, where a typo would silently start an empty registry."""
    if path is None or create or Path(path).expanduser().exists():
        return None
    return (f"--registry {path} does not exist (a typo would use fresh adapters from a new empty registry); pass "
            "--create-registry to start one there")


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _pid_alive(pid: int) -> bool:
    """Whether a process `pid` runs on this machine (one of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OverflowError, ValueError):  # no process can have that id
        return False
    return True


def _dead_save(folder: Path) -> bool:
    """A save's work folder whose process died: on this host (or unnamed, as older saves wrote it) its pid is not
    alive; from another host, it is older than `FOREIGN_SAVE_STALE_S`. Never the folder of a live process."""
    m = _SAVE_TMP.match(folder.name)
    if m is None or not folder.is_dir():
        return False
    if m.group(3) not in (None, _HOST):
        return time.time() - folder.stat().st_mtime > FOREIGN_SAVE_STALE_S
    return not _pid_alive(int(m.group(1)))


class AdapterRegistry:
    """Versioned PEFT adapters per role under `root`, with aliases and rollback history."""

    def __init__(self, root: str | os.PathLike, *, create: bool = True):
        """`create=False` (the CLI's commands) refuses a root that does not exist instead of creating it."""
        path = Path(root).expanduser()
        if path.exists() and not path.is_dir():
            raise RegistryError(f"adapter registry {path} is not a directory")
        if not path.exists():
            if not create:
                raise RegistryError(f"adapter registry {path} does not exist; check the path (a registry is "
                                    "created when a version is first saved, e.g. by `marft-lg train`)")
            try:
                path.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise RegistryError(f"cannot create adapter registry {path}: {e.strerror or e}") from None
        self.root = path.resolve()
        self._clean_stale_saves()

    def _clean_stale_saves(self) -> list[Path]:
        """Remove the work folders of saves that died mid-way (`_dead_save`: a kill leaves them behind); returns
        them. A registry this process may not write to is left as it is."""
        removed = []
        try:
            folders = [p for d in self.root.iterdir() if d.is_dir() and _NAME.match(d.name) for p in d.iterdir()]
        except OSError:
            return removed
        for p in folders:
            with suppress(OSError):  # gone meanwhile (another process cleaned it): nothing to do
                if not _dead_save(p):
                    continue
                shutil.rmtree(p, ignore_errors=True)
                if not p.exists():
                    log.warning("removed %s, left by a save that died", p)
                    removed.append(p)
        return removed

    # ---- locking -------------------------------------------------------------------------------
    @contextmanager
    def _lock(self):
        from marft_lg.serving.engine.models import _file_lock

        with _file_lock(self.root / ".lock"):
            yield

    # ---- versions ------------------------------------------------------------------------------
    def roles(self) -> list[str]:
        """Roles that have at least one version."""
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and _NAME.match(p.name) and self.versions(p.name))

    def versions(self, role: str) -> list[str]:
        """Committed versions of `role`, oldest first (``["v1", "v2"]``)."""
        d = self.root / _check_name(role, "role")
        if not d.is_dir():
            return []
        found = [(int(m.group(1)), p.name) for p in d.iterdir() if (m := _VERSION.match(p.name)) and (p / MANIFEST).is_file()]
        return [name for _, name in sorted(found)]

    def incomplete(self) -> list[tuple[str, str]]:
        """(role, version) of version folders without a manifest (deleted, or never written): `versions` does not
        list them, so `marft-lg adapters` names them instead of letting them vanish silently."""
        found = []
        for d in sorted(p for p in self.root.iterdir() if p.is_dir() and _NAME.match(p.name)):
            numbered = [(int(m.group(1)), p.name) for p in d.iterdir() if (m := _VERSION.match(p.name)) and p.is_dir()]
            found += [(d.name, v) for _, v in sorted(numbered) if not (d / v / MANIFEST).is_file()]
        return found

    def saved_by(self, role: str, run_id: str, iteration: int) -> str | None:
        """The newest version of `role` that run `run_id` saved at `iteration` (as its manifest records), or None:
        how a resumed run that had already published finds what it published."""
        for version in reversed(self.versions(role)):
            with suppress(RegistryError):
                m = self.manifest(role, version)
                metrics = m.get("metrics") if isinstance(m.get("metrics"), dict) else {}
                if m.get("run_id") == run_id and metrics.get("iteration") == float(iteration):
                    return version
        return None

    def resolve(self, role: str, ref: str) -> str:
        """``"v3"``, ``"3"``, ``"latest"`` or an alias name -> the concrete version ``"v<k>"``."""
        versions = self.versions(role)
        ref = str(ref)
        if ref.isdigit():
            ref = f"v{ref}"
        if ref == "latest":
            if not versions:
                raise RegistryError(f"role {role!r} has no versions in registry {self.root}")
            return versions[-1]
        if _VERSION.match(ref):
            if ref not in versions:
                raise RegistryError(f"role {role!r} has no version {ref!r} in {self.root}; known: {versions or '(none)'}")
            return ref
        aliases = self._read_aliases()["aliases"]
        if ref in aliases:
            mapping = aliases[ref]
            if role not in mapping:
                raise RegistryError(f"alias {ref!r} has no version for role {role!r}; it maps {mapping}")
            return mapping[role]
        raise RegistryError(
            f"unknown version or alias {ref!r} for role {role!r}; versions: {versions or '(none)'}, "
            f"aliases: {sorted(aliases) or '(none)'}"
        )

    def path(self, role: str, ref: str) -> Path:
        """Directory of a version (resolved like `resolve`), guaranteed to lie inside the root."""
        version = self.resolve(role, ref)
        p = (self.root / _check_name(role, "role") / version).resolve()
        if not p.is_relative_to(self.root):
            raise RegistryError(f"{p} escapes registry root {self.root}")
        return p

    def manifest(self, role: str, ref: str) -> dict[str, Any]:
        """The manifest of a version (base fingerprint, base name and hash, parent, run id, metrics, created)."""
        p = self.path(role, ref) / MANIFEST
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise RegistryError(f"corrupt manifest {p}: {e}") from e
        if not isinstance(data, dict):
            raise RegistryError(f"corrupt manifest {p}: expected a JSON object, got {type(data).__name__}")
        return data

    def verify(self, role: str, ref: str, *, base_shapes: BaseShapes | None = None,
               require_lora: bool = False) -> AdapterCheck:
        """Check a version's files before anything loads them: the safetensors header, the LoRA shape
        (against `base_shapes`, the served model's layers, when given) and the content hash recorded at
        save time (``hash == "unrecorded"`` for versions saved before records existed).

        Raises `AdapterIntegrityError` naming the damaged file and the reason.
        """
        path = self.path(role, ref)
        record = self.manifest(role, ref).get("integrity")
        return verify_adapter(path, record=record if isinstance(record, dict) else None, base_shapes=base_shapes,
                              require_lora=require_lora)

    def check_base(self, role: str, ref: str, base_fingerprint: str, *, base_shapes: BaseShapes | None = None,
                   base_hash: str | Callable[[], str] | None = None, base_name: str | None = None) -> Path:
        """The version's path if it was trained for this base model and its files verify (`verify`), else
        `AdapterMismatchError` (another base model) or `AdapterIntegrityError` (damaged files).

        The manifest's `base_fingerprint` (layer shapes) must match; when it also records a `base_hash` (the
        base's weights, `model_content_hash`) and `base_hash` is given (a string, or a callable computed only
        then), that must match too: two models of the same shape with different weights share a fingerprint.
        Manifests written before `base_hash` existed load on the fingerprint alone. `base_name` names the
        served base in the message.
        """
        path = self.path(role, ref)
        manifest = self.manifest(role, ref)
        made_for = manifest.get("base_fingerprint")
        made_name = manifest.get("base_name")
        served = f"{base_name!r} ({base_fingerprint})" if base_name else str(base_fingerprint)
        trained = f"{made_name!r} ({made_for})" if made_name else str(made_for)
        if made_for != base_fingerprint:
            raise AdapterMismatchError(
                f"adapter {role}/{path.name} in {self.root} was made for base model {trained}, but the served base "
                f"model is {served}; train a new adapter for this base model or serve the matching one"
            )
        recorded = manifest.get("base_hash")
        if recorded is not None and base_hash is not None:
            actual = base_hash() if callable(base_hash) else base_hash
            if recorded != actual:
                raise AdapterMismatchError(
                    f"adapter {role}/{path.name} in {self.root} was made for base model "
                    f"{made_name or '(unnamed)'!r} with weights {recorded}, but the served base model "
                    f"{base_name or '(unnamed)'!r} has the same shapes and other weights ({actual}); train a new "
                    "adapter for this base model or serve the one it was trained on"
                )
        self.verify(role, ref, base_shapes=base_shapes, require_lora=base_shapes is not None)
        return path

    def locate(self, path: str | os.PathLike) -> tuple[str, str]:
        """A directory inside the root -> (role, version); anything else (traversal, links out) is refused."""
        p = Path(path)
        p = (p if p.is_absolute() else self.root / p).resolve()
        if not p.is_relative_to(self.root):
            raise RegistryError(f"adapter path {path} is outside the registry root {self.root}")
        rel = p.relative_to(self.root).parts
        if len(rel) != 2 or not _VERSION.match(rel[1]) or not (p / MANIFEST).is_file():
            raise RegistryError(f"adapter path {path} is not a registry version directory <root>/<role>/v<k>")
        return _check_name(rel[0], "role"), rel[1]

    def save(self, role: str, peft_model_or_dir: Any, *, base_fingerprint: str, parent: str | None = None,
             run_id: str | None = None, metrics: dict[str, float] | None = None,
             adapter_name: str | None = None, base_name: str | None = None, base_hash: str | None = None) -> str:
        """Store a new version of `role` and return its name (``"v<k>"``).

        The manifest records the base model it was trained on: `base_fingerprint` (layer shapes, always),
        `base_name` (the served base's name) and `base_hash` (its weights' `model_content_hash`), which
        `check_base` compares before the version is loaded.

        `peft_model_or_dir` is a PEFT adapter directory or a `peft.PeftModel` (then `adapter_name`
        picks the adapter when the model holds several).
        """
        _check_name(role, "role")
        if parent is not None:
            parent = self.resolve(role, parent)
        role_dir = self.root / role
        role_dir.mkdir(exist_ok=True)
        self._clean_stale_saves()
        tmp = role_dir / f".tmp-{os.getpid()}-{time.monotonic_ns()}-{_HOST}"
        try:
            if isinstance(peft_model_or_dir, (str, os.PathLike)):
                src = check_adapter_dir(peft_model_or_dir)
                tmp.mkdir()
                for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
                    shutil.copyfile(src / name, tmp / name)
            else:
                names = list(getattr(peft_model_or_dir, "peft_config", {}))
                if adapter_name is None:
                    if len(names) != 1:
                        raise RegistryError(f"the PeftModel holds adapters {names}; pass adapter_name= to pick one")
                    adapter_name = names[0]
                elif adapter_name not in names:
                    raise RegistryError(f"the PeftModel has no adapter {adapter_name!r}; it has {names}")
                save_adapter(peft_model_or_dir, adapter_name, tmp)
            for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
                with (tmp / name).open("rb") as f:
                    os.fsync(f.fileno())
            try:
                integrity = record_adapter(tmp)
            except AdapterIntegrityError as e:  # name the file the caller gave, not the temporary copy
                source = Path(e.file)
                if isinstance(peft_model_or_dir, (str, os.PathLike)):
                    source = Path(peft_model_or_dir) / source.name
                raise AdapterIntegrityError(source, e.reason) from None
            with self._lock():
                existing = self.versions(role)
                k = int(existing[-1][1:]) + 1 if existing else 1
                while (role_dir / f"v{k}").exists():  # a folder without a manifest keeps its number (`incomplete`)
                    k += 1
                version = f"v{k}"
                manifest = {
                    "role": role, "version": version, "base_fingerprint": base_fingerprint, "base_name": base_name,
                    "base_hash": base_hash, "parent": parent, "run_id": run_id, "metrics": dict(metrics or {}), "created": _now(), "integrity": integrity,
                }
                write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True))
                os.rename(tmp, role_dir / version)
                fsync_dir(role_dir)
            return version
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    # ---- aliases -------------------------------------------------------------------------------
    def _alias_state(self) -> tuple[str, dict[str, Any]]:
        """(revision, content) of the alias file; the revision is a hash of its bytes ("" when absent)."""
        p = self.root / ALIASES
        try:
            raw = p.read_bytes()
        except FileNotFoundError:
            return "", {"aliases": {}, "history": {}, "log": []}
        except OSError as e:
            raise RegistryError(f"cannot read alias file {p}: {e.strerror or e}") from None
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise RegistryError(f"corrupt alias file {p}: {e}; restore it from backup or delete it") from None
        return hashlib.sha256(raw).hexdigest()[:16], _check_alias_data(data, p)

    def _read_aliases(self) -> dict[str, Any]:
        return self._alias_state()[1]

    def alias_revision(self) -> str:
        """A token of the alias file's current content; pass it as `expect_revision` to write only if
        nothing changed it meanwhile (compare-and-swap)."""
        return self._alias_state()[0]

    def _check_revision(self, revision: str, expect_revision: str | None, alias: str, current: dict[str, str]) -> None:
        if expect_revision is not None and revision != expect_revision:
            raise AliasConflictError(
                f"alias {alias!r} in {self.root / ALIASES} changed since it was read (another promotion or rollback "
                f"ran meanwhile; it now maps {current}); nothing was written: read it again and retry")

    def _checked(self, mapping: dict[str, str]) -> None:
        """Every version of a map lies inside the root and its files verify (before any write)."""
        for role, version in mapping.items():
            self.verify(role, version)

    def aliases(self) -> dict[str, dict[str, str]]:
        """Every alias and the versions it maps."""
        return self._read_aliases()["aliases"]

    def alias(self, alias: str) -> dict[str, str]:
        """``{role: version}`` of an alias (empty if it was never set)."""
        return dict(self._read_aliases()["aliases"].get(alias, {}))

    def set_alias(self, alias: str, mapping: dict[str, str], *, reason: str = "",
                  expect_revision: str | None = None) -> dict[str, str]:
        """Point `alias` at versions for the given roles (other roles keep theirs); returns the new map.

        Every version is resolved and verified first (a damaged version or one that escapes the root
        is refused before anything is written). `expect_revision` (from `alias_revision()`) makes the
        write a compare-and-swap: `AliasConflictError` if the alias file changed since.
        """
        _check_name(alias, "alias")
        if _VERSION.match(alias) or alias == "latest":
            raise RegistryError(f"alias name {alias!r} would shadow a version reference; pick another name")
        if not isinstance(mapping, dict):
            raise RegistryError(f"an alias update is a {{role: version}} map, got {type(mapping).__name__} {mapping!r:.80}")
        resolved = {_check_name(role, "role"): self.resolve(role, ref) for role, ref in mapping.items()}
        self._checked(resolved)
        with self._lock():
            revision, data = self._alias_state()
            old = dict(data["aliases"].get(alias, {}))
            self._check_revision(revision, expect_revision, alias, old)
            new = {**old, **resolved}
            if new != old:
                data["history"].setdefault(alias, []).append(old)
                data["aliases"][alias] = new
                data["log"].append({"at": _now(), "alias": alias, "from": old, "to": new, "reason": reason})
                write_atomic(self.root / ALIASES, json.dumps(data, indent=2, sort_keys=True))
            return new

    def promote(self, mapping: dict[str, str], *, reason: str = "", alias: str = "live",
                expect_revision: str | None = None) -> dict[str, str]:
        """Make the given versions live (recorded with `reason`; undo with `rollback`)."""
        return self.set_alias(alias, mapping, reason=reason or "promote", expect_revision=expect_revision)

    def peek_rollback(self, alias: str = "live") -> dict[str, str]:
        """The map `rollback(alias)` would restore (nothing is written)."""
        stack = self._read_aliases()["history"].get(alias, [])
        if not stack:
            raise RegistryError(f"alias {alias!r} has no earlier state to roll back to in {self.root}")
        return dict(stack[-1])

    def rollback(self, alias: str = "live", *, reason: str = "rollback",
                 expect_revision: str | None = None) -> dict[str, str]:
        """Restore the alias's previous map; repeated calls go further back. Returns the restored map.

        The restored versions are verified first; `expect_revision` as in `set_alias`.
        """
        self._checked(self.peek_rollback(alias))
        with self._lock():
            revision, data = self._alias_state()
            old = data["aliases"].get(alias, {})
            self._check_revision(revision, expect_revision, alias, old)
            stack = data["history"].get(alias, [])
            if not stack:
                raise RegistryError(f"alias {alias!r} has no earlier state to roll back to in {self.root}")
            new = stack.pop()
            if new:
                data["aliases"][alias] = new
            else:
                data["aliases"].pop(alias, None)
            data["log"].append({"at": _now(), "alias": alias, "from": old, "to": new, "reason": reason})
            write_atomic(self.root / ALIASES, json.dumps(data, indent=2, sort_keys=True))
            return dict(new)

    def log(self) -> list[dict[str, Any]]:
        """Every alias change (promotions and rollbacks), oldest first."""
        return list(self._read_aliases()["log"])
