"""Where the shared base model runs and in which precision: ``device="auto"`` takes a CUDA GPU when there is one.

The serving engine, `LocalPolicy` and the trainer share these rules so a model loaded by one is
where the others expect it; ``MARFT_LG_DEVICE=cpu`` (or ``cuda:1``...) and ``MARFT_LG_DTYPE=float32``
override what ``"auto"`` picks. On CPU everything is float32 (bf16 is 2-3x slower without AVX512); on a GPU
``dtype="auto"`` loads the base weights in bfloat16 while LoRA adapters stay float32 (peft casts
them up), so small learning rates still move them.
"""

from __future__ import annotations

import os
from typing import Any

import torch

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """``"auto"``/None: ``$MARFT_LG_DEVICE`` if set, else ``cuda`` when available, else ``cpu``; anything
    else as `torch.device` takes it."""
    if device is None or device == "auto":
        device = os.environ.get("MARFT_LG_DEVICE") or "auto"
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = torch.device(device)
    if out.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r} was asked for, but torch sees no CUDA GPU "
                         f"(torch {torch.__version__}); use device='cpu' or 'auto'")
    return out


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``"auto"``/None: ``$MARFT_LG_DTYPE`` if set, else bfloat16 on a GPU that supports it, else float32;
    or a name such as ``"float32"``."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        dtype = os.environ.get("MARFT_LG_DTYPE") or "auto"
    if dtype == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"dtype {dtype!r} is not one of auto, {', '.join(sorted(_DTYPES))}") from None


def model_device(model: Any) -> torch.device:
    """The device of a model's first parameter (CPU for a model without parameters)."""
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")
