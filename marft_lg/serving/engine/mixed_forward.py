"""Forward passes with one LoRA adapter per batch row.

`RowAdapters` is the serving path: one base pass plus each row's delta from stacked adapter matrices.
`mixed_adapter_forward` is peft's ``adapter_names=`` path (drift checks, tests), made safe: peft
registers a pre-forward hook per LoRA layer for the call and removes them after a normal return
only, so a forward that raises (CUDA out of memory, a bad input) left every later call running with
the failed call's adapter list. `mixed_adapter_forward` removes them on the way out.
"""

from __future__ import annotations

import functools
from typing import Any

BASE = "__base__"  # peft's name for "no adapter" inside a mixed batch


def mixed_adapter_forward(model: Any, adapter_names: list[str], **kwargs: Any) -> Any:
    """``model(adapter_names=adapter_names, **kwargs)``; peft's per-call hooks are gone afterwards, also on error."""
    try:
        return model(adapter_names=adapter_names, **kwargs)
    except BaseException:
        drop_stale_adapter_hooks(model)
        raise


def drop_stale_adapter_hooks(model: Any) -> int:
    """Remove peft ``adapter_names`` pre-forward hooks left behind by a failed call; returns how many."""
    try:
        from peft.tuners.lora.model import _adapter_names_pre_forward_hook
    except ImportError:  # pragma: no cover - another peft layout: nothing we know how to clean
        return 0
    removed = 0
    for module in model.modules():
        hooks = module._forward_pre_hooks
        for key, hook in list(hooks.items()):
            if isinstance(hook, functools.partial) and hook.func is _adapter_names_pre_forward_hook:
                del hooks[key]
                module._forward_pre_hooks_with_kwargs.pop(key, None)
                removed += 1
    return removed


class RowAdapters:
    """One base pass for a batch whose rows use different LoRA adapters, plus each row's own delta.

    Every adapter's ``A`` matrices are stacked into one ``[R, in]`` matrix per layer and their scaled
    ``B`` matrices into one ``[out, R]`` (R = the sum of their ranks), as multi-LoRA servers do: a row's
    delta is ``((x @ A_all.T) * mask_row) @ B_all.T``, where the mask keeps that row's adapter's columns.
    That is two small matmuls per layer whatever the mix, instead of peft's ``adapter_names=`` path,
    which gathers and scatters each adapter's rows at every layer. Rows named `BASE` get no delta.
    Built for a set of adapters whose weights do not change while it is used (one serving session).
    """

    def __init__(self, model: Any, adapters: list[str]):
        import torch
        from peft.tuners.tuners_utils import BaseTunerLayer

        self.model = model
        self.adapters = list(dict.fromkeys(a for a in adapters if a != BASE))
        self.tuner_layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
        self.layers: list[tuple[Any, Any, Any, list[tuple[int, int]]]] = []
        for module in self.tuner_layers:
            a_parts, b_parts, spans, width = [], [], [], 0
            for name in self.adapters:
                if name not in getattr(module, "lora_A", {}):
                    spans.append((width, width))
                    continue
                a = module.lora_A[name].weight
                a_parts.append(a)
                b_parts.append(module.lora_B[name].weight * module.scaling[name])
                spans.append((width, width + a.shape[0]))
                width += a.shape[0]
            if a_parts:
                self.layers.append((module, torch.cat(a_parts).detach(), torch.cat(b_parts, dim=1).detach(), spans))
        # per layer, row i of the indicator marks adapter i's columns; the last row (no adapter) is all zero
        self._indicators = []
        for _, a_all, _, spans in self.layers:
            ind = torch.zeros((len(self.adapters) + 1, a_all.shape[0]), dtype=a_all.dtype, device=a_all.device)
            for i, (lo, hi) in enumerate(spans):
                ind[i, lo:hi] = 1
            self._indicators.append(ind)
        self._masks: dict[tuple[str, ...], list[Any]] = {}

    @staticmethod
    def supported(model: Any, adapters: list[str]) -> bool:
        """True when every adapter is plain LoRA on linear layers (no DoRA or other variant, no LoRA bias)."""
        from peft.tuners.lora.layer import Linear as LoraLinear
        from peft.tuners.tuners_utils import BaseTunerLayer

        names = {a for a in adapters if a != BASE}
        for module in model.modules():
            if not isinstance(module, BaseTunerLayer):
                continue
            mine = names & set(getattr(module, "lora_A", {}))
            if not mine:
                continue
            if type(module) is not LoraLinear or any(
                    n in module.lora_variant or module.lora_bias.get(n) or module.merged for n in mine):
                return False
        return True

    def masks(self, rows: list[str]) -> list[Any]:
        """Per layer, the ``[rows, R]`` column mask selecting each row's adapter (kept per row composition)."""
        import torch

        key = tuple(rows)
        if key not in self._masks:
            if len(self._masks) > 64:
                self._masks.clear()
            col = {name: i for i, name in enumerate(self.adapters)}
            idx = torch.tensor([col.get(name, len(self.adapters)) for name in rows])
            self._masks[key] = [ind[idx.to(ind.device)] for ind in self._indicators]
        return self._masks[key]

    def forward(self, masks: list[Any], **kwargs: Any) -> Any:
        """``model(**kwargs)`` with peft's adapters off and each row's delta added (`masks` from `masks`)."""
        import torch.nn.functional as F

        def add_delta(a_all, b_all, mask, _module, args, output):
            x = args[0].to(a_all.dtype)
            xa = F.linear(x, a_all) * (mask[:, None, :] if x.dim() == 3 else mask)
            return output + F.linear(xa, b_all).to(output.dtype)

        saved = [(m, m._disable_adapters) for m in self.tuner_layers]
        handles = []
        try:
            for m, _ in saved:
                m._disable_adapters = True
            for (module, a_all, b_all, _), mask in zip(self.layers, masks, strict=True):
                handles.append(module.register_forward_hook(functools.partial(add_delta, a_all, b_all, mask)))
            return self.model(**kwargs)
        finally:
            for h in handles:
                h.remove()
            for m, flag in saved:
                m._disable_adapters = flag
