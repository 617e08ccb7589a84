"""Versioned agent adapters on disk, with aliases (``live``, ``candidate``) that can be rolled back.

Layout::

    <root>/<role>/v<k>/adapter_config.json, adapter_model.safetensors, manifest.json
    <root>/aliases.json     {"aliases": {alias: {role: version}}, "history": {alias: [older maps]}, "log": [...]}

Every write goes to a temporary name, is fsynced and renamed into place, so a crash never leaves a
half-written version or alias file. Weights are safetensors only; nothing is ever unpickled.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from marft_lg.serving.errors import AdapterMismatchError, RegistryError
from marft_lg.serving.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, check_adapter_dir, save_adapter

MANIFEST = "manifest.json"
ALIASES = "aliases.json"
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]{0,127}$")
_VERSION = re.compile(r"^v([1-9][0-9]*)$")


def _check_name(name: str, what: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise RegistryError(
            f"invalid {what} {name!r}: use letters, digits, '_' and '-' (no dots, no path separators)"
        )
    return name


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


class AdapterRegistry:
    """Versioned PEFT adapters per role under `root`, with aliases and rollback history."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).expanduser().resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    # ---- locking -------------------------------------------------------------------------------
    @contextmanager
    def _lock(self):
        from marft_lg.serving.models import _file_lock

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
        """The manifest of a version (base fingerprint, parent, run id, metrics, created)."""
        p = self.path(role, ref) / MANIFEST
        try:
            return json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise RegistryError(f"corrupt manifest {p}: {e}") from e

    def check_base(self, role: str, ref: str, base_fingerprint: str) -> Path:
        """The version's path if it was trained for this base model, else `AdapterMismatchError`."""
        path = self.path(role, ref)
        made_for = self.manifest(role, ref).get("base_fingerprint")
        if made_for != base_fingerprint:
            raise AdapterMismatchError(
                f"adapter {role}/{path.name} in {self.root} was made for base model {made_for}, but the served base "
                f"model is {base_fingerprint}; train a new adapter for this base model or serve the matching one"
            )
        return check_adapter_dir(path)

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
             adapter_name: str | None = None) -> str:
        """Store a new version of `role` and return its name (``"v<k>"``).

        `peft_model_or_dir` is a PEFT adapter directory or a `peft.PeftModel` (then `adapter_name`
        picks the adapter when the model holds several).
        """
        _check_name(role, "role")
        if parent is not None:
            parent = self.resolve(role, parent)
        role_dir = self.root / role
        role_dir.mkdir(exist_ok=True)
        tmp = role_dir / f".tmp-{os.getpid()}-{time.monotonic_ns()}"
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
            with self._lock():
                existing = self.versions(role)
                k = int(existing[-1][1:]) + 1 if existing else 1
                version = f"v{k}"
                manifest = {
                    "role": role, "version": version, "base_fingerprint": base_fingerprint, "parent": parent,
                    "run_id": run_id, "metrics": dict(metrics or {}), "created": _now(),
                }
                _write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True))
                os.rename(tmp, role_dir / version)
                _fsync_dir(role_dir)
            return version
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    # ---- aliases -------------------------------------------------------------------------------
    def _read_aliases(self) -> dict[str, Any]:
        p = self.root / ALIASES
        if not p.exists():
            return {"aliases": {}, "history": {}, "log": []}
        try:
            data = json.loads(p.read_text())
        except ValueError as e:
            raise RegistryError(f"corrupt alias file {p}: {e}; restore it from backup or delete it") from e
        data.setdefault("aliases", {})
        data.setdefault("history", {})
        data.setdefault("log", [])
        return data

    def aliases(self) -> dict[str, dict[str, str]]:
        """Every alias and the versions it maps."""
        return self._read_aliases()["aliases"]

    def alias(self, alias: str) -> dict[str, str]:
        """``{role: version}`` of an alias (empty if it was never set)."""
        return dict(self._read_aliases()["aliases"].get(alias, {}))

    def set_alias(self, alias: str, mapping: dict[str, str], *, reason: str = "") -> dict[str, str]:
        """Point `alias` at versions for the given roles (other roles keep theirs); returns the new map."""
        _check_name(alias, "alias")
        if _VERSION.match(alias) or alias == "latest":
            raise RegistryError(f"alias name {alias!r} would shadow a version reference; pick another name")
        resolved = {role: self.resolve(role, ref) for role, ref in mapping.items()}
        with self._lock():
            data = self._read_aliases()
            old = dict(data["aliases"].get(alias, {}))
            new = {**old, **resolved}
            if new != old:
                data["history"].setdefault(alias, []).append(old)
                data["aliases"][alias] = new
                data["log"].append({"at": _now(), "alias": alias, "from": old, "to": new, "reason": reason})
                _write_atomic(self.root / ALIASES, json.dumps(data, indent=2, sort_keys=True))
            return new

    def promote(self, mapping: dict[str, str], *, reason: str = "", alias: str = "live") -> dict[str, str]:
        """Make the given versions live (recorded with `reason`; undo with `rollback`)."""
        return self.set_alias(alias, mapping, reason=reason or "promote")

    def rollback(self, alias: str = "live", *, reason: str = "rollback") -> dict[str, str]:
        """Restore the alias's previous map; repeated calls go further back. Returns the restored map."""
        with self._lock():
            data = self._read_aliases()
            stack = data["history"].get(alias, [])
            if not stack:
                raise RegistryError(f"alias {alias!r} has no earlier state to roll back to in {self.root}")
            old = data["aliases"].get(alias, {})
            new = stack.pop()
            if new:
                data["aliases"][alias] = new
            else:
                data["aliases"].pop(alias, None)
            data["log"].append({"at": _now(), "alias": alias, "from": old, "to": new, "reason": reason})
            _write_atomic(self.root / ALIASES, json.dumps(data, indent=2, sort_keys=True))
            return dict(new)

    def log(self) -> list[dict[str, Any]]:
        """Every alias change (promotions and rollbacks), oldest first."""
        return list(self._read_aliases()["log"])
