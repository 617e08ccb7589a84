"""Guards against the collapse the MARFT paper reports (sec. 5.2): non-finite numbers, entropy surges
and KL blow-ups. A failed check restores the last good adapters and optimizer states."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch

from marft_lg.training.policy import adapter_parameters


@dataclass
class AdapterSnapshot:
    """In-memory copy of one adapter's tensors and its optimizer state (LoRA: a few MB)."""

    tensors: list[torch.Tensor]
    optimizer_state: dict

    @classmethod
    def take(cls, model: torch.nn.Module, adapter: str, optimizer: torch.optim.Optimizer) -> AdapterSnapshot:
        return cls([p.detach().clone() for p in adapter_parameters(model, adapter)],
                   copy.deepcopy(optimizer.state_dict()))

    def restore(self, model: torch.nn.Module, adapter: str, optimizer: torch.optim.Optimizer) -> None:
        with torch.no_grad():
            for p, saved in zip(adapter_parameters(model, adapter), self.tensors, strict=True):
                p.copy_(saved)
        optimizer.load_state_dict(self.optimizer_state)


@dataclass
class CollapseDetector:
    """Per-agent checks after an update; `check` returns a reason to roll back, or None.

    Entropy surge: mean entropy above `entropy_surge` x its running mean (EMA of accepted updates).
    KL blow-up: the update's approx KL above `kl_blowup`. A surge must also add `min_surge_nats`
    so a near-deterministic policy (entropy ~0) does not trip it on noise.
    """

    entropy_surge: float = 3.0
    kl_blowup: float = 1.0
    ema: float = 0.9
    min_surge_nats: float = 0.5
    entropy_mean: dict[str, float] = field(default_factory=dict)

    def check(self, agent: str, *, entropy: float, approx_kl: float, params_finite: bool) -> str | None:
        if not params_finite:
            return f"{agent}: adapter weights became non-finite"
        if not (math.isfinite(entropy) and math.isfinite(approx_kl)):
            return f"{agent}: non-finite entropy ({entropy}) or approx KL ({approx_kl})"
        if approx_kl > self.kl_blowup:
            return f"{agent}: approx KL {approx_kl:.4g} > kl_blowup {self.kl_blowup} (policy moved too far)"
        ref = self.entropy_mean.get(agent)
        if ref is not None and entropy > self.entropy_surge * ref and entropy - ref > self.min_surge_nats:
            return (f"{agent}: entropy surge {entropy:.4g} > {self.entropy_surge} x running mean {ref:.4g} "
                    "(the paper's sec. 5.2 collapse)")
        return None

    def accept(self, agent: str, entropy: float) -> None:
        ref = self.entropy_mean.get(agent)
        self.entropy_mean[agent] = entropy if ref is None else self.ema * ref + (1 - self.ema) * entropy

    def state_dict(self) -> dict:
        return {"entropy_mean": dict(self.entropy_mean)}

    def load_state_dict(self, state: dict) -> None:
        self.entropy_mean = dict(state.get("entropy_mean", {}))


def adapter_finite(model: torch.nn.Module, adapter: str) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in adapter_parameters(model, adapter))
