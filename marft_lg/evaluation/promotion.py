"""Promote and roll back: flip a registry alias (``live``) and hot-swap a running server, keeping one invariant:

    what a server serves == the registry alias it follows (a role the alias does not name: its
    initial adapter), or the command fails with an error saying which side holds what.

How a flip runs (`promote` and `rollback` alike):

1. everything is validated before anything is written: the versions resolve, lie inside the registry
   (a version directory that is a symlink out of it is refused) and their files verify against the
   hashes recorded at save time; the alias file's revision is read;
2. with ``server_url``, the server is asked what it serves (``GET /v1/adapters``) and each adapter slot
   that differs from the new map is hot-swapped (``POST /v1/load_lora_adapter``; ``{"version": "init"}``
   for the initial adapter). If the server refuses one, the slots already swapped are swapped back and
   nothing is written;
3. only then is the alias written, compare-and-swap: if the alias file changed since step 1 (another
   promotion ran), nothing is written and the server is put back to what the alias says now;
4. the server is asked again; if it cannot be asked or does not serve the alias, the alias has still moved: the
   record is written and `ServerNotConfirmed` says so, with what the server may be serving.

Promotions hold ``<registry>/.promote.lock`` from step 1 to 4, so two promotions never interleave.
Every promotion and rollback is appended to ``<registry>/promotions.jsonl`` with its reason and the gate
decision that allowed it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from marft_lg.evaluation.gate import GateDecision

RECORDS = "promotions.jsonl"
FRESH = "init"  # the version name of a role's initial adapter (marft_lg.serving.team.FRESH)
PROMOTE_LOCK = ".promote.lock"


class PromotionError(RuntimeError):
    """A promotion or rollback that did not happen; the message says why and what to do."""


class ServerNotConfirmed(PromotionError):
    """The alias moved (and was recorded), but the server's follow-up check failed: `record` says what moved."""

    def __init__(self, message: str, record: PromotionRecord):
        super().__init__(message)
        self.record = record


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
    server_check: str | None = None  # why the follow-up check failed after the alias moved; None: it agreed
    at: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _append_record(registry: Any, record: PromotionRecord, run_dir: str | Path | None) -> None:
    from marft_lg._durable import append_durable, write_atomic
    from marft_lg.tracking.lineage import record_alias_change

    append_durable(Path(registry.root) / RECORDS, json.dumps(record.to_dict(), default=str) + "\n")
    record_alias_change(registry, record.to_dict())  # lineage, and MLflow's model registry aliases (best effort)
    if run_dir is not None:
        out = Path(run_dir) / f"{record.action}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out, json.dumps(record.to_dict(), indent=2, default=str))


class _Server:
    """A running ``marft-lg serve`` (or vLLM) server, through its OpenAI-compatible adapter endpoints."""

    def __init__(self, url: str, api_key: str | None, timeout_s: float):
        import httpx

        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)

    def __enter__(self) -> _Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close()

    def _call(self, method: str, path: str, what: str, **kwargs: Any) -> Any:
        import httpx

        try:
            return self.client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise PromotionError(f"could not reach {self.url} to {what}: {exc}; is the server running?") from exc

    def state(self) -> dict[str, Any] | None:
        """``GET /v1/adapters`` (what each slot serves, the alias it follows), or None for a server
        without that endpoint (vLLM)."""
        resp = self._call("GET", "/v1/adapters", "ask what it serves")
        if resp.status_code == 404:
            return None
        if resp.status_code >= 400:
            raise PromotionError(f"{self.url} did not say what it serves (HTTP {resp.status_code}): {resp.text[:300]}")
        try:
            body = resp.json()
        except ValueError:
            body = None
        if not isinstance(body, dict) or not isinstance(body.get("adapters"), dict):
            raise PromotionError(f"{self.url} answered GET /v1/adapters with {resp.text[:200]!r}, not a version map")
        return body

    def load(self, registry: Any, slot: str, version: str) -> None:
        if version == FRESH:
            body: dict[str, Any] = {"lora_name": slot, "version": FRESH}
        else:
            body = {"lora_name": slot, "lora_path": str(registry.path(slot, version)), "load_inplace": True}
        resp = self._call("POST", "/v1/load_lora_adapter", f"load {slot}@{version}", json=body)
        if resp.status_code >= 400:
            hint = " (a server without marft's /v1/adapters cannot go back to an initial adapter: restart it)" \
                if version == FRESH else ""
            raise PromotionError(f"{self.url} refused to load {slot}@{version} (HTTP {resp.status_code}): "
                                 f"{_error_text(resp)}{hint}")

    def load_all(self, registry: Any, versions: Mapping[str, str]) -> None:
        for slot, version in versions.items():
            self.load(registry, slot, version)


def _error_text(resp: Any) -> str:
    try:
        return str(resp.json()["error"]["message"])[:500]
    except Exception:  # noqa: BLE001 - not the OpenAI error shape
        return resp.text[:500]


def hot_swap(server_url: str, registry: Any, versions: Mapping[str, str], *, api_key: str | None = None,
             timeout_s: float = 120.0) -> dict[str, str]:
    """Tell a running server (``marft-lg serve`` or vLLM) to serve `versions` now, one role at a time,
    via ``POST /v1/load_lora_adapter``; returns the roles swapped. Raises on the first refusal."""
    swapped: dict[str, str] = {}
    with _Server(server_url, api_key, timeout_s) as server:
        for role, version in versions.items():
            server.load(registry, role, version)
            swapped[role] = version
    return swapped


def _serving_target(after: Mapping[str, str], slots: list[str]) -> dict[str, str]:
    """What a server with these slots must serve for an alias map: initial adapters where it names none."""
    return {slot: after.get(slot, FRESH) for slot in slots}


def _flip(registry: Any, alias: str, before: dict[str, str], after: dict[str, str], changed: list[str],
          write: Callable[[], dict[str, str]], server_url: str | None, api_key: str | None,
          timeout_s: float) -> tuple[dict[str, str], dict[str, str], str | None, dict[str, str]]:
    """Swap the server to `after`, then `write()` the alias; undo the swap if the write fails. Returns the alias
    map written, the slots swapped, why the follow-up check failed (None: it agreed) and what was swapped to."""
    from marft_lg.serving.errors import ServingError

    if not server_url:
        try:
            return write(), {}, None, {}
        except (ServingError, OSError) as exc:
            raise PromotionError(f"{exc}; nothing changed") from exc
    with _Server(server_url, api_key, timeout_s) as server:
        state = server.state()
        if state is not None:
            theirs = state.get("registry")
            if theirs and Path(theirs).resolve() != Path(registry.root).resolve():
                raise PromotionError(f"{server.url} serves adapters of registry {theirs}, not of {registry.root}; "
                                     "nothing changed")
            if state.get("follows") not in (None, alias):
                raise PromotionError(f"{server.url} follows alias {state['follows']!r}, not {alias!r}; nothing "
                                     f"changed (flip {state['follows']!r}, or restart it with --versions {alias})")
            served = {str(k): str(v) for k, v in state["adapters"].items()}
            missing = [r for r in changed if r not in served]
            if missing:
                raise PromotionError(f"{server.url} does not serve {missing} (it serves {sorted(served)}); nothing "
                                     f"changed: alias {alias!r} still maps {before}")
            target = _serving_target(after, list(served))
        else:  # vLLM: no way to ask; assume it served `before`
            roles = sorted(set(before) | set(after))
            served = _serving_target(before, roles)
            target = _serving_target(after, roles)
        todo = {slot: v for slot, v in target.items() if served.get(slot) != v}
        done: dict[str, str] = {}
        try:
            for slot, version in todo.items():
                server.load(registry, slot, version)
                done[slot] = version
        except PromotionError as exc:
            try:
                server.load_all(registry, {slot: served[slot] for slot in done})
            except PromotionError as again:
                raise PromotionError(f"{exc}; alias {alias!r} was not changed (it maps {before}) but the server could "
                                     f"not be swapped back ({again}): restart it to serve {before}") from exc
            raise PromotionError(f"{exc}; nothing changed: alias {alias!r} still maps {before} and the server was "
                                 "left as it was") from exc
        try:
            written = write()
        except (ServingError, OSError) as exc:
            try:  # put the server back to what the alias says now (another promotion may have changed it)
                now = registry.alias(alias)
                back = _serving_target(now, list(target))
                server.load_all(registry, {s: v for s, v in back.items() if target.get(s) != v})
            except (PromotionError, ServingError, OSError) as again:
                raise PromotionError(f"{exc}; the server, already swapped to {target}, could not be swapped back "
                                     f"({again}): restart it so that it serves alias {alias!r} again") from exc
            raise PromotionError(f"{exc}; the server was swapped back: nothing changed") from exc
        if state is not None:
            try:
                check = server.state() or {}
            except PromotionError as exc:
                return written, done, f"the server could not be asked what it serves ({exc})", target
            now_serving = {str(k): str(v) for k, v in (check.get("adapters") or {}).items()}
            want = _serving_target(written, list(served))
            if now_serving != want:
                return written, done, f"it serves {now_serving}, not {want}", target
        return written, done, None, target


def _recorded(record: PromotionRecord, registry: Any, run_dir: str | Path | None, target: dict[str, str]) -> None:
    """Append `record`; if the server's follow-up check failed, raise `ServerNotConfirmed` saying the alias moved."""
    _append_record(registry, record, run_dir)
    if record.server_check is None:
        return
    url = record.server_url
    raise ServerNotConfirmed(
        f"alias {record.alias!r} moved: it now maps {record.after} (was {record.before}; recorded in "
        f"{Path(registry.root) / RECORDS}), but the follow-up check of {url} failed: {record.server_check}. "
        f"The server was swapped to {target} before the alias moved, so it serves that if it is still up; "
        f"restarted, it serves alias {record.alias!r} as it is now. Check with GET {url}/v1/adapters; "
        "`marft-lg rollback` undoes the move", record)


def _promotion_lock(registry: Any):
    from marft_lg.serving.engine.models import _file_lock

    return _file_lock(Path(registry.root) / PROMOTE_LOCK, timeout_s=300.0)


def _validated(registry: Any, mapping: Mapping[str, str], what: str) -> None:
    """Every version resolves, lies inside the registry and verifies (before anything is written)."""
    from marft_lg.serving.errors import AdapterIntegrityError

    for role, version in mapping.items():
        try:
            registry.verify(role, version)
        except AdapterIntegrityError as exc:
            raise PromotionError(f"refusing to {what} {role}@{version}: {exc}; nothing changed") from exc


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
    timeout_s: float = 120.0,
) -> PromotionRecord:
    """Point `alias` at `versions` (a ``{role: ref}`` map or another alias, e.g. ``"candidate"``)
    and hot-swap `server_url` if given. A gate decision that rejected refuses unless `force`.

    Raises `PromotionError` (nothing changed, or exactly what did) for a damaged version, a version
    outside the registry, a server that refuses, or an alias another promotion changed meanwhile;
    `ServerNotConfirmed` (recorded) when the alias moved but the server's follow-up check failed."""
    from marft_lg.serving.errors import ServingError

    if decision is not None and not decision.promote and not force:
        raise PromotionError("the gate rejected this candidate:\n  - " + "\n  - ".join(decision.reasons)
                             + "\npass --force to promote anyway (recorded as forced)")
    why = reason or ("gate: promote" if decision is not None else "manual promote")
    if force and decision is not None and not decision.promote:
        why = f"FORCED over gate rejection: {why}"
    try:
        with _promotion_lock(registry):
            revision = registry.alias_revision()
            before = registry.alias(alias)
            if isinstance(versions, str):
                mapping = registry.alias(versions)
            elif isinstance(versions, Mapping):
                mapping = dict(versions)
            else:
                raise PromotionError(f"versions must be an alias name or a {{role: version}} map, got "
                                     f"{type(versions).__name__} {versions!r:.80}")
            if not mapping:
                raise PromotionError(f"alias {versions!r} maps no versions in {registry.root}; nothing to promote")
            mapping = {r: registry.resolve(r, ref) for r, ref in mapping.items()}
            _validated(registry, mapping, "promote")
            after = {**before, **mapping}
            changed = [r for r in mapping if before.get(r) != mapping[r]]
            written, swapped, problem, target = _flip(
                registry, alias, before, after, changed,
                lambda: registry.promote(mapping, reason=why, alias=alias, expect_revision=revision),
                server_url, api_key, timeout_s)
    except (ServingError, TimeoutError) as exc:
        raise PromotionError(f"{exc}; nothing changed") from exc
    record = PromotionRecord("promote", alias, before, written, why, server_url, swapped,
                             None if decision is None else decision.to_dict(), server_check=problem)
    _recorded(record, registry, run_dir, target)
    return record


def rollback(
    registry: Any,
    *,
    alias: str = "live",
    reason: str = "rollback",
    server_url: str | None = None,
    api_key: str | None = None,
    run_dir: str | Path | None = None,
    timeout_s: float = 120.0,
) -> PromotionRecord:
    """Restore exactly the versions `alias` mapped before its last change, and hot-swap the server
    (roles the restored map does not name go back to their initial adapters, ``live = {}`` included)."""
    from marft_lg.serving.errors import ServingError

    try:
        with _promotion_lock(registry):
            try:
                revision = registry.alias_revision()
                before = registry.alias(alias)
                after = registry.peek_rollback(alias)
            except (ServingError, OSError) as exc:
                raise PromotionError(f"cannot roll back {alias!r}: {exc}") from exc
            _validated(registry, after, "roll back to")
            changed = sorted(r for r in set(before) | set(after) if before.get(r) != after.get(r))
            written, swapped, problem, target = _flip(
                registry, alias, before, after, changed,
                lambda: registry.rollback(alias, reason=reason, expect_revision=revision),
                server_url, api_key, timeout_s)
    except (ServingError, TimeoutError) as exc:
        raise PromotionError(f"cannot roll back {alias!r}: {exc}") from exc
    record = PromotionRecord("rollback", alias, before, written, reason, server_url, swapped, server_check=problem)
    _recorded(record, registry, run_dir, target)
    return record


def read_records(registry: Any) -> list[dict[str, Any]]:
    """Every promotion/rollback record of a registry, oldest first."""
    p = Path(registry.root) / RECORDS
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
