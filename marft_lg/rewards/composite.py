"""CompositeReward: a weighted sum of reward components over whole multi-agent episodes.

``reward = sum(weight[c] * value[c])`` over the declared components (a triggered veto replaces it).
Scoring a dataset gives one row per episode with the total and one column per component, plus
per-action reward vectors in action order for GAE (see `placement`). A component that raises, or
returns NaN/inf or a value outside its range, marks that episode unscored with the error recorded;
the run goes on. An episode that did not finish is never scored as finished: one left paused at an
interrupt is unscored, one whose run failed follows `errored` (unscored by default).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from marft_lg._config import ConfigError, YamlDoc, load_yaml
from marft_lg._durable import write_atomic
from marft_lg.rewards.base import ComponentScore, RewardComponent, answer_order, check_score
from marft_lg.rewards.loading import ERRORED_MODES, build_component, component_spec, parse_config
from marft_lg.rewards.placement import CREDIT_MODES, place_rewards
from marft_lg.rewards.registry import relative_to
from marft_lg.trajectories.dataset import Episode, TrajectoryDataset, scenario_key
from marft_lg.trajectories.scenarios import Scenario, ScenarioSet

BASE_COLUMNS: tuple[str, ...] = ("episode_id", "reward", "scored", "error", "vetoed")
# The `error` of an episode left unscored because it did not finish (its components are not computed).
UNFINISHED = "episode not finished"


@dataclass
class EpisodeReward:
    """One episode's reward: total, per-component values (NaN where a component failed), placement."""

    episode_id: str
    reward: float
    scored: bool
    error: str | None
    components: dict[str, float]
    action_rewards: np.ndarray | None
    vetoed: bool = False


@dataclass
class RewardResult:
    """Rewards of a dataset: `episodes` (one row per episode: ``episode_id, reward, scored, error,
    vetoed`` and one column per component) and `action_rewards` (scored episodes only: per-action
    rewards in action `order`, summing to the episode's reward)."""

    episodes: pd.DataFrame
    action_rewards: dict[str, np.ndarray]
    components: list[str]
    weights: dict[str, float] = field(default_factory=dict)
    credit: str = "terminal"

    def summary(self) -> dict[str, Any]:
        """Counts, reward statistics over scored episodes, per-component means and error counts."""
        eps = self.episodes
        scored = eps[eps["scored"]] if len(eps) else eps
        rewards = scored["reward"].astype(float) if len(scored) else pd.Series(dtype=float)
        unfinished = eps["error"].fillna("").astype(str).str.startswith(UNFINISHED)
        errors = {name: int((eps[name].isna() & ~unfinished).sum()) for name in self.components}
        comps = {}
        for name in self.components:
            col = eps[name].astype(float) if len(eps) else pd.Series(dtype=float)
            comps[name] = {"weight": self.weights.get(name), "mean": _stat(col.mean()), "errors": errors.get(name, 0)}
        return {
            "episodes": len(eps),
            "scored": len(scored),
            "unscored": len(eps) - len(scored),
            "unfinished": int(unfinished.sum()),
            "vetoed": int(eps["vetoed"].sum()) if len(eps) else 0,
            "credit": self.credit,
            "reward": {"mean": _stat(rewards.mean()), "std": _stat(rewards.std(ddof=0)),
                       "min": _stat(rewards.min()), "max": _stat(rewards.max())},
            "components": comps,
            "errors": {k: v for k, v in errors.items() if v},
            "error_examples": [f"{r.episode_id}: {r.error}" for r in eps[eps["error"].notna()].head(3).itertuples()],
        }

    def save(self, path: str | Path) -> Path:
        """Write the table with an `action_rewards` column: .parquet, .jsonl or .csv (atomic)."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        frame = self.episodes.copy()
        frame["action_rewards"] = [None if (v := self.action_rewards.get(e)) is None else v.tolist()
                                   for e in frame["episode_id"]]
        meta = {"components": self.components, "weights": self.weights, "credit": self.credit}
        if p.suffix == ".parquet":
            import io

            import pyarrow as pa
            import pyarrow.parquet as pq

            table = pa.Table.from_pandas(frame, preserve_index=False)
            table = table.replace_schema_metadata({**(table.schema.metadata or {}),
                                                   b"marft_lg.reward": json.dumps(meta).encode()})
            buf = io.BytesIO()
            pq.write_table(table, buf)
            data: bytes | str = buf.getvalue()
        elif p.suffix == ".jsonl":
            data = "".join([json.dumps({"_meta": meta}) + "\n",
                            *(json.dumps(_json_row(row), allow_nan=False) + "\n" for row in frame.to_dict("records"))])
        elif p.suffix == ".csv":
            frame["action_rewards"] = [None if v is None else json.dumps(v) for v in frame["action_rewards"]]
            data = frame.to_csv(index=False)
        else:
            raise ValueError(f"cannot write rewards to {p}: use a .parquet, .jsonl or .csv file name")
        return write_atomic(p, data)

    @classmethod
    def load(cls, path: str | Path) -> RewardResult:
        """Read a result written by `save` as .parquet or .jsonl."""
        p = Path(path)
        if p.suffix == ".parquet":
            import pyarrow.parquet as pq

            table = pq.read_table(p)
            meta = json.loads((table.schema.metadata or {}).get(b"marft_lg.reward", b"{}"))
            frame = table.to_pandas()
        elif p.suffix == ".jsonl":
            lines = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
            meta = lines[0].get("_meta", {}) if lines else {}
            frame = pd.DataFrame([r for r in lines if "_meta" not in r])
        else:
            raise ValueError(f"cannot read rewards from {p}: use a .parquet or .jsonl file written by RewardResult.save")
        components = meta.get("components") or [c for c in frame.columns if c not in (*BASE_COLUMNS, "action_rewards")]
        action_rewards = {e: np.asarray(v, dtype=np.float64) for e, v in zip(frame["episode_id"], frame["action_rewards"],
                                                                             strict=True) if v is not None}
        frame = frame.drop(columns=["action_rewards"])
        frame["scored"] = frame["scored"].astype(bool)
        frame["vetoed"] = frame["vetoed"].astype(bool)
        for col in ("reward", *components):
            frame[col] = pd.to_numeric(frame[col], errors="coerce").astype(float)
        return cls(frame, action_rewards, list(components), dict(meta.get("weights") or {}), meta.get("credit", "terminal"))


class CompositeReward:
    """Weighted sum of reward components with credit placement; build from Python or YAML.

    `weights` maps a component name (built-in, or any key described in `components`, or an import
    path) to its weight. `components` gives a key its component: an instance, a callable, a type
    name / import path, or an options dict (``{"type": ..., **options}``). `credit` is
    ``"terminal"`` or ``"shaped"``; `answer_agents` names the agents whose last action holds the
    answer (components with an unset `answer_agents` option inherit it). `errored` says what an episode whose
    run failed gets: ``"unscored"`` (left out of training), ``"score"`` (scored as if it had finished) or
    ``"zero"`` (reward 0, a veto still applies). An episode left paused at an interrupt is always unscored.
    """

    def __init__(self, weights: Mapping[str, float], components: Mapping[str, Any] | None = None,
                 credit: str = "terminal", answer_agents: Sequence[str] | str | None = None,
                 errored: str = "unscored"):
        if credit not in CREDIT_MODES:
            raise ValueError(f"credit must be one of {list(CREDIT_MODES)}, got {credit!r}")
        if errored not in ERRORED_MODES:
            raise ValueError(f"errored must be one of {list(ERRORED_MODES)}, got {errored!r}")
        if not weights:
            raise ValueError("a CompositeReward needs at least one weight, e.g. {'task_completion': 1.0}")
        components = dict(components or {})
        orphans = set(components) - set(weights)
        if orphans:
            raise ValueError(f"components {sorted(orphans)} have options but no weight; add them to weights "
                             f"(weight 0 records the column without adding to the reward). Weights: {sorted(weights)}")
        self.credit = credit
        self.errored = errored
        self.answer_agents = [answer_agents] if isinstance(answer_agents, str) else (
            list(answer_agents) if answer_agents else None)
        self.weights: dict[str, float] = {}
        self.components: dict[str, RewardComponent] = {}
        self._types: dict[str, str | None] = {}
        self._inherited: dict[str, set[str]] = {}
        for name, w in weights.items():
            try:
                weight = float(w)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"weight of {name!r} must be a number, got {w!r}") from exc
            if not math.isfinite(weight):
                raise ValueError(f"weight of {name!r} must be finite, got {weight}")
            try:
                comp, type_name = build_component(str(name), components.get(name))
            except ValueError as exc:
                exc.reward_key = str(name)  # lets from_yaml name the component's line in the YAML
                raise
            self.weights[str(name)] = weight
            self.components[str(name)] = comp
            self._types[str(name)] = type_name
            self._inherited[str(name)] = set()
            if self.answer_agents and hasattr(comp, "answer_agents") and comp.answer_agents is None:
                comp.answer_agents = list(self.answer_agents)
                self._inherited[str(name)].add("answer_agents")

    @classmethod
    def from_yaml(cls, source: str | Path | Mapping[str, Any], *, doc: YamlDoc | None = None) -> CompositeReward:
        """Build from a YAML file, or from an already-parsed mapping (`doc`: where that mapping sits in a file,
        e.g. the inline `reward:` of a train.yaml). Errors are `ConfigError`s (ValueErrors) naming the file, line
        and key; a missing file is a `ConfigNotFound` (also a FileNotFoundError)."""
        if isinstance(source, Mapping):
            return cls._from_doc(doc if doc is not None else YamlDoc.of(source))
        path = Path(source)
        doc = load_yaml(path, what="reward config")
        with relative_to(path.parent):
            return cls._from_doc(doc)

    @classmethod
    def _from_doc(cls, doc: YamlDoc) -> CompositeReward:
        kwargs = parse_config(doc.data, doc=doc)
        try:
            return cls(**kwargs)
        except ValueError as exc:  # a component that cannot be built: name the file and its line
            if isinstance(exc, ConfigError) and exc.path is not None:
                raise
            name = getattr(exc, "reward_key", None)
            key = (("components", name) if name in kwargs["components"] else ("weights", name) if name
                   else exc.key if isinstance(exc, ConfigError) else ())
            problem = exc.problem if isinstance(exc, ConfigError) else str(exc)
            located = doc.not_found(problem, key) if isinstance(exc, FileNotFoundError) else doc.error(problem, key)
            raise located from exc

    def to_dict(self) -> dict[str, Any]:
        """The YAML form; `from_yaml(to_dict())` rebuilds an equal reward."""
        specs = {name: component_spec(name, comp, self._types[name], self._inherited[name])
                 for name, comp in self.components.items()}
        return {"credit": self.credit, "answer_agents": self.answer_agents, "errored": self.errored,
                "weights": dict(self.weights),
                "components": {k: v for k, v in specs.items() if v}}

    def to_yaml(self, path: str | Path | None = None) -> str:
        """YAML text of `to_dict()`, also written to `path` when given."""
        import yaml

        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if path is not None:
            write_atomic(path, text)
        return text

    def score_episode(self, episode: Episode) -> EpisodeReward:
        """Score one episode; never raises for a failing component (the episode comes back unscored)."""
        unfinished = self._unfinished(episode)
        if unfinished is not None:
            return EpisodeReward(episode.episode_id, math.nan, False, unfinished,
                                 dict.fromkeys(self.components, math.nan), None)
        scores: dict[str, ComponentScore] = {}
        errors: list[str] = []
        for name, comp in self.components.items():
            try:
                scores[name] = check_score(name, comp(episode), episode, comp.range)
            except Exception as exc:  # a user component may raise anything; record it, keep going
                errors.append(f"{name}: {type(exc).__name__}: {exc}")
        values = {name: scores[name].value if name in scores else math.nan for name in self.components}
        if errors:
            return EpisodeReward(episode.episode_id, math.nan, False, "\n".join(errors), values, None)
        veto = self._veto(scores)
        failed = self.errored == "zero" and episode.info.get("status") == "error"
        reward = veto[0] if veto is not None else 0.0 if failed else sum(
            self.weights[n] * s.value for n, s in scores.items())
        orders = [int(a["order"]) for a in episode.actions]
        placed = place_rewards(orders, {} if failed else scores, self.weights, credit=self.credit,
                               terminal_order=answer_order(episode, self.answer_agents), veto=veto)
        return EpisodeReward(episode.episode_id, float(reward), True, None, values, placed, veto is not None)

    def score(self, dataset: TrajectoryDataset, scenarios: ScenarioSet | Mapping[str, Any] | Iterable[Scenario] | None = None,
              *, progress: bool = False, prepared: bool = False) -> RewardResult:
        """Score every episode of `dataset` (joined to `scenarios` by `scenario_id`). `prepared`: the caller already
        ran the group step (`prepare`) over these episodes with groups of its own (a comparison judges the two sides
        of each paired unit together)."""
        by_id = _scenario_dicts(scenarios)
        episodes: Iterable[Episode] = dataset.iter_episodes(by_id)
        if self.grouped and not prepared:
            episodes = list(episodes)
            self.prepare(episodes)
        if progress:
            from rich.progress import track

            episodes = track(episodes, total=len(dataset), description="scoring episodes")
        rows, action_rewards = [], {}
        for ep in episodes:
            r = self.score_episode(ep)
            rows.append({"episode_id": r.episode_id, "reward": r.reward, "scored": r.scored, "error": r.error,
                         "vetoed": r.vetoed, **r.components})
            if r.action_rewards is not None:
                action_rewards[r.episode_id] = r.action_rewards
        frame = pd.DataFrame(rows, columns=[*BASE_COLUMNS, *self.components])
        frame["reward"] = frame["reward"].astype(float)
        frame["scored"] = frame["scored"].astype(bool)
        frame["vetoed"] = frame["vetoed"].astype(bool)
        return RewardResult(frame, action_rewards, list(self.components), dict(self.weights), self.credit)

    def prepare(self, episodes: Iterable[Episode], key: Callable[[Episode], Any] | None = None) -> None:
        """Call each component's group hook (`RewardComponent.prepare`) with `episodes` grouped by scenario (or by
        `key(episode)`), the unfinished ones left out (they are never scored). `score` does this itself; call it
        before `score_episode` when scoring episode by episode with a component that judges groups."""
        groups: dict[Any, list[Episode]] = {}
        for ep in episodes:
            if self._unfinished(ep) is None:
                group = key(ep) if key is not None else scenario_key(ep.episode_id, ep.info.get("scenario_id"))
                groups.setdefault(group, []).append(ep)
        for name, comp in self.components.items():
            if type(comp).prepare is RewardComponent.prepare:
                continue
            try:
                comp.prepare(list(groups.values()))
            except Exception as exc:  # the hook must not raise; if it does, its episodes are scored by __call__
                logging.getLogger(__name__).warning("reward component %r: prepare failed: %s: %s", name,
                                                    type(exc).__name__, exc)

    def bind_default_engine(self, team: Any) -> None:
        """Give the components that judge with a model and were given none (`group_judge` without `base_url`) the
        served `team`'s base model; the trainer and the comparison call this with the team they run."""
        for comp in self.components.values():
            bind = getattr(comp, "bind_default_engine", None)
            if callable(bind):
                bind(team)

    @property
    def grouped(self) -> bool:
        """Whether a component judges episodes in groups (`RewardComponent.prepare`)."""
        return any(type(c).prepare is not RewardComponent.prepare for c in self.components.values())

    def _unfinished(self, episode: Episode) -> str | None:
        """Why `episode` is left unscored as unfinished (its `status`), or None to score it."""
        status = episode.info.get("status")
        if status == "paused":
            return (f"{UNFINISHED}: status 'paused' (stopped at an interrupt and never resumed); resume it to "
                    "score it")
        if status == "incomplete":
            return (f"{UNFINISHED}: status 'incomplete' (a run of it has spans but no root span: still being "
                    "exported, or the app stopped first; its scenario and result are unknown); mine it again later")
        if status == "error" and self.errored == "unscored":
            return (f"{UNFINISHED}: status 'error' (its run failed); errored: unscored leaves it out of "
                    "training, errored: zero trains on it as a failure")
        return None

    def _veto(self, scores: Mapping[str, ComponentScore]) -> tuple[float, int | None] | None:
        hits = [(float(self.components[n].veto_reward), min(s.per_action) if s.per_action else None)
                for n, s in scores.items() if self.components[n].is_veto and s.value != 0.0]
        return min(hits, key=lambda h: h[0]) if hits else None

    def __repr__(self) -> str:
        terms = " + ".join(f"{w:g}*{n}" for n, w in self.weights.items())
        return f"CompositeReward({terms}, credit={self.credit!r})"


def _scenario_dicts(scenarios: Any) -> dict[str, dict[str, Any]] | None:
    if scenarios is None:
        return None
    if isinstance(scenarios, ScenarioSet):
        return scenarios.by_id()
    if isinstance(scenarios, Mapping):
        return {k: v.to_dict() if isinstance(v, Scenario) else dict(v) for k, v in scenarios.items()}
    return ScenarioSet(scenarios).by_id()


def _stat(value: Any) -> float | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


def _json_row(row: dict[str, Any]) -> dict[str, Any]:
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}
