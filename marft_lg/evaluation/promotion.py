"""Promote and roll back: flip the registry's `live` alias atomically, then hot-swap a running server.

A promotion that the server refuses is undone (alias restored, already-swapped roles swapped back),
so the registry and the server never disagree silently. Every promotion and rollback is appended
to ``<registry>/promotions.jsonl`` with its reason and the gate decision that allowed it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from marft_lg.evaluation.gate import GateDecision

RECORDS = "promotions.jsonl"


class PromotionError(RuntimeError):
    """A promotion or rollback that did not happen; the message says why and what to do."""


@dataclass
class PromotionRecord:
    """What changed: the alias map before and after, the server swap, and why."""

    action: str  # "promote" | "rollback"
    alias: str
    before: dict[str, str]
    after: dict[str, str]
    reason: str
    server_url: str | None = None
    swapped: dict[str, str] = field(default_factory=dict)
    decision: dict[str, Any] | None = None
    at: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _append_record(registry: Any, record: PromotionRecord, run_dir: str | Path | None) -> None:
    line = json.dumps(record.to_dict(), default=str) + "\n"
    with open(Path(registry.root) / RECORDS, "a") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())
    if run_dir is not None:
        out = Path(run_dir) / f"{record.action}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(record.to_dict(), indent=2, default=str))
        tmp.replace(out)


def hot_swap(server_url: str, registry: Any, versions: Mapping[str, str], *, api_key: str | None = None,
             timeout_s: float = 120.0) -> dict[str, str]:
    """Tell a running server (``marft-lg serve`` or vLLM) to serve `versions` now, one role at a time,
    via ``POST /v1/load_lora_adapter``; returns the roles swapped. Raises on the first refusal."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    swapped: dict[str, str] = {}
    with httpx.Client(base_url=server_url.rstrip("/"), headers=headers, timeout=timeout_s) as client:
        for role, version in versions.items():
            body = {"lora_name": role, "lora_path": str(registry.path(role, version)), "load_inplace": True}
            try:
                resp = client.post("/v1/load_lora_adapter", json=body)
            except httpx.HTTPError as exc:
                raise PromotionError(f"could not reach {server_url} to load {role}@{version}: {exc}; is the server "
                                     f"running (marft-lg serve --registry {registry.root})?") from exc
            if resp.status_code >= 400:
                raise PromotionError(f"{server_url} refused to load {role}@{version} (HTTP {resp.status_code}): "
                                     f"{resp.text[:500]}")
            swapped[role] = version
    return swapped


def _swap_or_undo(registry: Any, alias: str, before: dict[str, str], after: dict[str, str], server_url: str | None,
                  api_key: str | None, undo: Any) -> dict[str, str]:
    if not server_url:
        return {}
    changed = {r: v for r, v in after.items() if before.get(r) != v}
    try:
        return hot_swap(server_url, registry, changed, api_key=api_key)
    except PromotionError as exc:
        undo()
        restore = {r: before[r] for r in changed if r in before}
        try:
            hot_swap(server_url, registry, restore, api_key=api_key)
        except PromotionError as again:
            raise PromotionError(f"{exc}; alias {alias!r} was restored to {before} but the server could not be "
                                 f"swapped back ({again}): restart it to serve {before}") from exc
        raise PromotionError(f"{exc}; nothing changed: alias {alias!r} and the server still serve {before}") from exc


def promote(
    registry: Any,
    versions: Mapping[str, str] | str,
    *,
    reason: str = "",
    alias: str = "live",
    decision: GateDecision | None = None,
    force: bool = False,
    server_url: str | None = None,
    api_key: str | None = None,
    run_dir: str | Path | None = None,
) -> PromotionRecord:
    """Point `alias` at `versions` (a ``{role: ref}`` map or another alias, e.g. ``"candidate"``)
    and hot-swap `server_url` if given. A gate decision that rejected refuses unless `force`."""
    if decision is not None and not decision.promote and not force:
        raise PromotionError("the gate rejected this candidate:\n  - " + "\n  - ".join(decision.reasons)
                             + "\npass --force to promote anyway (recorded as forced)")
    mapping = registry.alias(versions) if isinstance(versions, str) else dict(versions)
    if not mapping:
        raise PromotionError(f"alias {versions!r} maps no versions in {registry.root}; nothing to promote")
    mapping = {r: registry.resolve(r, ref) for r, ref in mapping.items()}
    before = registry.alias(alias)
    why = reason or ("gate: promote" if decision is not None else "manual promote")
    if force and decision is not None and not decision.promote:
        why = f"FORCED over gate rejection: {why}"
    after = registry.promote(mapping, reason=why, alias=alias)
    swapped = _swap_or_undo(registry, alias, before, after, server_url, api_key,
                            lambda: registry.rollback(alias, reason=f"undo failed promotion: {why}"))
    record = PromotionRecord("promote", alias, before, after, why, server_url, swapped,
                             None if decision is None else decision.to_dict())
    _append_record(registry, record, run_dir)
    return record


def rollback(
    registry: Any,
    *,
    alias: str = "live",
    reason: str = "rollback",
    server_url: str | None = None,
    api_key: str | None = None,
    run_dir: str | Path | None = None,
) -> PromotionRecord:
    """Restore exactly the versions `alias` mapped before its last change, and hot-swap the server."""
    before = registry.alias(alias)
    try:
        after = registry.rollback(alias, reason=reason)
    except Exception as exc:
        raise PromotionError(f"cannot roll back {alias!r}: {exc}") from exc
    swapped = _swap_or_undo(registry, alias, before, after, server_url, api_key,
                            lambda: registry.set_alias(alias, before, reason=f"undo failed rollback: {reason}"))
    record = PromotionRecord("rollback", alias, before, after, reason, server_url, swapped)
    _append_record(registry, record, run_dir)
    return record


def read_records(registry: Any) -> list[dict[str, Any]]:
    """Every promotion/rollback record of a registry, oldest first."""
    p = Path(registry.root) / RECORDS
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
