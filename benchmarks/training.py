"""Trainer benchmarks: memory of multi-agent PPO steps, chunked log-prob memory, PPO throughput.

    python benchmarks/training.py [--model embedded:smollm2-135m-instruct] [--quick]

1. Peak RSS of one PPO step (simultaneous scheme) with 4 agents vs 1 agent: one base model, N
   LoRA adapters, so the ratio should stay near 1 (target <= 1.2x).
2. Peak RSS growth of a log-prob forward+backward: chunked gather vs naive full `[B, T, V]` logits.
3. PPO update tokens/s vs a plain forward+backward (cross-entropy) over the same tokens (target >= 0.7x).
Each case runs in a fresh process so peak RSS is its own. Results: benchmarks/results/training.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _records(tokenizer, roles, per_role, prompt_len, completion_len, seed=0):
    import numpy as np
    import torch

    from marft_lg.training.buffer import ActionRecord

    g = torch.Generator().manual_seed(seed)
    out = []
    vocab = len(tokenizer)
    for i in range(per_role * len(roles)):
        ids = torch.randint(0, vocab, (prompt_len + completion_len,), generator=g).tolist()
        out.append(ActionRecord(episode_id=f"e{i}", scenario_id="s", order=0, agent=roles[i % len(roles)],
                                adapter_version="v0", prompt_ids=ids[:prompt_len], completion_ids=ids[prompt_len:],
                                behaviour_logprobs=None, reward=float(np.sin(i)), done=True, words=completion_len))
    return out


def _setup(model, n_agents, per_role, prompt_len, completion_len):
    import torch

    from marft_lg.training.buffer import RolloutBuffer
    from marft_lg.training.config import MARFTConfig
    from marft_lg.training.policy import LocalPolicy
    from marft_lg.training.ppo import compute_advantages, evaluate_critic, recompute_behaviour

    torch.set_num_threads(2)
    roles = [f"agent{i}" for i in range(n_agents)]
    pol = LocalPolicy(model, roles)
    cfg = MARFTConfig(update_scheme="simultaneous", use_critic=False, group_size=2, kl_cut=None, learning_rate=1e-5,
                      logprob_chunk=256)
    buf = RolloutBuffer(_records(pol.tokenizer, roles, per_role, prompt_len, completion_len))
    pad = pol.tokenizer.pad_token_id
    recompute_behaviour(pol.model, buf, lambda r: pol.adapter_name(r.agent), cfg, pad)
    evaluate_critic(pol.model, None, buf, cfg, pad)
    compute_advantages(buf, cfg)
    return pol, roles, cfg, buf


def case_ppo_step(model, n_agents, per_role, prompt_len, completion_len):
    """Peak RSS of one PPO step over `per_role` actions of each of `n_agents` agents... per agent."""
    import torch

    from marft_lg.training.policy import adapter_parameters
    from marft_lg.training.ppo import ppo_update

    pol, roles, cfg, buf = _setup(model, n_agents, per_role, prompt_len, completion_len)
    opts = {r: torch.optim.Adam(adapter_parameters(pol.model, pol.adapter_name(r)), lr=1e-5) for r in roles}
    t = time.perf_counter()
    stats = ppo_update(pol.model, None, buf, cfg, agents=roles, adapter_names={r: pol.adapter_name(r) for r in roles},
                       optimizers=opts, critic_optimizer=None, pad_id=pol.tokenizer.pad_token_id,
                       generator=torch.Generator().manual_seed(0))
    return {"peak_rss_mb": _peak_rss_mb(), "seconds": time.perf_counter() - t, "tokens": stats.tokens}


def case_logprob_memory(model, mode, batch, prompt_len, completion_len):
    """RSS growth of forward+backward of completion log-probs, chunked vs naive full logits."""
    import torch

    from marft_lg.training.buffer import collate
    from marft_lg.training.policy import (
        LocalPolicy,
        naive_token_logprobs,
        only_adapter_trainable,
        token_logprobs,
    )

    torch.set_num_threads(2)
    pol = LocalPolicy(model, ["a"])
    t = collate(_records(pol.tokenizer, ["a"], batch, prompt_len, completion_len), pol.tokenizer.pad_token_id)
    with only_adapter_trainable(pol.model, pol.adapter_name("a")):
        # warm-up on one row so allocator pools and lazy inits do not count as the pass's memory
        warm = t["attention_mask"][:1, :8]
        token_logprobs(pol.model, t["input_ids"][:1, :8], warm, warm)[0].sum().backward()
        base = _peak_rss_mb()
        if mode == "chunked":
            lp, _ = token_logprobs(pol.model, t["input_ids"], t["attention_mask"], t["completion_mask"], chunk_size=256)
        else:
            lp = naive_token_logprobs(pol.model, t["input_ids"], t["attention_mask"], t["completion_mask"])
        lp.sum().backward()
    return {"baseline_rss_mb": base, "peak_rss_mb": _peak_rss_mb(), "growth_mb": _peak_rss_mb() - base}


def case_throughput(model, per_role, prompt_len, completion_len, repeats):
    """Tokens/s of the PPO update vs plain forward+backward (CE on the same completion tokens)."""
    import torch

    from marft_lg.training.buffer import collate
    from marft_lg.training.policy import adapter_parameters, only_adapter_trainable
    from marft_lg.training.ppo import ppo_update

    pol, roles, cfg, buf = _setup(model, 1, per_role, prompt_len, completion_len)
    name = pol.adapter_name(roles[0])
    opt = torch.optim.Adam(adapter_parameters(pol.model, name), lr=1e-5)
    t = collate(buf.records, pol.tokenizer.pad_token_id)
    n_tokens = int(t["completion_mask"].sum())
    ppo_s, plain_s = [], []
    for _ in range(repeats):
        s = time.perf_counter()
        ppo_update(pol.model, None, buf, cfg, agents=roles, adapter_names={roles[0]: name}, optimizers={roles[0]: opt},
                   critic_optimizer=None, pad_id=pol.tokenizer.pad_token_id, generator=torch.Generator().manual_seed(0))
        ppo_s.append(time.perf_counter() - s)
        s = time.perf_counter()
        with only_adapter_trainable(pol.model, name):
            opt.zero_grad()
            logits = pol.model(input_ids=t["input_ids"], attention_mask=t["attention_mask"], use_cache=False).logits
            labels = t["input_ids"][:, 1:].masked_fill(t["completion_mask"][:, 1:] == 0, -100)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
            loss.backward()
            opt.step()
        plain_s.append(time.perf_counter() - s)
    ppo, plain = min(ppo_s), min(plain_s)
    return {"tokens": n_tokens, "ppo_tokens_per_s": n_tokens / ppo, "plain_tokens_per_s": n_tokens / plain,
            "ratio": plain / ppo}


def _sub(case: str, **kw) -> dict:
    cmd = [sys.executable, __file__, "--case", case, "--kw", json.dumps(kw)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"benchmark case {case} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded:smollm2-135m-instruct")
    ap.add_argument("--quick", action="store_true", help="smaller shapes (CI smoke)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "training.json"))
    ap.add_argument("--case")
    ap.add_argument("--kw")
    args = ap.parse_args()
    from marft_lg.serving.models import resolve_model

    model = str(resolve_model(args.model))
    if args.case:
        fn = {"ppo_step": case_ppo_step, "logprob_memory": case_logprob_memory, "throughput": case_throughput}[args.case]
        print(json.dumps(fn(model, **json.loads(args.kw))))
        return
    q = args.quick
    shape = {"prompt_len": 64 if q else 192, "completion_len": 32 if q else 64}
    from rich.progress import Progress

    results: dict = {"model": args.model, "quick": q, **shape}
    with Progress() as prog:
        task = prog.add_task("training benchmarks", total=5)
        one = _sub("ppo_step", n_agents=1, per_role=4, **shape)
        prog.advance(task)
        four = _sub("ppo_step", n_agents=4, per_role=4, **shape)
        prog.advance(task)
        results["ppo_step_rss"] = {"one_agent": one, "four_agents": four,
                                   "ratio_4_vs_1": four["peak_rss_mb"] / one["peak_rss_mb"], "target": "<= 1.2"}
        lp_shape = {"batch": 2 if q else 4, "prompt_len": 64 if q else 128, "completion_len": 128 if q else 384}
        chunked = _sub("logprob_memory", mode="chunked", **lp_shape)
        prog.advance(task)
        naive = _sub("logprob_memory", mode="naive", **lp_shape)
        prog.advance(task)
        results["logprob_memory"] = {**lp_shape, "chunked": chunked, "naive": naive,
                                     "growth_ratio_chunked_vs_naive": chunked["growth_mb"] / max(naive["growth_mb"], 1e-9)}
        results["throughput"] = {**_sub("throughput", per_role=4, repeats=2, **shape), "target": ">= 0.7"}
        prog.advance(task)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
