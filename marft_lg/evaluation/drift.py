"""Which agent's policy moved: mean per-token KL between two adapter versions of each agent.

Both versions score the same prompts and the same completions (the baseline's own recorded ones),
so the number says how differently the candidate would act where the baseline acted.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from marft_lg.serving.engine.mixed_forward import mixed_adapter_forward
from marft_lg.serving.engine.prefix import common_prefix_length
from marft_lg.trajectories.dataset import TrajectoryDataset

BASE_ADAPTER = "__base__"  # peft's name for "adapters disabled" in mixed-adapter batches


def mean_token_kl(
    model: Any,
    samples: Sequence[tuple[Sequence[int], Sequence[int]]],
    adapter_a: str | None,
    adapter_b: str | None,
) -> tuple[float, int]:
    """Token-weighted mean of KL(p_a || p_b) over the completion positions of (prompt, completion) samples.

    `model` is a peft.PeftModel holding both adapters (None = base model). Returns (mean KL, tokens).
    The prompt prefix all samples share (system prompt, few-shot turns) runs once per adapter and its
    cache is cut back after each sample; logits are computed at the completion positions only.
    """
    import torch
    from transformers import DynamicCache

    from marft_lg.serving.engine.device import model_device

    device = model_device(model)
    samples = [(list(p), list(c)) for p, c in samples if len(p) and len(c)]
    if not samples:
        return float("nan"), 0
    names = [adapter_a or BASE_ADAPTER, adapter_b or BASE_ADAPTER]
    forward = functools.partial(mixed_adapter_forward, model, names) if hasattr(model, "peft_config") else model
    shared = common_prefix_length([p for p, _ in samples])
    total, count = 0.0, 0
    with torch.no_grad():
        cache = None
        if shared:
            cache = DynamicCache(config=getattr(model, "config", None))
            forward(input_ids=torch.tensor([samples[0][0][:shared]] * 2, device=device), past_key_values=cache,
                    use_cache=True, logits_to_keep=1)
        for prompt, completion in samples:
            ids = torch.tensor([prompt[shared:] + completion] * 2, dtype=torch.long, device=device)
            positions = torch.arange(shared, shared + ids.shape[1], device=device)[None].expand(2, -1)
            # the last len(completion)+1 positions; all but the last predict the completion tokens
            logits = forward(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=cache is not None,
                             logits_to_keep=len(completion) + 1).logits[:, :-1].float()
            if cache is not None:
                cache.crop(shared)
            lp = torch.log_softmax(logits, dim=-1)
            kl = (lp[0].exp() * (lp[0] - lp[1])).sum(-1)
            total += float(kl.sum())
            count += int(kl.numel())
    return (total / count if count else float("nan")), count


def _samples_for(dataset: TrajectoryDataset, role: str, tokenizer: Any, encode: Any, limit: int) -> list[tuple[list[int], list[int]]]:
    acts = dataset.actions[dataset.actions["agent"] == role].head(limit)
    out = []
    for a in acts.to_dict("records"):
        prompt, completion = a.get("prompt_token_ids"), a.get("completion_token_ids")
        if prompt is None or len(prompt) == 0:
            prompt = encode(a["messages"])
        if completion is None or len(completion) == 0:
            completion = tokenizer.encode(a.get("completion") or "", add_special_tokens=False)
        out.append(([int(t) for t in prompt], [int(t) for t in completion]))
    return out


def policy_drift(
    team: Any,
    baseline: Mapping[str, str],
    candidate: Mapping[str, str],
    dataset: TrajectoryDataset,
    *,
    max_prompts: int = 8,
) -> dict[str, dict[str, Any]]:
    """Per role: mean per-token KL(baseline || candidate) on up to `max_prompts` of that role's actions
    in `dataset` (usually the baseline's replay), on the role's own base model. Roles on a base without an
    in-process (hf) engine are left out; {} when no base has one."""
    from marft_lg.serving.engine.protocol import InProcessEngine
    from marft_lg.serving.types import ChatRequest

    out: dict[str, dict[str, Any]] = {}
    for role in team.agents():
        if role not in baseline or role not in candidate:
            continue
        base = team.team_of(role)
        if not isinstance(base.engine, InProcessEngine):  # a vLLM base holds no in-process model to measure
            continue
        samples = _samples_for(dataset, role, base.tokenizer,
                               lambda messages, b=base: b.engine.encode(ChatRequest(messages=messages)), max_prompts)
        name_a, name_b = base.adapter_name(role, baseline[role]), base.adapter_name(role, candidate[role])
        with base.exclusive() as model:
            kl, n_tokens = mean_token_kl(model, samples, name_a, name_b)
        out[role] = {"kl": kl, "n_tokens": n_tokens, "n_prompts": len(samples), "base": team.base_of(role),
                     "baseline": name_a.split("@", 1)[-1], "candidate": name_b.split("@", 1)[-1]}
    return out
