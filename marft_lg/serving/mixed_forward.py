"""A forward pass with one LoRA adapter per batch row (peft's ``adapter_names=``) that cannot poison the model.

peft registers a pre-forward hook per LoRA layer for the call and removes them after a normal
return only: when the forward raises (CUDA out of memory, a bad input), the hooks stay and every
later call runs with the failed call's adapter list ("Length of `adapter_names` should be the
same as the number of inputs"). `mixed_adapter_forward` removes them on the way out.
"""

from __future__ import annotations

import functools
from typing import Any


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
