"""`MARFTTrainer`: offline MARFT from mined traces, then on-policy MARFT through the live graph.

One iteration = build the buffer from scored episodes -> critic values -> advantages -> PPO update
of the agent(s) whose turn it is -> stability checks (restore on collapse) -> metrics ->
checkpoint. Online iterations also publish the adapters as registry versions and hot-swap them.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from marft_lg.graph.routing import derive_seed
from marft_lg.rewards.base import Scorer
from marft_lg.tracking.base import Tracker, open_tracker
from marft_lg.tracking.lineage import data_window, record_published
from marft_lg.training.batch import BaseModel, Critic, LazyGrammars, TrainBatch, build_batch
from marft_lg.training.buffer import ActionRecord, RolloutBuffer, build_buffer
from marft_lg.training.checkpoint import save_checkpoint
from marft_lg.training.checks import TrainingDataError, named, problem_counts
from marft_lg.training.config import MARFTConfig
from marft_lg.training.credit import ReplayBudget, Replayed, replay_credit, scenario_objects
from marft_lg.training.critic import ValueHead
from marft_lg.training.metrics import MetricsLog, plot_run
from marft_lg.training.policy import adam, adapter_parameters
from marft_lg.training.ppo import UpdateStats, explained_variance, post_update_check, ppo_update, value_update
from marft_lg.training.protocols import (
    Collector,
    Publisher,
    ReportingCollector,
    TrainablePolicy,
    TrainableTeam,
)
from marft_lg.training.reporting import metrics_row, progress_bar
from marft_lg.training.resume import ResumeReport, resume_trainer, trainer_state
from marft_lg.training.rollout import GraphCollector
from marft_lg.training.sampling import DynamicSample, ReturnGroups, Scored, draw_iteration
from marft_lg.training.stability import AdapterSnapshot, CollapseDetector, adapter_finite
from marft_lg.training.units import unit_for
from marft_lg.trajectories.dataset import TrajectoryDataset

log = logging.getLogger("marft_lg.training")


@dataclass
class _Base:
    """One base model the trainer updates: its policy, PeftModel, tokenizer, pad id and trained roles."""

    name: str
    policy: TrainablePolicy
    model: torch.nn.Module
    tokenizer: Any
    pad_id: int
    roles: list[str]
    grammars: Any = None  # `Grammars` of this base, made when a constrained action first needs them

    def batch_base(self) -> BaseModel:
        if self.grammars is None:
            self.grammars = LazyGrammars(self.model, self.tokenizer)
        return BaseModel(self.model, self.pad_id, self.grammars, self.tokenizer)


class MARFTTrainer:
    """Trains the adapters of a team in place, on one base model or several.

    `team`: a `TrainableTeam` — a serving `Team` with the hf engine, a `MixedTeam` (roles on several
    bases: one policy and one optimizer set per base, GAE over the joint sequence of actions), or a
    `LocalPolicy`. `config.train_agents` picks the trained roles; the others, and agents outside the
    team (an external API), are frozen: traced as the environment, never updated. `reward`: a `Scorer`
    (`CompositeReward`) or a plain `episode -> float` callable (terminal reward on the episode's last action).
    """

    def __init__(self, team: TrainableTeam, reward: Any, config: MARFTConfig | None = None,
                 run_dir: str | Path = "runs/marft", *, run_id: str | None = None, progress: bool = True,
                 tracker: Tracker | None = None):
        if not isinstance(team, TrainableTeam):
            raise TypeError(f"MARFTTrainer needs a team with `bases` and `agents()` (Team, MixedTeam, LocalPolicy); "
                            f"got {type(team).__name__}")
        self.team, self.reward = team, reward
        bind = getattr(reward, "bind_default_engine", None)
        if callable(bind):  # a judge given no endpoint asks the served base model (adapters off)
            bind(team)
        self.cfg = config or MARFTConfig()
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.run_id = run_id or uuid.uuid4().hex[:8]
        self.progress = progress
        torch.manual_seed(self.cfg.seed)
        np.random.seed(self.cfg.seed)
        team_roles = list(team.agents())
        wanted = self.cfg.train_agents
        unknown = [r for r in (wanted or []) if r not in team_roles]
        if unknown:
            raise ValueError(f"train_agents names {unknown}, which the team does not serve; its roles: {team_roles}")
        self.roles: list[str] = [r for r in team_roles if wanted is None or r in wanted]
        """The trained roles, in the team's order (the sequential scheme's turn order, across bases)."""
        self.frozen_roles: list[str] = [r for r in team_roles if r not in self.roles]
        """The team's roles that are served and traced but never updated."""
        self.base_of: dict[str, str] = {r: name for name, p in team.bases.items() for r in p.agents()}
        self.bases: dict[str, _Base] = {}
        """The bases with trained roles (a base whose roles are all frozen is neither paused nor needed in-process)."""
        for name, policy in team.bases.items():
            roles = [r for r in self.roles if self.base_of[r] == name]
            if not roles:
                continue
            if not isinstance(policy, TrainablePolicy):
                raise TypeError(f"base {name!r} of {roles} ({type(policy).__name__}) holds no in-process model to "
                                "train; serve it with the hf engine, or freeze its roles (train_agents)")
            tok = policy.tokenizer
            self.bases[name] = _Base(name, policy, policy.model, tok,
                                     tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id, roles)
        first = next(iter(self.bases.values()))
        self.model, self.tokenizer, self.pad_id = first.model, first.tokenizer, first.pad_id
        """The first base's model, tokenizer and pad id (the only ones of a one-base team)."""
        self.adapter_names = {r: self.bases[self.base_of[r]].policy.adapter_name(r) for r in self.roles}
        self.critic = self._make_critic()
        self.critic_optimizers = {b: torch.optim.Adam(h.parameters(), lr=self.cfg.critic_learning_rate,
                                                      eps=self.cfg.adam_eps)
                                  for b, h in (self.critic.heads.items() if self.critic else ())}
        self.optimizers = {r: self._adam(r, self.adapter_names[r]) for r in self.roles}
        self.generator = torch.Generator().manual_seed(self.cfg.seed)
        self.detector = CollapseDetector(self.cfg.entropy_surge, self.cfg.kl_blowup)
        self.iteration = 0
        self.update_count = 0
        self.offline_cursor = 0
        self.online_done = 0
        self.extra_scenarios = 0
        """Scenarios of the cycling list that dynamic sampling's extra draws took, over the run: the next iteration's
        scenarios start after them (0 without dynamic sampling)."""
        self.warm_started = False
        """Whether this run's warm start (`fit_warm_start`) is done: a resumed run does not repeat it."""
        self.unpublished: set[str] = set()
        """Roles whose adapter weights changed since their last registry version (saved by `_publish` or the caller)."""
        self.data_problems: Counter = Counter()
        """Actions this run left out of its updates because their records failed a data check, by kind."""
        self.update_steps: dict[str, int] = {r: 0 for r in self.roles}
        """Optimizer steps each trained role has taken in this run (0: never updated, e.g. the sequential scheme's
        turn never came to it, or it had no actions)."""
        self.tracker: Tracker = tracker if tracker is not None else open_tracker(
            self.cfg.trackers(), self.run_dir, name=f"train {self.run_id}", params=self.cfg.to_dict(),
            uri=self.cfg.tracking_uri, experiment=self.cfg.experiment, tags={"marft.run_id": self.run_id})
        """The run's trackers (`report_to`; a job hands its train stage's in): metrics, plots, adapter lineage."""
        self.metrics = MetricsLog(self.run_dir, tracker=self.tracker)

    def _make_critic(self) -> Critic | None:
        """Value heads on the frozen base(s): one per base with trained roles, or one on `critic_base`."""
        cfg = self.cfg
        if not cfg.use_critic:
            return None
        on = cfg.critic_base
        if on is not None:
            if on not in self.bases:
                raise ValueError(f"critic_base {on!r} is not one of the bases with trained roles {sorted(self.bases)}")
            if not unit_for(cfg).cross_base_critic and len(self.bases) > 1:
                raise ValueError("critic_base with granularity: token needs every action in that base's tokens; "
                                 "use critic_base: null (a value head per base) or granularity: action")
        names = [on] if on is not None else list(self.bases)
        heads = {b: ValueHead(self._hidden(b), cfg.value_head_hidden) for b in names}
        return Critic(heads=heads, on=on if len(self.bases) > 1 else None)

    def _hidden(self, base: str) -> int:
        model = self.bases[base].model
        return (model.get_base_model() if hasattr(model, "get_base_model") else model).config.hidden_size

    @property
    def value_head(self) -> ValueHead | None:
        """The value head of a one-base team (None without a critic)."""
        return None if self.critic is None else next(iter(self.critic.heads.values()))

    # ---- public phases ---------------------------------------------------------------------------
    def fit_warm_start(self, dataset: TrajectoryDataset, scenarios: Any = None, config: Any = None, *,
                       resume: bool = False) -> dict[str, Any] | None:
        """The warm start (`training.warm_start`: each agent fine-tuned on its own actions in the team's best
        episodes of `dataset`) before MARFT; checkpointed when done, so a resumed run skips it (returns None then)."""
        from marft_lg.training.warm_start import warm_start

        if resume:
            self.resume()
        if self.warm_started:
            return None
        row = warm_start(self, dataset, scenarios, config)
        self.warm_started = True
        self.save_checkpoint()
        return row

    def fit_offline(self, dataset: TrajectoryDataset, scenarios: Any = None, *, action_rewards: dict | None = None,
                    iterations: int | None = None, resume: bool = False, replay_app: Any = None) -> list[dict[str, Any]]:
        """MARFT on recorded episodes; ratios are taken against the traces' behaviour log-probs.

        The dataset is walked about `offline_episodes_per_iteration` episodes at a time (a scenario's
        episodes together) for `offline_passes` passes (or `iterations` iterations). Returns the metrics rows.
        With ``credit: counterfactual``, `replay_app` (the wrapped app, or a collector with `run(jobs)`) replays the
        recorded episodes' steps from their scenarios' inputs; without it the offline phase uses the group baseline.
        With ``dynamic_sampling: true`` each chunk's scenario groups whose returns are all equal stay out of the update
        (counted in the row's `dynamic_sampling`; groups of one are kept).
        """
        if resume:
            self.resume()
        self.tracker.context.setdefault("data_window", data_window(dataset))
        t_score = time.perf_counter()
        episodes = self._scores(dataset, scenarios) if action_rewards is None else None
        scoring_s = time.perf_counter() - t_score  # the whole dataset's, reported by this call's first iteration
        rewards_by_ep = action_rewards if action_rewards is not None else episodes[1]
        ep_table = episodes[0] if episodes is not None else None
        runner = self._replay_runner(replay_app, "offline")
        objects = scenario_objects(scenarios)
        chunks = self._offline_chunks(dataset, self.cfg.offline_episodes_per_iteration)
        total = iterations if iterations is not None else len(chunks) * self.cfg.offline_passes
        rows = []
        with progress_bar(total - self.offline_cursor, "offline MARFT", self.progress) as advance:
            while self.offline_cursor < total:
                t0 = time.perf_counter() - scoring_s
                times, scoring_s = {"scoring_s": scoring_s}, 0.0
                part = chunks[self.offline_cursor % len(chunks)]
                sub = dataset.select(part)
                table = None if ep_table is None else ep_table[ep_table["episode_id"].isin(set(part))]
                chunk = Scored(sub, table, rewards_by_ep)
                train, extra, groups = chunk, None, None
                if self.cfg.dynamic_sampling:  # the chunk's all-equal groups stay out (groups of one are kept)
                    sample = DynamicSample(None, drop_single=False)
                    sample.add(chunk)
                    train, extra, groups = sample.kept(), {"dynamic_sampling": sample.report()}, sample.groups
                    if not len(train.dataset):
                        raise TrainingDataError(self._nothing_informative(sample, "offline"))
                credit = (self._credit(runner, train.dataset, train.action_rewards, objects)
                          if runner is not None else None)
                rows.append(self._iteration(train.dataset, train.action_rewards, train.table, phase="offline",
                                            credit=credit, extra=extra, report=chunk, groups=groups, started=t0,
                                            times=times))
                self.offline_cursor += 1
                self._maybe_checkpoint()
                advance()
        self._finish()
        return rows

    @staticmethod
    def _offline_chunks(dataset: TrajectoryDataset, per: int) -> list[list[str]]:
        """The dataset's episodes, about `per` per iteration, a scenario's episodes always in one chunk.

        Without a critic, an episode's advantage is its return against the other episodes of its scenario;
        a chunk that split them (traces come in completion order) would leave every group of one: no signal.
        """
        chunks: list[list[str]] = [[]]
        for members in dataset.scenario_groups().values():
            if chunks[-1] and len(chunks[-1]) + len(members) > per:
                chunks.append([])
            chunks[-1].extend(members)
        return chunks

    def fit_online(self, app: Any, scenarios: Any, iterations: int, *, resume: bool = False,
                   scenarios_per_iteration: int | None = None, time_budget_s: float | None = None) -> list[dict[str, Any]]:
        """On-policy MARFT: K episodes per scenario through `app`, mine, score, update, publish.

        `app` is a `WrappedGraph` (its episodes read back from its own records) or any collector with `collect(...)`
        (`distributed.RayCollector`: rollout workers on Ray; what it reports in `last_stats` joins the metrics). Each iteration runs every
        scenario, or with `scenarios_per_iteration=n` the next `n` of them (cycling through the list, so a long list
        is a stream of fresh problems). With `time_budget_s` no iteration starts that would, at the pace of the
        previous one, end past the budget. One progress bar shows the iterations, the live team reward and an ETA.
        With ``dynamic_sampling: true`` the scenario groups whose returns are all equal stay out of the update and the
        iteration draws the next scenarios to refill them (`_dynamic_sample`, docs/training.md "Dynamic sampling").
        """
        if resume:
            self.resume()
        if scenarios_per_iteration is not None and scenarios_per_iteration < 1:
            raise ValueError(f"scenarios_per_iteration must be >= 1, got {scenarios_per_iteration}")
        collector = app if isinstance(app, Collector) else GraphCollector(
            app, concurrency=self.cfg.rollout_concurrency, run_id=self.run_id)
        items = list(scenarios)
        if not items:
            raise ValueError("fit_online needs at least one scenario")
        from marft_lg.rewards.requirements import uncomputable

        app_of = getattr(collector, "app", None)
        problems = uncomputable(self.reward, scenarios=items, fresh=True,
                                resumes=None if app_of is None else getattr(app_of, "resume", None) is not None)
        if problems:
            raise ValueError("the reward can never be computed on on-policy episodes: " + "; ".join(problems))
        by_id = {s.scenario_id: s.to_dict() for s in items}
        objects = {s.scenario_id: s for s in items}
        if self.cfg.credit == "counterfactual" and not callable(getattr(collector, "run", None)):
            raise TypeError(f"credit: counterfactual replays episodes through the collector's run(jobs); "
                            f"{type(collector).__name__} has none")
        # a warm start's or offline update's changes are made in place, under the served version's name: give them
        # their own version first, so every span names weights the registry holds and the old version (`live`, the
        # untuned team) is served from its files again, not as the weights the trainer changed
        self.publish()
        rows = []
        start_iter = self.online_done
        deadline = time.perf_counter() + time_budget_s if time_budget_s is not None else None
        last_s = 0.0
        with progress_bar(iterations - start_iter, "online MARFT", self.progress) as advance:
            reporting = isinstance(collector, ReportingCollector)
            if reporting:  # a collector that reports (episodes per rollout worker) shows it on the bar
                collector.progress = getattr(advance, "note", None)
            for it in range(start_iter, iterations):
                if deadline is not None and rows and time.perf_counter() + last_s > deadline:
                    break
                t0 = time.perf_counter()
                sampling = self.cfg.dynamic_sampling
                batch = self._online_batch(items, it, scenarios_per_iteration, self.extra_scenarios)
                dataset = collector.collect(batch, self.cfg.group_size, self.iteration, self.cfg.seed)
                prefetch = reporting and collector.async_ and it + 1 < iterations  # the next rollouts overlap the update
                if prefetch and not sampling:
                    self._prefetch(collector, items, it + 1, scenarios_per_iteration)
                times = {"rollout_s": time.perf_counter() - t0, "scoring_s": 0.0}
                collected = self._scored(dataset, by_id, times)
                train, groups, extra = collected, None, {}
                if sampling:
                    sample = self._dynamic_sample(collector, collected, items, it, scenarios_per_iteration, by_id,
                                                  times)
                    if prefetch:  # after the draws: they move the next iteration's scenarios on
                        self._prefetch(collector, items, it + 1, scenarios_per_iteration)
                    collected, train, groups = sample.collected(), sample.kept(), sample.groups
                    extra["dynamic_sampling"] = sample.report()
                extra.update(collector.last_stats if reporting else {})  # e.g. episodes per rollout worker
                if sampling and not sample.informative:
                    row = self._skipped_iteration(self._nothing_informative(sample, "online"), collected,
                                                  {**groups.counts(), **extra}, t0, times)
                else:
                    credit = (self._credit(collector, train.dataset, train.action_rewards, objects)
                              if self.cfg.credit == "counterfactual" else None)
                    row = self._iteration(train.dataset, train.action_rewards, train.table, phase="online",
                                          extra=extra, credit=credit, report=collected, groups=groups, started=t0,
                                          times=times)
                self._publish(row)
                self.online_done += 1
                rows.append(row)
                self._maybe_checkpoint()
                last_s = time.perf_counter() - t0
                advance(row.get("reward_mean"))
        if rows and all(r.get("skipped_update") for r in rows):
            raise TrainingDataError(f"no on-policy iteration of this call had anything to train: {rows[-1]['skipped_update']}")
        self._finish()
        return rows

    def _skipped_iteration(self, why: str, collected: Scored, extra: dict[str, Any], started: float,
                           times: dict[str, float]) -> dict[str, Any]:
        """The row of an on-policy iteration whose update is skipped (dynamic sampling found no informative group in
        its draws): its rewards and why, no update; the run goes on (every iteration skipped is an error)."""
        log.warning("%s; this iteration's update is skipped", why)
        table = collected.table
        scored = table[table["scored"].astype(bool)] if table is not None and len(table) else None
        rewards = scored["reward"].astype(float) if scored is not None and len(scored) else None
        row = {"iteration": self.iteration, "phase": "online", "episodes": len(collected.dataset),
               "reward_mean": float(rewards.mean()) if rewards is not None else None,
               "reward_std": float(rewards.std(ddof=0)) if rewards is not None else None,
               "actions": 0, "trained_agents": [], "updated_agents": [], "agents": {}, "skipped_update": why,
               "iteration_s": time.perf_counter() - started, **times, **extra}
        self.metrics.log(row)
        self.iteration += 1
        return row

    @staticmethod
    def _online_batch(items: list[Any], it: int, per_iteration: int | None, offset: int = 0) -> list[Any]:
        """Iteration `it`'s scenarios: all of them, or the next `per_iteration` (cycling through the list; `offset`:
        the scenarios dynamic sampling's extra draws took before it, `extra_scenarios`)."""
        if per_iteration is None:
            return items
        return [items[(it * per_iteration + offset + j) % len(items)] for j in range(per_iteration)]

    def _prefetch(self, collector: Any, items: list[Any], it: int, per_iteration: int | None) -> None:
        collector.prefetch(self._online_batch(items, it, per_iteration, self.extra_scenarios), self.cfg.group_size,
                           self.iteration + 1, self.cfg.seed)

    def _scored(self, dataset: TrajectoryDataset, scenarios: dict[str, Any], times: dict[str, float]) -> Scored:
        """`dataset` scored, its scoring time added to `times["scoring_s"]`."""
        t0 = time.perf_counter()
        table, action_rewards = self._scores(dataset, scenarios)
        times["scoring_s"] += time.perf_counter() - t0
        return Scored(dataset, table, action_rewards)

    def _dynamic_sample(self, collector: Any, first: Scored, items: list[Any], it: int, per_iteration: int | None,
                        scenarios: dict[str, Any], times: dict[str, float]) -> DynamicSample:
        """``dynamic_sampling``: the iteration's first draw less its uninformative groups, refilled from the next
        scenarios of the cycling list (one scenario per missing group, `dynamic_sampling_max_draws` extra rounds at
        most, each with episode ids and seeds of its own: `draw_iteration`). Short of informative groups it warns;
        with none the caller skips the iteration's update (`_skipped_iteration`)."""
        size = per_iteration or len(items)
        sample = DynamicSample(size, drop_single=True)
        sample.add(first)
        extra = 0
        while sample.missing and extra < self.cfg.dynamic_sampling_max_draws:
            extra += 1
            start = it * size + self.extra_scenarios + size  # right after this iteration's earlier draws
            more = [items[(start + j) % len(items)] for j in range(sample.missing)]
            self.extra_scenarios += len(more)
            t0 = time.perf_counter()
            dataset = collector.collect(more, self.cfg.group_size, draw_iteration(self.iteration, extra), self.cfg.seed)
            times["rollout_s"] += time.perf_counter() - t0
            sample.add(self._scored(dataset, scenarios, times))
        if sample.missing and sample.informative:
            report = sample.report()
            log.warning("iteration %d (online): dynamic sampling found %d of %d informative scenario groups in %d "
                        "draw(s) (dynamic_sampling_max_draws: %d); training on those, %d episode(s) of %d group(s) "
                        "whose returns were all equal or unscored left out", self.iteration, sample.informative,
                        size, report["draws"], self.cfg.dynamic_sampling_max_draws, report["dropped_episodes"],
                        report["dropped_groups"])
        return sample

    def _nothing_informative(self, sample: DynamicSample, phase: str) -> str:
        report = sample.report()
        drawn = (f"in {report['draws']} draw(s) (dynamic_sampling_max_draws: {self.cfg.dynamic_sampling_max_draws})"
                 if phase == "online" else "in this iteration's chunk of the dataset")
        return (f"iteration {self.iteration} ({phase}): nothing to train: dynamic sampling dropped every scenario "
                f"group {drawn}: {report['dropped_equal']} group(s) whose episodes all got the same return, "
                f"{report['dropped_single']} with fewer than 2 scored episodes ({report['dropped_episodes']} "
                "episode(s) dropped). Check that the reward tells episodes apart, raise dynamic_sampling_max_draws, "
                "or turn dynamic_sampling off")

    # ---- one iteration ---------------------------------------------------------------------------
    def _iteration(self, dataset: TrajectoryDataset, action_rewards: dict, table: pd.DataFrame | None, *,
                   phase: str, extra: dict[str, Any] | None = None, credit: Replayed | None = None,
                   report: Scored | None = None, groups: ReturnGroups | None = None, started: float | None = None,
                   times: dict[str, float] | None = None) -> dict[str, Any]:
        """Update on `dataset` (the episodes trained on) and log the row. `report`: the episodes the row's rewards and
        waste describe, when more were collected than trained on (dynamic sampling); `groups` their return groups;
        `started`: when the iteration began (its rollouts and scoring, `times`, come before this call)."""
        cfg = self.cfg
        t0 = time.perf_counter()
        several = len(self.bases) > 1
        data, rewards = (credit.dataset, credit.action_rewards) if credit is not None else (dataset, action_rewards)
        buffer = build_buffer(data, rewards, {n: b.tokenizer for n, b in self.bases.items()},
                              max_context=cfg.max_context, behaviour_logprobs=cfg.behaviour_logprobs,
                              agents=self.roles, base_of=self.base_of.__getitem__,
                              critic_base=self.critic.on if self.critic is not None and several else None,
                              credit=credit.advantages if credit is not None else None)
        if buffer.retokenised:
            log.warning("iteration %d: prompts re-rendered from messages (no token ids in the trace) for %s; they may "
                        "differ from what the model saw: mine the server's records too (`marft-lg serve` keeps them)",
                        self.iteration, ", ".join(f"{a}: {n}" for a, n in sorted(buffer.retokenised.items())))
        agents = self._agents_to_train(buffer.records)
        if not buffer.records:
            raise TrainingDataError(f"iteration {self.iteration} ({phase}): nothing to train: "
                                    f"{self._why_no_records(data, buffer, table)}")
        restored: list[str] = []
        updated: list[str] = []
        post: dict[str, dict[str, float]] = {}
        with ExitStack() as paused:  # every base's serving pauses while its adapters change
            for b in self.bases.values():
                paused.enter_context(b.policy.exclusive())
            batch = build_batch(buffer, {n: b.batch_base() for n, b in self.bases.items()}, cfg, agents=agents,
                                adapter_for=self._adapter_for, critic=self.critic, on_policy=self._on_policy,
                                current_adapter=lambda r: self.adapter_names[r.agent])
            self._check_problems(batch, agents, phase)
            snaps = {a: AdapterSnapshot.take(self._model(a), self.adapter_names[a], self.optimizers[a])
                     for a in agents}
            stats = self._update(batch, agents)
            for a in agents:
                self.update_steps[a] = self.update_steps.get(a, 0) + stats.agents[a].steps
            for a in agents:
                if stats.agents[a].steps == 0:
                    continue
                model = self._model(a)
                finite = adapter_finite(model, self.adapter_names[a])
                kl, entropy = (post_update_check(model, batch, batch.indices([a]), self.adapter_names[a], cfg,
                                                 self.bases[self.base_of[a]].pad_id)
                               if finite else (float("nan"), float("nan")))
                post[a] = {"approx_kl": kl, "entropy": entropy}
                reason = self.detector.check(a, entropy=entropy, approx_kl=kl, params_finite=finite)
                if reason is None:
                    self.detector.accept(a, entropy)
                    updated.append(a)
                else:
                    snaps[a].restore(model, self.adapter_names[a], self.optimizers[a])
                    restored.append(reason)
                    log.warning("iteration %d: restored the last good adapter: %s", self.iteration, reason)
        self.update_count += 1
        now = time.perf_counter()
        elapsed = now - t0
        shown = report or Scored(dataset, table, action_rewards)
        replay_s = float(credit.stats.get("replay_s", 0.0)) if credit is not None else 0.0
        row = metrics_row(iteration=self.iteration, phase=phase, dataset=shown.dataset,
                          action_rewards=shown.action_rewards, table=shown.table, buffer=buffer, stats=stats,
                          agents=agents, restored=restored, elapsed=elapsed, frozen_roles=self.frozen_roles,
                          agent_bases=self.base_of, problems=list(batch.problems.values()), groups=groups,
                          trained=len(batch.trained), zero_advantage=len(batch.zero_advantage),
                          times={**(times or {}), "replay_s": replay_s, "update_s": elapsed},
                          wall_s=now - (started if started is not None else t0))
        row["post_update"] = post
        row["off_policy_actions"] = batch.off_policy
        row["updated_agents"] = updated
        row.update(extra or {})
        if credit is not None:
            row.update(credit.stats)
        self.unpublished.update(updated)
        self.metrics.log(row)
        self.iteration += 1
        return row

    def _check_problems(self, batch: TrainBatch, agents: list[str], phase: str) -> None:
        """Count and name the records that failed a data check; stop (`TrainingDataError`) under
        ``on_data_mismatch: error``, or when no record of `agents` is left to train."""
        problems = list(batch.problems.values())
        self.data_problems.update(p.kind for p in problems)
        where = f"iteration {self.iteration} ({phase})"
        if problems and self.cfg.on_data_mismatch == "error":
            raise TrainingDataError(f"{where}: {len(problems)} action(s) failed the data checks "
                                    f"{problem_counts(problems)} (on_data_mismatch: error):\n{named(problems)}")
        if problems:
            log.warning("%s: %d action(s) left out of the update, their records failed the data checks %s:\n%s",
                        where, len(problems), problem_counts(problems), named(problems))
        if not batch.trained:
            if not agents:
                why = f"no action of the trained agents {self.roles}"
            else:
                why = (f"all {len(problems)} action(s) of {agents} failed the data checks "
                       f"{problem_counts(problems)}:\n{named(problems)}")
            raise TrainingDataError(f"{where}: nothing to train: {why}")

    @staticmethod
    def _why_no_records(dataset: TrajectoryDataset, buffer: RolloutBuffer, table: pd.DataFrame | None) -> str:
        """Why an iteration's buffer is empty: no episodes, none scored (with the scorer's first error), only frozen
        agents' actions, or every action left out (by reason)."""
        if not len(dataset.actions):
            return f"its {len(dataset)} episode(s) hold no action"
        if set(buffer.skipped) == {"unscored_episode"} and not buffer.frozen:
            errors = [] if table is None or "error" not in table.columns else [e for e in table["error"] if e]
            first = f" (first error: {errors[0]})" if errors else ""
            return f"no scored episode: the reward scored none of the {len(dataset)} episode(s){first}"
        if buffer.frozen and not buffer.skipped:
            return f"no action of the trained agents; only frozen agents acted {dict(buffer.frozen)}"
        return f"every action was left out {dict(buffer.skipped)} (frozen agents: {dict(buffer.frozen)})"

    def _update(self, batch: TrainBatch, agents: list[str]) -> UpdateStats:
        """The policy update of `agents`, base by base (each base's adapters on its own model), then the value
        head(s) on every record they value."""
        stats = UpdateStats()
        for name, b in self.bases.items():
            mine = [a for a in agents if self.base_of[a] == name]
            if not mine:
                continue
            part = ppo_update(b.model, batch, self.cfg, agents=mine, adapter_names=self.adapter_names,
                              optimizers=self.optimizers, pad_id=b.pad_id, generator=self.generator)
            stats.agents.update(part.agents)
            stats.tokens += part.tokens
            stats.nonfinite += part.nonfinite
        if self.critic is not None:
            losses, norms = [], []
            for name, head in self.critic.heads.items():
                idx = [i for i, r in enumerate(batch.records)
                       if self.critic.base_for(r) == name and i not in batch.problems]
                if idx:
                    value_update(head, self.critic_optimizers[name], batch, idx, self.cfg, self.generator, stats)
                    losses.append(stats.value_loss)
                    norms.append(stats.critic_grad_norm)
            stats.value_loss = float(np.mean(losses)) if losses else 0.0
            stats.critic_grad_norm = float(np.mean(norms)) if norms else 0.0
            stats.explained_variance = explained_variance(batch, batch.trained)
        return stats

    def _model(self, role: str) -> torch.nn.Module:
        return self.bases[self.base_of[role]].model

    def _agents_to_train(self, records: list[ActionRecord]) -> list[str]:
        present = [r for r in self.roles if any(rec.agent == r for rec in records)]
        if self.cfg.update_scheme == "simultaneous":
            return present
        # agent by agent, across bases: the role whose turn it is, or, when it has no actions in this batch (a
        # worker the supervisor did not call), the next role in turn that has some: a turn is never spent on a
        # role with nothing to learn
        start = (self.update_count // self.cfg.agent_iteration_interval) % len(self.roles)
        for k in range(len(self.roles)):
            role = self.roles[(start + k) % len(self.roles)]
            if role in present:
                return [role]
        return []

    def _on_policy(self, record: ActionRecord) -> bool:
        """The record was sampled by the weights its role's adapter holds now: its span names the version the role
        serves, and the role has not been updated since (the data checks recompute its log-probs)."""
        version = self.adapter_names[record.agent].split("@", 1)[-1]
        return record.adapter_version == version and record.agent not in self.unpublished

    def _adapter_for(self, record: ActionRecord) -> str:
        """The adapter a span names (for recomputing behaviour log-probs), or the role's current one."""
        version = record.adapter_version
        if version and isinstance(self.team, Publisher) and self.team.registry is not None:
            try:
                return self.team.adapter_name(record.agent, version)
            except Exception as exc:  # the named version is gone: fall back, and say so
                log.warning("span of %s/%s names adapter version %r which cannot be loaded (%s); "
                            "recomputing with the current adapter", record.episode_id, record.order, version, exc)
        return self.adapter_names[record.agent]

    # ---- counterfactual credit -------------------------------------------------------------------
    def _replay_runner(self, app: Any, phase: str) -> Any:
        """What runs an offline phase's replays (None: that phase uses the group baseline)."""
        if self.cfg.credit != "counterfactual":
            return None
        if app is None:
            log.warning("credit: counterfactual needs the app to replay the %s phase's episodes (replay_app=); "
                        "this phase uses the group baseline", phase)
            return None
        if callable(getattr(app, "run", None)) and not hasattr(app, "replay"):
            return app
        return GraphCollector(app, concurrency=self.cfg.rollout_concurrency, run_id=self.run_id)

    def _credit(self, runner: Any, dataset: TrajectoryDataset, action_rewards: dict,
                scenarios: dict[str, Any]) -> Replayed:
        cfg = self.cfg
        budget = ReplayBudget(per_action=cfg.replays_per_action, agents=cfg.replay_agents or self.roles,
                              fraction=cfg.replay_fraction, tools=cfg.replay_tools, reference=cfg.replay_reference)
        return replay_credit(runner, dataset, action_rewards, scenarios, budget, score=self._scores, roles=self.roles,
                             seed=derive_seed(cfg.seed, "credit", self.iteration), tag=f"-i{self.iteration}")

    # ---- rewards ---------------------------------------------------------------------------------
    def _scores(self, dataset: TrajectoryDataset, scenarios: Any) -> tuple[pd.DataFrame, dict[str, np.ndarray]]:
        if scenarios is not None and not isinstance(scenarios, dict):
            scenarios = {s.scenario_id: s.to_dict() for s in scenarios}
        if isinstance(self.reward, Scorer):
            result = self.reward.score(dataset, scenarios)
            return result.episodes, dict(result.action_rewards)
        rows, action_rewards = [], {}
        for ep in dataset.iter_episodes(scenarios):
            value = float(self.reward(ep))
            r = np.zeros(len(ep.actions))
            if len(r):
                r[-1] = value
            action_rewards[ep.episode_id] = r
            rows.append({"episode_id": ep.episode_id, "reward": value, "scored": True, "error": None})
        return pd.DataFrame(rows, columns=["episode_id", "reward", "scored", "error"]), action_rewards

    # ---- publishing (online) ---------------------------------------------------------------------
    def publish(self, roles: Iterable[str] | None = None, metrics: Mapping[str, float] | None = None) -> dict[str, str]:
        """Save `roles` (default: every role changed since its last version, such as by a warm start or an offline
        update) as new registry versions and serve them, so what is compared or promoted is what was trained.
        ``{role: version}``; nothing without a Team with a registry."""
        if not isinstance(self.team, Publisher) or self.team.registry is None:
            return {}
        published = {}
        for role in sorted(self.unpublished) if roles is None else roles:
            version = self.team.save_version(role, run_id=self.run_id,
                                             metrics={**(metrics or {}), "iteration": float(self.iteration)})
            self.team.load_version(role, version)
            self._rebind(role, self.team.adapter_name(role))
            record_published(self.tracker, self.team.registry, role, version, iteration=self.iteration)
            published[role] = version
            self.unpublished.discard(role)
        return published

    def _publish(self, row: dict[str, Any]) -> None:
        """An on-policy iteration's updated adapters, published so the next rollouts name their versions."""
        row["published"] = self.publish(row.get("updated_agents", []), {"reward_mean": row.get("reward_mean") or 0.0})

    def _rebind(self, role: str, adapter: str) -> None:
        """Point `role`'s optimizer at a newly loaded adapter with identical weights, keeping Adam state."""
        if adapter == self.adapter_names[role]:
            return
        state = self.optimizers[role].state_dict()
        self.adapter_names[role] = adapter
        self.optimizers[role] = self._adam(role, adapter)
        self.optimizers[role].load_state_dict(state)

    def _adam(self, role: str, adapter: str) -> torch.optim.Optimizer:
        params = adapter_parameters(self._model(role), adapter)
        if not params:
            raise ValueError(f"adapter {adapter!r} of role {role!r} has no parameters in the model; is it loaded?")
        return adam(params, lr=self.cfg.lr_for(role), eps=self.cfg.adam_eps)

    # ---- checkpoints -----------------------------------------------------------------------------
    def _adapters(self) -> dict[str, list[torch.nn.Parameter]]:
        return {r: adapter_parameters(self._model(r), n) for r, n in self.adapter_names.items()}

    def save_checkpoint(self) -> Path:
        return save_checkpoint(self.run_dir, self.iteration, adapters=self._adapters(), adapter_names=self.adapter_names,
                               state=trainer_state(self))

    def _maybe_checkpoint(self) -> None:
        if self.iteration % self.cfg.checkpoint_every == 0:
            self.save_checkpoint()

    def resume(self) -> ResumeReport:
        """Continue from the newest checkpoint of the run directory that loads.

        Newer checkpoints that are missing, truncated, damaged or from an older marft_lg are skipped (the
        report says which and why); metrics rows after the checkpoint's iteration are dropped, as is a
        half-written last row, so no row is duplicated when the run goes on. The returned `ResumeReport`
        is falsy when the run directory has no checkpoint (the run starts from iteration 0, its old metrics
        rows dropped). Raises `CheckpointError` when checkpoints exist but none can be used, `MetricsError`
        when metrics.jsonl is damaged before its last line.
        """
        return resume_trainer(self, self._adapters())

    # ---- reporting -------------------------------------------------------------------------------
    def _finish(self) -> None:
        if self.data_problems:
            log.warning("%d action(s) of this run were left out of its updates, their records failed the data checks "
                        "%s (metrics.jsonl: data_check_failed, data_problems)", sum(self.data_problems.values()),
                        dict(self.data_problems))
        if self.cfg.plots:
            for plot in plot_run(self.run_dir):
                self.tracker.log_file(plot, "plots")

    def close(self, status: str = "FINISHED") -> None:
        """End the run in its trackers (FINISHED, FAILED or KILLED); metrics.jsonl needs no closing."""
        self.tracker.finish(status)
