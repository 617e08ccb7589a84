"""What a checkpoint holds of the trainer (`trainer_state`) and how a run goes on from one (`resume_trainer`).

The adapters themselves are saved and checked by `checkpoint.py`; this is the rest of the trainer's state
(counters, optimizers, value heads, the minibatch generator, the collapse detector) and the repair of the
metrics log, so a resumed run equals an uninterrupted one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from marft_lg.training.checkpoint import Adapters, apply_adapters, find_resumable, rng_state, set_rng_state

if TYPE_CHECKING:
    from marft_lg.training.trainer import MARFTTrainer

log = logging.getLogger("marft_lg.training")


@dataclass
class ResumeReport:
    """What `MARFTTrainer.resume` did: the checkpoint used (None: none, the run starts from 0), the newer
    checkpoints it skipped and why, and what it repaired. Truthy when it resumed from a checkpoint."""

    path: Path | None = None
    iteration: int = 0
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.path is not None

    def lines(self) -> list[str]:
        out = list(self.notes)
        out += [f"skipped checkpoint {p.name}: {reason}" for p, reason in self.skipped]
        if self.path is not None:
            out.append(f"resumed from {self.path} (iteration {self.iteration})")
        return out


def trainer_state(tr: MARFTTrainer) -> dict[str, Any]:
    """The trainer's state beside its adapters, as a checkpoint stores it."""
    return {"iteration": tr.iteration, "update_count": tr.update_count, "offline_cursor": tr.offline_cursor,
            "online_done": tr.online_done, "extra_scenarios": tr.extra_scenarios, "warm_started": tr.warm_started, "config": tr.cfg.to_dict(), "run_id": tr.run_id,
            "unpublished": sorted(tr.unpublished),
            "update_steps": dict(tr.update_steps),
            "value_heads": {b: h.state_dict() for b, h in (tr.critic.heads.items() if tr.critic else ())},
            "optimizers": {r: o.state_dict() for r, o in tr.optimizers.items()},
            "critic_optimizers": {b: o.state_dict() for b, o in tr.critic_optimizers.items()},
            "rng": rng_state(tr.generator), "detector": tr.detector.state_dict()}


def load_trainer_state(tr: MARFTTrainer, state: dict[str, Any]) -> None:
    """Put `trainer_state`'s dict back (older checkpoints: one value head, no `unpublished` or `update_steps`)."""
    tr.iteration, tr.update_count = state["iteration"], state["update_count"]
    tr.offline_cursor, tr.online_done = state["offline_cursor"], state["online_done"]
    tr.extra_scenarios = int(state.get("extra_scenarios", 0))  # older checkpoints: no dynamic sampling
    tr.warm_started = bool(state.get("warm_started", False))  # older checkpoints: no warm start
    tr.unpublished = set(state.get("unpublished", tr.roles))  # older checkpoints: assume every role changed
    tr.update_steps = {r: 0 for r in tr.roles} | dict(state.get("update_steps", {}))
    tr.run_id = state.get("run_id", tr.run_id)
    heads, opts = state.get("value_heads") or {}, state.get("critic_optimizers") or {}
    if state.get("value_head") is not None and tr.critic is not None and len(tr.critic.heads) == 1:
        only = next(iter(tr.critic.heads))  # a checkpoint written before teams had several bases
        heads, opts = {only: state["value_head"]}, {only: state["critic_optimizer"]}
    for name, head in (tr.critic.heads.items() if tr.critic is not None else ()):
        if name in heads:
            head.load_state_dict(heads[name])
            tr.critic_optimizers[name].load_state_dict(opts[name])
    for r, s in state["optimizers"].items():
        tr.optimizers[r].load_state_dict(s)
    set_rng_state(state["rng"], tr.generator)
    tr.detector.load_state_dict(state["detector"])


def resume_trainer(tr: MARFTTrainer, adapters: Adapters) -> ResumeReport:
    """`MARFTTrainer.resume`: repair the metrics log, load the newest usable checkpoint into `adapters` and
    the trainer, drop the metrics rows it will redo."""
    report = ResumeReport()
    repaired = tr.metrics.repair()
    if repaired:
        report.notes.append(repaired)
    found = find_resumable(tr.run_dir, adapters=adapters)
    report.notes.extend(found.notes)
    report.skipped = [(s.path, s.reason) for s in found.skipped]
    ckpt = found.checkpoint
    if ckpt is None:
        dropped = tr.metrics.truncate_after(-1)
        if dropped:
            report.notes.append(f"no checkpoint under {tr.run_dir}: dropped {dropped} metrics row(s) of the "
                                "unfinished run, which starts again from iteration 0")
        return report
    apply_adapters(ckpt, adapters=adapters)
    load_trainer_state(tr, ckpt.state)
    dropped = tr.metrics.truncate_after(tr.iteration - 1)
    if dropped:
        report.notes.append(f"dropped {dropped} metrics row(s) written after {ckpt.path.name}; those iterations "
                            "are redone")
    report.path, report.iteration = ckpt.path, tr.iteration
    for line in report.lines():
        log.info("%s", line)
    return report
