"""A team of agents served from ONE base model: one LoRA adapter per role (or one shared adapter).

`Team` maps each role to the adapter it currently serves (named ``"<role>@<version>"``), counts
in-flight requests per adapter and makes hot swaps safe on any engine: `load_version` loads the new
adapter beside the old one, switches the role's pointer, and unloads the old adapter only once the
last request using it has finished.

A ``{role: model spec}`` mapping is accepted when its specs resolve to one model directory. Several base models in
one team: ``team({"planner": "embedded:smollm2-135m-instruct", "writer": "/models/x"})``
(`marft_lg.serving.team_factory.team`) builds a `marft_lg.serving.mixed_team.MixedTeam` (one `Team` per base, the
same API). `bases`, `base_of`, `team_of` and `tokenizer_for` answer the same on both, so callers need not tell
them apart.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from marft_lg.loading import role_problem
from marft_lg.serving.engine.models import DEFAULT_MODEL, model_content_hash, model_fingerprint, resolve_model
from marft_lg.serving.engine.streaming import streams
from marft_lg.serving.errors import RegistryError, UnknownAgentError
from marft_lg.serving.registry.lora import LoraSettings, write_fresh_adapter
from marft_lg.serving.registry.store import AdapterRegistry
from marft_lg.serving.types import ChatRequest, Completion, TokenListener

FRESH = "init"  # the version name of a freshly initialised adapter
SHARED = "shared"  # the registry role of the one adapter all roles use with shared_adapter=True
_UNSET: Any = object()


ModelSpec = str | os.PathLike
"""One base model: ``embedded:NAME`` or a local transformers directory."""


def base_model_name(spec: ModelSpec, model_dir: Path) -> str:
    """The name a base model is served under: an embedded spec as written, else its directory's name."""
    return str(spec) if str(spec).startswith("embedded:") else Path(model_dir).name


def plan_bases(model: Mapping[str, ModelSpec], agents: list[str] | tuple[str, ...] = ()
               ) -> tuple[list[str], list[tuple[ModelSpec, Path, list[str]]]]:
    """A ``{role: model spec}`` mapping -> (the roles in mapping order, one ``(spec, model_dir, roles)`` per distinct
    base directory, in the order its first role appears).

    Specs that resolve to the same directory share one base (the first role's spec names it). `agents`, when
    given, must name exactly the mapping's roles (a ValueError says which differ).
    """
    if not isinstance(model, Mapping) or not model:
        raise ValueError("a model mapping needs at least one {role: model spec} entry, e.g. "
                         "{'planner': 'embedded:smollm2-135m-instruct'}")
    roles = list(model)
    for role in roles:
        spec = model[role]
        if not isinstance(spec, (str, os.PathLike)) or not str(spec):
            raise ValueError(f"model of role {role!r} must be a model spec (embedded:NAME or a local directory), "
                             f"got {type(spec).__name__} {spec!r:.80}")
    agents = list(agents)
    if agents and (sorted(agents) != sorted(roles) or len(set(agents)) != len(agents)):
        missing = [r for r in roles if r not in agents]
        extra = [a for a in agents if a not in roles]
        raise ValueError(f"agents {agents} do not match the roles of the model mapping {roles} "
                         f"(missing {missing}, not in the mapping {extra}); omit agents or list the same roles")
    groups: dict[Path, tuple[ModelSpec, Path, list[str]]] = {}
    for role in roles:
        model_dir = resolve_model(model[role])
        key = model_dir.resolve()
        if key not in groups:
            groups[key] = (model[role], model_dir, [])
        groups[key][2].append(role)
    return roles, list(groups.values())


def _check_versions(versions: Any) -> str | dict[str, str] | None:
    """`versions` must be an alias name, a ``{role: ref}`` map of strings, or None; anything else
    (``versions: 5`` in a YAML file) is an error rather than a silent "start every role fresh"."""
    if versions is None or (isinstance(versions, str) and versions):
        return versions
    if isinstance(versions, dict) and all(isinstance(k, str) and isinstance(v, str) and v for k, v in versions.items()):
        return dict(versions)
    raise ValueError(f"versions must be an alias name (e.g. 'live'), a {{role: version}} map of strings "
                     f"(e.g. {{planner: v3}}), or null for fresh adapters; got {type(versions).__name__} {versions!r:.80}")


class Team:
    """One base model + one LoRA adapter per agent role, behind a batched, thread-safe `chat`.

    versions: "live" (or any alias) takes each role's version from the registry alias, roles the
    alias lacks start fresh; None starts every role fresh; ``{role: ref}`` pins versions (refs the
    registry cannot resolve are an error). Default: "live" with a registry, None without.

    `model` may also be a ``{role: model spec}`` mapping on one base (then `agents` may be omitted, or must name
    the same roles); a mapping over several bases is `team(...)`'s (`team_factory`), which builds a `MixedTeam`.
    """

    def __init__(self, model: ModelSpec | Mapping[str, ModelSpec] = DEFAULT_MODEL,
                 agents: list[str] | tuple[str, ...] = (), *,
                 engine: str | Any = "hf", shared_adapter: bool = False,
                 registry: AdapterRegistry | str | os.PathLike | None = None,
                 versions: str | dict[str, str] | None = _UNSET, lora: LoraSettings | None = None, seed: int = 0,
                 model_name: str | None = None, engine_options: dict[str, Any] | None = None):
        if isinstance(model, Mapping):
            agents, groups = plan_bases(model, agents)
            if len(groups) > 1:
                raise ValueError(f"the model mapping puts the roles on {len(groups)} base models; a Team serves one "
                                 "base: use marft_lg.team(...), which builds a MixedTeam (a Team per base) for it")
            model = groups[0][0]
        agents = list(agents)
        if not agents:
            raise ValueError("a Team needs at least one agent role, e.g. agents=['planner', 'writer']")
        for role in agents:
            if role_problem(role):
                raise ValueError(role_problem(role))
        if len(set(agents)) != len(agents):
            raise ValueError(f"duplicate agent roles in {agents}")
        self._agents = agents
        self.shared_adapter = shared_adapter
        self.lora = lora or LoraSettings()
        self.seed = seed
        self.model_dir = resolve_model(model)
        self.fingerprint = model_fingerprint(self.model_dir)
        self.model_name = model_name or base_model_name(model, self.model_dir)
        self._base_hash: str | None = None
        self.registry = registry if isinstance(registry, AdapterRegistry) or registry is None else AdapterRegistry(registry)
        self.engine = self._make_engine(engine, engine_options or {})
        self._lock = threading.RLock()
        self._current: dict[str, str] = {}  # slot -> adapter name
        self._inflight: Counter[str] = Counter()
        self._retired: set[str] = set()
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._tokenizer: Any = None
        self._shapes: dict[str, Any] | None = None
        if versions is _UNSET:
            versions = "live" if self.registry is not None else None
        versions = _check_versions(versions)
        self.follows: str | None = versions if isinstance(versions, str) else None
        """The registry alias this team was started from (``"live"``), None when versions were pinned."""
        try:
            self._load_initial(versions)
        except BaseException:
            self.engine.close()
            raise

    # ---- construction --------------------------------------------------------------------------
    def _make_engine(self, engine: str | Any, options: dict[str, Any]):
        if not isinstance(engine, str):
            return engine
        if engine == "hf":
            from marft_lg.serving.engine.hf import HFEngine

            return HFEngine(self.model_dir, model_name=self.model_name, seed=self.seed, **options)
        if engine == "vllm":
            from marft_lg.serving.engine.vllm import VLLMEngine

            return VLLMEngine(self.model_dir, **{"served_model_name": self.model_name, **options})
        raise ValueError(f"unknown engine {engine!r}; use 'hf' (embedded transformers + peft) or 'vllm'")

    def _slot(self, role: str) -> str:
        if role not in self._agents:
            raise UnknownAgentError(role, self._agents)
        return SHARED if self.shared_adapter else role

    def slot(self, role: str) -> str:
        """The adapter slot a role uses: the role itself, or ``"shared"`` with a shared adapter."""
        return self._slot(role)

    def slots(self) -> list[str]:
        """The adapter slots: the roles, or just ``"shared"`` with a shared adapter."""
        return [SHARED] if self.shared_adapter else list(self._agents)

    def _load_initial(self, versions: str | dict[str, str] | None) -> None:
        for slot in self.slots():
            ref: str | None = None
            if isinstance(versions, dict):
                refs = {versions[r] for r in self._agents if r in versions} if slot == SHARED else set()
                ref = versions.get(slot) or (refs.pop() if len(refs) == 1 else None)
                if slot == SHARED and len(refs) > 1:
                    raise ValueError(f"shared_adapter=True but versions pins different refs {versions}")
            elif isinstance(versions, str):
                if self.registry is None:
                    raise RegistryError(f"versions={versions!r} needs a registry (registry=DIR)")
                ref = self.registry.alias(versions).get(slot)
            if ref is None or ref == FRESH:
                self._add_fresh(slot)
            else:
                self._current[slot] = self._ensure_loaded(slot, ref)

    def _make_fresh(self, slot: str) -> str:
        """The slot's initial adapter (created, deterministically from the seed, if it is not loaded)."""
        name = f"{slot}@{FRESH}"
        if name in self.engine.loaded_adapters():
            return name
        seed = self.seed + self.slots().index(slot)
        if hasattr(self.engine, "add_adapter"):
            self.engine.add_adapter(name, self.lora, seed=seed)
        else:
            if self._tmp is None:
                self._tmp = tempfile.TemporaryDirectory(prefix="marft-fresh-")
            out = write_fresh_adapter(self.model_dir, self.lora, Path(self._tmp.name) / slot, seed=seed)
            self.engine.load_adapter(name, out)
        return name

    def _add_fresh(self, slot: str) -> None:
        self._current[slot] = self._make_fresh(slot)

    def base_shapes(self) -> dict[str, Any] | None:
        """The base model's layer shapes every adapter must fit (from the engine, else the weight headers);
        None when neither tells (adapters are then checked without them)."""
        if self._shapes is None:
            shapes = getattr(self.engine, "module_shapes", None)
            if not isinstance(shapes, dict):
                from marft_lg.serving.registry.integrity import base_shapes_from_weights

                try:
                    shapes = base_shapes_from_weights(self.model_dir)
                except Exception:  # noqa: BLE001 - unreadable headers: check adapters without the base shapes
                    shapes = {}
            self._shapes = shapes
        return self._shapes or None

    def _ensure_loaded(self, slot: str, ref: str) -> str:
        """Load `slot` at `ref` from the registry if needed; returns its adapter name.

        A registry version is verified (base model fingerprint, safetensors header, LoRA shapes against
        the base model, content hash) before the engine is touched: a damaged one raises
        `AdapterIntegrityError` and nothing changes. ``"init"`` is the slot's initial adapter, made
        again if it was unloaded.
        """
        if ref == FRESH:
            return self._make_fresh(slot)
        if self.registry is None:
            raise RegistryError(f"version {ref!r} of {slot!r} asked for, but this Team has no registry")
        version = self.registry.resolve(slot, ref)
        name = f"{slot}@{version}"
        if name not in self.engine.loaded_adapters():
            path = self.registry.check_base(slot, version, self.fingerprint, base_shapes=self.base_shapes(),
                                            base_hash=lambda: self.base_hash, base_name=self.model_name)
            self.engine.load_adapter(name, path)
        return name

    # ---- serving -------------------------------------------------------------------------------
    @property
    def tokenizer(self):
        """The engine's tokenizer (loaded from the model directory for engines that keep none)."""
        tok = getattr(self.engine, "tokenizer", None)
        if tok is None:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
            tok = self._tokenizer
        return tok

    @property
    def model(self) -> Any:
        """The engine's in-process model (the hf engine's PeftModel, one adapter per slot) that a trainer updates
        under `exclusive()`; AttributeError for an engine that holds none (vLLM runs in its own process)."""
        model = getattr(self.engine, "model", None)
        if model is None:
            raise AttributeError(f"engine {type(self.engine).__name__} of base {self.model_name!r} holds no "
                                 "in-process model to train; use engine='hf' for the team the trainer updates")
        return model

    @property
    def base_hash(self) -> str:
        """The base model's weights hash (`model_content_hash`), computed on first use (saving or checking an
        adapter) and memoised on disk."""
        if self._base_hash is None:
            self._base_hash = model_content_hash(self.model_dir)
        return self._base_hash

    @property
    def bases(self) -> dict[str, Team]:
        """Base model name -> the `Team` serving it: ``{self.model_name: self}`` (a `MixedTeam` has several)."""
        return {self.model_name: self}

    def base_of(self, role: str) -> str:
        """The name of the base model `role` runs on (`UnknownAgentError` for a role this team lacks)."""
        self._slot(role)
        return self.model_name

    def team_of(self, role: str) -> Team:
        """The single-base `Team` serving `role`: this one."""
        self._slot(role)
        return self

    def tokenizer_for(self, role: str | None) -> Any:
        """The tokenizer of `role`'s base model (None: the base model's, i.e. this team's)."""
        if role is not None:
            self._slot(role)
        return self.tokenizer

    def agents(self) -> list[str]:
        return list(self._agents)

    def versions(self) -> dict[str, str]:
        """The version each role serves now (``"init"`` for a fresh adapter)."""
        with self._lock:
            return {r: self._current[self._slot(r)].split("@", 1)[1] for r in self._agents}

    def slot_versions(self) -> dict[str, str]:
        """The version each adapter slot serves now: what a registry alias maps (``{"shared": ...}`` with a
        shared adapter)."""
        with self._lock:
            return {slot: name.split("@", 1)[1] for slot, name in self._current.items()}

    def adapter_name(self, role: str, version: str | None = None) -> str:
        """The engine's adapter name for `role` (its current one, or `version` loaded on demand)."""
        with self._lock:
            slot = self._slot(role)
            return self._current[slot] if version is None else self._ensure_loaded(slot, version)

    def _acquire(self, requests: list[ChatRequest]) -> list[str | None]:
        with self._lock:
            names = [None if r.agent is None else self.adapter_name(r.agent, r.version) for r in requests]
            self._inflight.update(n for n in names if n is not None)
            return names

    def _release(self, names: list[str | None]) -> None:
        with self._lock:
            self._inflight.subtract(n for n in names if n is not None)
            for name in [n for n in self._retired if self._inflight[n] <= 0]:
                self._unload(name)

    def _unload(self, name: str) -> None:
        self._retired.discard(name)
        self._inflight.pop(name, None)
        if name not in self._current.values() and name in self.engine.loaded_adapters():
            self.engine.unload_adapter(name)

    def _label(self, completions: list[Completion], requests: list[ChatRequest], names: list[str | None]):
        for c, r, n in zip(completions, requests, names, strict=True):
            c.agent = r.agent
            c.adapter_version = None if n is None else n.split("@", 1)[1]
            c.model = self.model_name
        return completions

    def chat(self, requests: list[ChatRequest]) -> list[Completion]:
        """Answer requests (any mix of roles and versions) in one batch; safe from many threads."""
        names = self._acquire(requests)
        try:
            return self._label(self.engine.generate(requests, names), requests, names)
        finally:
            self._release(names)

    async def achat(self, requests: list[ChatRequest],
                    listeners: list[TokenListener | None] | None = None) -> list[Completion]:
        """Async `chat`; concurrent callers share batches. `listeners[i]` is told request i's tokens as they are
        decoded (an engine that cannot stream tells nothing); cancelling the call cancels its rows."""
        names = self._acquire(requests)
        try:
            wanted = listeners is not None and any(listeners) and streams(self.engine.agenerate)
            more = {"listeners": listeners} if wanted else {}
            return self._label(await self.engine.agenerate(requests, names, **more), requests, names)
        finally:
            self._release(names)

    def load_version(self, role: str, ref: str) -> str:
        """Hot swap: serve `ref` for `role` from now on; in-flight requests finish on the old weights.

        With a shared adapter every role switches. `ref` may be ``"init"`` (the initial adapter). A load
        that fails (damaged files, another base model) raises and the role keeps its current version.
        Returns the concrete version served.
        """
        slot = self._slot(role)
        name = self._ensure_loaded(slot, ref)
        with self._lock:
            old = self._current[slot]
            self._current[slot] = name
            if old != name:
                self._retired.add(old)
                if self._inflight[old] <= 0:
                    self._unload(old)
        return name.split("@", 1)[1]

    def unload_version(self, role: str, ref: str) -> None:
        """Drop a pinned (non-current) version once no request uses it."""
        slot = self._slot(role)
        version = ref if ref == FRESH else (self.registry.resolve(slot, ref) if self.registry else ref)
        name = f"{slot}@{version}"
        with self._lock:
            if name in self._current.values():
                raise RegistryError(f"{name} is what {role!r} serves now; load another version first")
            if name not in self.engine.loaded_adapters():
                raise UnknownAgentError(name, self.engine.loaded_adapters(), what="adapter")
            self._retired.add(name)
            if self._inflight[name] <= 0:
                self._unload(name)

    def save_version(self, role: str, *, parent: str | None = None, run_id: str | None = None,
                     metrics: dict[str, float] | None = None) -> str:
        """Write the weights `role` serves now as a new registry version (hf engine); returns ``"v<k>"``."""
        if self.registry is None:
            raise RegistryError("save_version needs a registry (Team(registry=DIR))")
        name = self.adapter_name(role)
        version = name.split("@", 1)[1]
        if parent is None and version != FRESH:
            parent = version
        with self.exclusive():
            return self.registry.save(self._slot(role), self.engine.model, adapter_name=name,
                                      base_fingerprint=self.fingerprint, base_name=self.model_name,
                                      base_hash=self.base_hash, parent=parent, run_id=run_id, metrics=metrics)

    @contextmanager
    def exclusive(self) -> Iterator[Any]:
        """Pause serving while the caller updates the model in-process (hf engine); yields the PeftModel."""
        if not hasattr(self.engine, "exclusive"):
            raise RuntimeError(f"engine {type(self.engine).__name__} holds no in-process model to update")
        with self.engine.exclusive() as model:
            yield model

    def close(self) -> None:
        self.engine.close()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> Team:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
