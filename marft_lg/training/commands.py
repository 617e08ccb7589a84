"""`marft-lg train --config train.yaml [--resume]` (registered in marft_lg/cli.py). Heavy imports stay inside.

train.yaml:

    model: embedded:smollm2-135m-instruct   # or a local transformers directory
    agents: [reasoner, actor]
    registry: registry                      # new adapter versions are written here
    versions: live                          # starting adapters: an alias, {role: ref}, or null (fresh)
    run_dir: runs/train                     # metrics.jsonl, plots, checkpoints
    reward: reward.yaml                     # CompositeReward YAML (or the mapping inline)
    scenarios: scenarios.jsonl              # references for the reward; the online phase runs them
    data: traces                            # offline data: a traces directory/glob or a parquet dataset dir
    phases: [offline, online]
    online: {app: "marft_lg.examples.math_team.graph:build_graph", iterations: 10, max_tokens: 64, split: train}
    marft: {learning_rate: 5.0e-5, ...}     # MARFTConfig keys

`online.app` is `module:function` or `file.py:function`, loaded relative to train.yaml's folder (a module or
file next to it needs no PYTHONPATH); `online.node_roles: {node: role}` maps app nodes to agent roles.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import typer

from marft_lg.loading import LoadError, load_object, parse_node_roles

DEFAULT_APP = "marft_lg.examples.math_team.graph:build_graph"
ONLINE_KEYS = ("app", "node_roles", "split", "iterations", "max_tokens", "temperature")


@dataclass
class TrainFile:
    """The train.yaml sections (unknown keys are errors that name the file)."""

    model: str = "embedded:smollm2-135m-instruct"
    agents: list[str] = field(default_factory=list)
    registry: str = "registry"
    versions: Any = "live"
    run_dir: str = "runs/train"
    reward: Any = None
    scenarios: str | None = None
    data: str | None = None
    phases: list[str] = field(default_factory=lambda: ["offline"])
    online: dict[str, Any] = field(default_factory=dict)
    marft: dict[str, Any] = field(default_factory=dict)
    path: Path | None = field(default=None, init=False, repr=False)
    """The train.yaml this was read from (not a key)."""

    @property
    def base_dir(self) -> Path | None:
        return None if self.path is None else self.path.parent

    def app_factory(self) -> Any:
        """`online.app` loaded (relative to train.yaml's folder); a bad spec is a BadParameter naming the file."""
        try:
            return load_object(self.online.get("app", DEFAULT_APP), base_dir=self.base_dir, what="online.app",
                               source=self.path)
        except LoadError as exc:
            raise typer.BadParameter(str(exc)) from None

    @classmethod
    def load(cls, path: Path) -> TrainFile:
        import difflib

        import yaml

        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise typer.BadParameter(f"{path}: expected a mapping of train.yaml keys, got {type(data).__name__}")
        known = {f.name for f in fields(cls) if f.init}
        for key in data:
            if key not in known:
                hint = difflib.get_close_matches(key, sorted(known), n=1)
                raise typer.BadParameter(f"{path}: unknown key {key!r}" + (f"; did you mean {hint[0]!r}?" if hint else
                                                                          f"; known keys: {sorted(known)}"))
        out = cls(**data)
        out.path = path.resolve()
        base = path.parent
        for name in ("registry", "run_dir", "scenarios", "data"):
            value = getattr(out, name)
            if value is not None and not Path(value).is_absolute():
                setattr(out, name, str(base / value))
        if isinstance(out.reward, str) and not Path(out.reward).is_absolute():
            out.reward = str(base / out.reward)
        bad = [p for p in out.phases if p not in ("offline", "online")]
        if bad:
            raise typer.BadParameter(f"{path}: phases {bad} unknown; use offline and/or online")
        if not out.agents:
            raise typer.BadParameter(f"{path}: agents is empty; list the agent roles, e.g. agents: [reasoner, actor]")
        if out.reward is None:
            raise typer.BadParameter(f"{path}: reward is missing; give a CompositeReward YAML path or mapping")
        if not isinstance(out.online, dict):
            raise typer.BadParameter(f"{path}: online must be a mapping, e.g. online: {{app: 'my_app:build_graph'}}")
        unknown = sorted(set(out.online) - set(ONLINE_KEYS))
        if unknown:
            raise typer.BadParameter(f"{path}: unknown online keys {unknown}; known: {list(ONLINE_KEYS)}")
        try:
            out.online["node_roles"] = parse_node_roles(out.online.get("node_roles"), source=path,
                                                        key="online.node_roles", roles=out.agents)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        return out


def _load_dataset(spec: str):
    from marft_lg.trajectories.dataset import TrajectoryDataset

    p = Path(spec)
    if p.is_dir() and (p / "episodes.parquet").exists():
        return TrajectoryDataset.from_parquet(p)
    from marft_lg.trajectories.mining import mine

    return mine([spec])


def train(
    config: Path = typer.Option(..., "--config", "-c", exists=True, dir_okay=False, help="train.yaml"),
    resume: bool = typer.Option(False, "--resume", help="continue from the run directory's latest checkpoint"),
) -> None:
    """Train the team's adapters with MARFT (offline from traces and/or on-policy through the graph)."""
    from rich.console import Console

    from marft_lg.rewards.composite import CompositeReward
    from marft_lg.rewards.registry import relative_to
    from marft_lg.serving.team import Team
    from marft_lg.training.config import MARFTConfig
    from marft_lg.training.trainer import MARFTTrainer
    from marft_lg.trajectories.scenarios import ScenarioSet

    console = Console()
    spec = TrainFile.load(config)
    build = spec.app_factory() if "online" in spec.phases else None  # a bad online.app fails before any work
    cfg = MARFTConfig.from_dict(spec.marft, source=f"{config} [marft]")
    try:
        with relative_to(spec.base_dir):  # an inline reward's custom components load relative to train.yaml
            reward = CompositeReward.from_yaml(spec.reward)
    except (ValueError, FileNotFoundError) as exc:
        raise typer.BadParameter(f"{config}: reward: {exc}") from None
    scenarios = ScenarioSet.load(spec.scenarios) if spec.scenarios else None
    team = Team(spec.model, spec.agents, registry=spec.registry, versions=spec.versions, seed=cfg.seed)
    try:
        trainer = MARFTTrainer(team, reward, cfg, spec.run_dir)
        if resume and not trainer.resume():
            console.print(f"[yellow]no checkpoint under {spec.run_dir}; starting fresh[/]")
        if "offline" in spec.phases:
            if not spec.data:
                raise typer.BadParameter(f"{config}: phase offline needs data: <traces dir or parquet dataset dir>")
            dataset = _load_dataset(spec.data)
            console.print(f"offline: {len(dataset)} episodes, {len(dataset.actions)} actions from {spec.data}")
            trainer.fit_offline(dataset, scenarios)
        if "online" in spec.phases:
            from marft_lg.graph.chat_model import TeamChatModel
            from marft_lg.graph.wrap import wrap

            if scenarios is None:
                raise typer.BadParameter(f"{config}: phase online needs scenarios: <jsonl or parquet>")
            opts = dict(spec.online)
            split = opts.get("split", "train")
            iterations = int(opts.get("iterations", 10))
            llm = TeamChatModel(team=team, max_tokens=int(opts.get("max_tokens", cfg.max_new_tokens)),
                                temperature=float(opts.get("temperature", cfg.temperature)))
            app = wrap(build(llm), team=team, trace_dir=Path(spec.run_dir) / "traces", node_roles=opts.get("node_roles"))
            chosen = scenarios.split(split) if split else scenarios
            trainer.fit_online(app, list(chosen), iterations)
        published = {}
        for role in spec.agents:
            published[role] = team.save_version(role, run_id=trainer.run_id, metrics={"iteration": float(trainer.iteration)})
        team.registry.set_alias("candidate", published, reason=f"marft-lg train run {trainer.run_id}")
        console.print(f"[green]trained[/] {trainer.iteration} iterations; adapters {published} saved as alias "
                      f"'candidate' in {spec.registry}; metrics and plots in {spec.run_dir}")
    finally:
        team.close()
