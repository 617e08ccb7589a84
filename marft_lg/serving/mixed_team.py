"""A team whose roles run on several base models: one single-base `Team` per base, behind the `Team` API.

``team({"planner": "embedded:smollm2-135m-instruct", "writer": "/models/writer"})`` builds a `MixedTeam` when
the roles' specs resolve to more than one model directory (`marft_lg.serving.team.plan_bases`). Each base gets
its own `Team`: its roles, its own engine ("hf" or "vllm" as `engine` says), the same registry object, LoRA
settings, seed and engine options, and the versions of its roles. A batch of requests for several roles is
split by agent, each base answers its share concurrently (threads for `chat`, ``asyncio.gather`` for
`achat`), and the completions come back in request order, each labelled with its base's name
(`Completion.model`).

Adapters are per role as always (the registry keeps ``<role>/v<k>``); each version's manifest records the
base it was trained on (`base_name`, `base_hash`) and a base refuses another base's adapter.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from marft_lg.serving.errors import UnknownAgentError
from marft_lg.serving.registry.lora import LoraSettings
from marft_lg.serving.registry.store import AdapterRegistry
from marft_lg.serving.team import _UNSET, ModelSpec, Team, _check_versions, base_model_name, plan_bases
from marft_lg.serving.types import ChatRequest, Completion, TokenListener


def unique_names(names: list[str]) -> list[str]:
    """Names made distinct deterministically: the first keeps its name, later ones get ``#2``, ``#3``, ..."""
    out: list[str] = []
    for name in names:
        candidate, k = name, 1
        while candidate in out:
            k += 1
            candidate = f"{name}#{k}"
        out.append(candidate)
    return out


class MixedTeam:
    """Roles on several base models: one `Team` per base (see the module docstring).

    Built by ``team(mapping, ...)`` (`team_factory`), or directly with the same arguments. `bases` maps each base's name to
    its `Team`; `base_of(role)`, `team_of(role)` and `tokenizer_for(role)` say where a role runs. Everything
    that acts on one role (versions, hot swap, saving) goes to that role's base; `exclusive()` has no single
    model to hand out: use ``team.team_of(role).exclusive()``.
    """

    shared_adapter = False

    def __init__(self, model: Mapping[str, ModelSpec], agents: list[str] | tuple[str, ...] = (), *,
                 engine: str | Any = "hf", shared_adapter: bool = False,
                 registry: AdapterRegistry | str | os.PathLike | None = None,
                 versions: str | dict[str, str] | None = _UNSET, lora: LoraSettings | None = None, seed: int = 0,
                 model_name: str | None = None, engine_options: dict[str, Any] | None = None):
        roles, groups = plan_bases(model, agents)
        if shared_adapter:
            raise ValueError(f"shared_adapter=True needs one base model, but the roles run on {len(groups)} "
                             "(one adapter cannot sit on base models of different weights or shapes); drop "
                             "shared_adapter or put every role on the same model")
        if not isinstance(engine, str) and len(groups) > 1:
            raise ValueError("a team of several base models builds one engine per base: pass engine='hf' or "
                             "'vllm', not an engine object")
        self._agents = roles
        self.registry = registry if isinstance(registry, AdapterRegistry) or registry is None else AdapterRegistry(registry)
        if versions is not _UNSET:
            versions = _check_versions(versions)
        names = unique_names([base_model_name(spec, model_dir) for spec, model_dir, _ in groups])
        self._bases: dict[str, Team] = {}
        self._base_of: dict[str, str] = {}
        try:
            for name, (spec, _, base_roles) in zip(names, groups, strict=True):
                kw: dict[str, Any] = {}
                if isinstance(versions, dict):
                    kw["versions"] = {r: v for r, v in versions.items() if r in base_roles}
                elif versions is not _UNSET:
                    kw["versions"] = versions
                self._bases[name] = Team(spec, base_roles, engine=engine, registry=self.registry, lora=lora,
                                         seed=seed, model_name=name, engine_options=dict(engine_options or {}), **kw)
                self._base_of.update(dict.fromkeys(base_roles, name))
        except BaseException:
            self.close()
            raise
        self.model_name = model_name or ",".join(f"{r}={self._base_of[r]}" for r in roles)
        """A readable name of the whole team: ``role=base`` for every role."""
        self.follows: str | None = next(iter(self._bases.values())).follows
        """The registry alias this team was started from (``"live"``), None when versions were pinned."""
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(max_workers=len(self._bases),
                                                                    thread_name_prefix="marft-mixed")

    # ---- where each role runs ------------------------------------------------------------------
    @property
    def bases(self) -> dict[str, Team]:
        """Base model name -> the `Team` serving it, in the order each base's first role appears."""
        return dict(self._bases)

    def base_of(self, role: str) -> str:
        """The name of the base model `role` runs on (`UnknownAgentError` for a role this team lacks)."""
        if role not in self._base_of:
            raise UnknownAgentError(role, self._agents)
        return self._base_of[role]

    def team_of(self, role: str) -> Team:
        """The single-base `Team` serving `role`."""
        return self._bases[self.base_of(role)]

    def tokenizer_for(self, role: str | None) -> Any:
        """The tokenizer of `role`'s base model (a mixed team has no tokenizer of its own)."""
        if role is None:
            raise UnknownAgentError("None", self._agents, what="agent (a team of several base models has one "
                                                              "tokenizer per base: name a role)")
        return self.team_of(role).tokenizer

    @property
    def engine(self) -> Any:
        raise AttributeError(f"a MixedTeam has one engine per base model ({', '.join(self._bases)}): use "
                             "team.team_of(role).engine or team.bases[name].engine")

    @property
    def tokenizer(self) -> Any:
        raise AttributeError(f"a MixedTeam has one tokenizer per base model ({', '.join(self._bases)}): use "
                             "team.tokenizer_for(role)")

    # ---- roles and versions --------------------------------------------------------------------
    def agents(self) -> list[str]:
        return list(self._agents)

    def versions(self) -> dict[str, str]:
        """The version each role serves now (``"init"`` for a fresh adapter), in role order."""
        merged: dict[str, str] = {}
        for team in self._bases.values():
            merged.update(team.versions())
        return {r: merged[r] for r in self._agents}

    def slot_versions(self) -> dict[str, str]:
        """The version each adapter slot (= role: no shared adapter here) serves now."""
        merged: dict[str, str] = {}
        for team in self._bases.values():
            merged.update(team.slot_versions())
        return {r: merged[r] for r in self._agents if r in merged}

    def slot(self, role: str) -> str:
        return self.team_of(role).slot(role)

    def slots(self) -> list[str]:
        return [self.slot(r) for r in self._agents]

    def adapter_name(self, role: str, version: str | None = None) -> str:
        """The engine's adapter name for `role` on its base (its current one, or `version` loaded on demand)."""
        return self.team_of(role).adapter_name(role, version)

    def load_version(self, role: str, ref: str) -> str:
        """Hot swap `role` to `ref` on its base (see `Team.load_version`); returns the version served."""
        return self.team_of(role).load_version(role, ref)

    def unload_version(self, role: str, ref: str) -> None:
        self.team_of(role).unload_version(role, ref)

    def save_version(self, role: str, *, parent: str | None = None, run_id: str | None = None,
                     metrics: dict[str, float] | None = None) -> str:
        """Write the weights `role` serves now as a new registry version (its base recorded in the manifest)."""
        return self.team_of(role).save_version(role, parent=parent, run_id=run_id, metrics=metrics)

    # ---- serving -------------------------------------------------------------------------------
    def _split(self, requests: list[ChatRequest]) -> dict[str, list[int]]:
        """Request indices per base name (in base order); an agentless or unknown agent is an error."""
        by_base: dict[str, list[int]] = {}
        for i, r in enumerate(requests):
            if r.agent is None:
                raise UnknownAgentError("None", self._agents, what="agent (a team of several base models needs "
                                                                   "each request's agent)")
            by_base.setdefault(self.base_of(r.agent), []).append(i)
        return {name: by_base[name] for name in self._bases if name in by_base}

    @staticmethod
    def _merge(n: int, parts: list[tuple[list[int], list[Completion]]]) -> list[Completion]:
        out: list[Completion | None] = [None] * n
        for idx, completions in parts:
            for i, c in zip(idx, completions, strict=True):
                out[i] = c
        return out  # type: ignore[return-value] - every index is filled

    def chat(self, requests: list[ChatRequest]) -> list[Completion]:
        """Answer a batch of requests for any roles: each base answers its share (concurrently, in threads);
        the completions come back in request order."""
        groups = self._split(requests)
        if not groups:
            return []
        if len(groups) == 1:  # one base: no thread needed
            return self._bases[next(iter(groups))].chat(requests)
        if self._pool is None:
            raise RuntimeError("this MixedTeam is closed")
        futures = [(idx, self._pool.submit(self._bases[name].chat, [requests[i] for i in idx]))
                   for name, idx in groups.items()]
        return self._merge(len(requests), [(idx, f.result()) for idx, f in futures])

    async def achat(self, requests: list[ChatRequest],
                    listeners: list[TokenListener | None] | None = None) -> list[Completion]:
        """Async `chat`: the bases' shares run concurrently (``asyncio.gather``); `listeners` as `Team.achat`."""
        groups = self._split(requests)
        if not groups:
            return []
        listeners = listeners or [None] * len(requests)
        if len(groups) == 1:
            return await self._bases[next(iter(groups))].achat(requests, listeners)
        results = await asyncio.gather(*(self._bases[name].achat([requests[i] for i in idx], [listeners[i] for i in idx])
                                         for name, idx in groups.items()))
        return self._merge(len(requests), list(zip(groups.values(), results, strict=True)))

    def exclusive(self) -> Any:
        """Not available: each base has its own model. Raises at once (use ``team.team_of(role).exclusive()``)."""
        raise RuntimeError(f"a MixedTeam serves {len(self._bases)} base models ({', '.join(self._bases)}), so it has "
                           "no single model to update: use team.team_of(role).exclusive() for a role's base")

    def close(self) -> None:
        """Close every base's engine (each even when another fails; the first error is raised)."""
        pool, self._pool = getattr(self, "_pool", None), None
        if pool is not None:
            pool.shutdown(wait=False)
        first: BaseException | None = None
        for team in getattr(self, "_bases", {}).values():
            try:
                team.close()
            except BaseException as e:  # noqa: BLE001 - close the others, then raise the first
                first = first or e
        if first is not None:
            raise first

    def __enter__(self) -> MixedTeam:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MixedTeam({', '.join(f'{n}: {t.agents()}' for n, t in self._bases.items())})"
