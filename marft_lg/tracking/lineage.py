"""Adapter lineage: where each registry version came from, and the trackers that must follow its aliases.

Every published version gets a lineage record (role, base model name and hash, training run, iteration, parent
version, the data window it was trained on, its metrics), appended to ``<registry>/lineage.jsonl`` and logged to
the run's trackers; every promotion or rollback appends what changed and the gate decision behind it. A registry
whose versions were logged to MLflow remembers those stores in ``<registry>/tracking.json``; a promotion or
rollback then registers the versions in each store's model registry (one registered model ``marft-<role>`` per
role) and moves the MLflow alias to agree with the registry's (`live` on both sides).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from marft_lg._durable import append_line, write_atomic

log = logging.getLogger("marft_lg.tracking")

LINEAGE = "lineage.jsonl"
STORES = "tracking.json"
FRESH = "init"  # a role's initial adapter: not a registry version (marft_lg.serving.team.FRESH)


def model_name(role: str) -> str:
    """The MLflow registered model of a role's adapters."""
    return f"marft-{role}"


def data_window(dataset: Any, source: str | None = None) -> dict[str, Any]:
    """The episodes a run learnt from: how many, the first start and last end time (and where they came from)."""
    eps = dataset.episodes
    out: dict[str, Any] = {"episodes": len(dataset)}
    for key, col, pick in (("start", "start_time", "min"), ("end", "end_time", "max")):
        if col in eps.columns and len(eps):
            import pandas as pd

            value = getattr(pd.to_datetime(eps[col], utc=True, errors="coerce"), pick)()
            out[key] = None if pd.isna(value) else value.isoformat()
    if source:
        out["source"] = source
    return out


def adapter_lineage(registry: Any, role: str, version: str, **extra: Any) -> dict[str, Any]:
    """A version's lineage from its manifest (base model, hashes, run, parent, metrics) plus `extra` (iteration,
    data window)."""
    m = registry.manifest(role, version)
    files = (m.get("integrity") or {}).get("files") or {}
    weights = files.get("adapter_model.safetensors") or {}
    return {"role": role, "version": version, "registry": str(registry.root), "base_model": m.get("base_name"),
            "base_hash": m.get("base_hash"), "base_fingerprint": m.get("base_fingerprint"),
            "run_id": m.get("run_id"), "parent": m.get("parent"), "metrics": m.get("metrics") or {},
            "created": m.get("created"), "adapter_sha256": weights.get("sha256"), **extra}


def read_lineage(registry_root: str | Path) -> list[dict[str, Any]]:
    """Every lineage record of a registry, oldest first (a damaged line is skipped)."""
    p = Path(registry_root) / LINEAGE
    out = []
    if p.exists():
        for line in p.read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def record_published(tracker: Any, registry: Any, role: str, version: str, *, iteration: int | None = None) -> None:
    """A published version's lineage: into the registry's lineage.jsonl and the run's trackers. Never raises
    (lineage must not stop training): a failure is one warning."""
    try:
        lineage = adapter_lineage(registry, role, version, iteration=iteration,
                                  data_window=tracker.context.get("data_window"))
        append_line(Path(registry.root) / LINEAGE, json.dumps({"event": "published", **lineage}, default=str))
        tracker.log_adapter(lineage, registry.path(role, version))
    except Exception as exc:
        log.warning("lineage of %s@%s not recorded (%s: %s)", role, version, type(exc).__name__, exc)


def remember_store(registry_root: str | Path, uri: str, role: str, version: str, where: Mapping[str, str]) -> None:
    """Note in ``<registry>/tracking.json`` that `uri` holds `role@version` (run id, artifact source)."""
    p = Path(registry_root) / STORES
    data = _stores(Path(registry_root))
    data.setdefault("mlflow", {}).setdefault(uri, {})[f"{role}/{version}"] = dict(where)
    write_atomic(p, json.dumps(data, indent=2, sort_keys=True))


def _stores(root: Path) -> dict[str, Any]:
    try:
        data = json.loads((root / STORES).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def record_alias_change(registry: Any, record: Mapping[str, Any]) -> None:
    """A promotion or rollback (a `PromotionRecord` as a dict): one lineage line per role whose version changed,
    then every MLflow store that logged this registry's versions moves its alias the same way. Never raises."""
    try:
        before, after = dict(record.get("before") or {}), dict(record.get("after") or {})
        changed = sorted(r for r in set(before) | set(after) if before.get(r) != after.get(r))
        for role in changed:
            line = {"event": record.get("action"), "role": role, "version": after.get(role),
                    "previous": before.get(role), "alias": record.get("alias"), "reason": record.get("reason"),
                    "decision": record.get("decision"), "at": record.get("at")}
            append_line(Path(registry.root) / LINEAGE, json.dumps(line, default=str))
        for uri, known in (_stores(Path(registry.root)).get("mlflow") or {}).items():
            try:
                sync_mlflow_alias(registry, uri, known, str(record.get("alias")), changed, after, record)
            except Exception as exc:  # the registry flip happened; the mirror is best effort
                log.warning("MLflow model registry at %s not updated (%s: %s); the adapter registry is", uri,
                            type(exc).__name__, exc)
    except Exception as exc:
        log.warning("lineage of the %s not recorded (%s: %s)", record.get("action"), type(exc).__name__, exc)


def sync_mlflow_alias(registry: Any, uri: str, known: Mapping[str, Any], alias: str, roles: list[str],
                      after: Mapping[str, str], record: Mapping[str, Any]) -> None:
    """For each role: its version registered in `uri`'s model registry and the alias pointed at it (or removed
    when the alias no longer names a version of the role)."""
    from marft_lg.tracking.mlflow_backend import client_for

    client = client_for(uri)
    for role in roles:
        name, version = model_name(role), after.get(role)
        if version is None or version == FRESH:
            with contextlib.suppress(Exception):  # no such model or alias: nothing to remove
                client.delete_registered_model_alias(name, alias)
            continue
        mv = _model_version(client, registry, uri, role, version, known.get(f"{role}/{version}"))
        client.set_registered_model_alias(name, alias, mv)
        if record.get("decision") is not None and record.get("action") == "promote":
            decision = record["decision"]
            client.set_model_version_tag(name, mv, "gate_decision", str(decision.get("decision")))
            client.set_model_version_tag(name, mv, "promoted_by",
                                         json.dumps(decision, default=str)[:4900])


def _model_version(client: Any, registry: Any, uri: str, role: str, version: str,
                   logged: Mapping[str, Any] | None) -> str:
    """The MLflow model version of ``role@version`` (registered now if it is not yet), as a string."""
    name = model_name(role)
    try:
        client.get_registered_model(name)
    except Exception:
        client.create_registered_model(name, description=f"marft_lg LoRA adapters of role {role!r}")
    for mv in client.search_model_versions(f"name='{name}'"):
        if mv.tags.get("registry_version") == version and mv.tags.get("registry") == str(registry.root):
            return str(mv.version)
    if logged is None:  # promoted without a tracked run in this store: log the version into a run of its own
        logged = _log_version(client, registry, uri, role, version)
    lineage = adapter_lineage(registry, role, version)
    tags = {"registry": str(registry.root), "registry_version": version, "role": role,
            "base_model": str(lineage["base_model"]), "base_hash": str(lineage["base_hash"]),
            "parent": str(lineage["parent"]), "training_run": str(lineage["run_id"])}
    mv = client.create_model_version(name, source=logged["source"], run_id=logged.get("run_id"), tags=tags,
                                     description=f"{role}@{version} of adapter registry {registry.root}")
    return str(mv.version)


def _log_version(client: Any, registry: Any, uri: str, role: str, version: str) -> dict[str, str]:
    """A run ``register <role>@<version>`` holding the version's files (the model version's source)."""
    from marft_lg.tracking.mlflow_backend import experiment_id, experiment_name

    exp = experiment_id(client, experiment_name(), None)
    run = client.create_run(exp, run_name=f"register {role}@{version}")
    where = f"adapters/{role}/{version}"
    client.log_artifacts(run.info.run_id, str(registry.path(role, version)), where)
    client.set_terminated(run.info.run_id)
    logged = {"run_id": run.info.run_id, "source": f"{run.info.artifact_uri}/{where}"}
    remember_store(registry.root, uri, role, version, logged)
    return logged
