"""Trainer benchmarks: memory of multi-agent PPO steps, chunked log-prob memory, PPO throughput.

    python benchmarks/training.py [--model embedded:smollm2-135m-instruct] [--quick]

1. Peak RSS of one PPO step (simultaneous scheme) with 4 agents vs 1 agent, like with like: every
   agent has the same data (`per_role` actions of the same tokens) and the same micro-batch size
   (`micro_batch_tokens`), so the 4-agent step does 4x the work of the 1-agent step on one base
   model with 4 LoRA adapters. Memory must not scale with the agents (target <= 1.2x).
2. Peak RSS growth of a log-prob forward+backward: chunked gather vs naive full `[B, T, V]` logits.
3. PPO update tokens/s vs a plain forward+backward (cross-entropy, one padded batch per agent) over
   the same tokens (target >= 0.7x), on uniform random actions and on a mixed-length batch shaped
   like the math team's (reasoner prompt ~100 tokens, actor prompt ~90 + the reasoner's answer,
   completions 3-48 tokens); plus the whole update of one math-team-sized iteration (2 agents x 16
   actions, 2 PPO epochs, no critic) with its post-update checks.
4. Batches whose rows share a prompt prefix, shaped like real ones: the math team's (reasoner and actor, 16
   actions each, their system prompt and worked examples 165 / 193 tokens shared, as in the demo's records) and
   a tool-using worker's (8 actions, 1,200 shared tokens of instructions and tool schemas): one PPO update and
   one no-grad log-prob pass (what the record check and the post-update check run), their micro-batches and
   time; `--baseline REV` runs the same case with REV's trainer (a temporary git worktree) the same hour.
Each case runs in a fresh process so peak RSS is its own. Results: benchmarks/results/training.json.
"""

from __future__ import annotations

import argparse
import dataclasses
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
    """`per_role` random actions per role; every role gets the same tokens (like-for-like data)."""
    import numpy as np
    import torch

    from marft_lg.training.buffer import ActionRecord

    vocab = len(tokenizer)
    out = []
    for i in range(per_role):
        g = torch.Generator().manual_seed(seed * 100_003 + i)
        ids = torch.randint(0, vocab, (prompt_len + completion_len,), generator=g).tolist()
        for k, role in enumerate(roles):
            out.append(ActionRecord(episode_id=f"e{i}", scenario_id=f"s{i // 2}", order=k, agent=role,
                                    adapter_version="v0", prompt_ids=ids[:prompt_len], completion_ids=ids[prompt_len:],
                                    behaviour_logprobs=None, reward=float(np.sin(i)), done=k == len(roles) - 1,
                                    words=completion_len))
    return out


def _mixed_records(tokenizer, per_role, seed=0):
    """A math-team-shaped batch: reasoner (prompt 97-103, answer 8-48, half at the 48 limit) then actor
    (prompt 89-95 + the reasoner's answer, answer 3-48), one episode per pair."""
    import numpy as np

    from marft_lg.training.buffer import ActionRecord

    rng = np.random.default_rng(seed)
    vocab = len(tokenizer)
    out = []
    for e in range(per_role):
        rc = 48 if rng.random() < 0.5 else int(rng.integers(8, 48))
        shapes = (("reasoner", int(rng.integers(97, 104)), rc), ("actor", int(rng.integers(89, 96)) + rc, int(rng.integers(3, 49))))
        for order, (agent, p, c) in enumerate(shapes):
            ids = rng.integers(0, vocab, p + c).tolist()
            out.append(ActionRecord(episode_id=f"e{e}", scenario_id=f"s{e // 4}", order=order, agent=agent,
                                    adapter_version="v0", prompt_ids=ids[:p], completion_ids=ids[p:],
                                    behaviour_logprobs=None, reward=float(rng.random() < 0.3) if order else 0.0,
                                    done=bool(order), words=max(1, c // 2)))
    return out


def _setup(model, n_agents, per_role, prompt_len, completion_len, mixed=False, **cfg_kw):
    import torch

    from marft_lg.training.batch import BaseModel, build_batch
    from marft_lg.training.buffer import RolloutBuffer
    from marft_lg.training.config import MARFTConfig
    from marft_lg.training.policy import LocalPolicy

    torch.set_num_threads(2)
    roles = ["reasoner", "actor"] if mixed else [f"agent{i}" for i in range(n_agents)]
    pol = LocalPolicy(model, roles)
    cfg = MARFTConfig(**{"update_scheme": "simultaneous", "use_critic": False, "group_size": 2, "kl_cut": None,
                         "learning_rate": 1e-5, "logprob_chunk": 256, **cfg_kw})
    recs = (_mixed_records(pol.tokenizer, per_role) if mixed
            else _records(pol.tokenizer, roles, per_role, prompt_len, completion_len))
    pad = pol.tokenizer.pad_token_id
    batch = build_batch(RolloutBuffer(recs), {"": BaseModel(pol.model, pad)}, cfg, agents=roles,
                        adapter_for=lambda r: pol.adapter_name(r.agent), critic=None)
    return pol, roles, cfg, batch


def _of(batch, role: str) -> list:
    """The batch's records of one role."""
    return [r for r in batch.records if r.agent == role]


def case_ppo_step(model, n_agents, per_role, prompt_len, completion_len, micro_batch_tokens):
    """Peak RSS of one PPO step over `per_role` actions of each of `n_agents` agents (same data per agent)."""
    import torch

    from marft_lg.training.batch import micro_batches
    from marft_lg.training.policy import adapter_parameters
    from marft_lg.training.ppo import ppo_update

    pol, roles, cfg, buf = _setup(model, n_agents, per_role, prompt_len, completion_len,
                                  micro_batch_tokens=micro_batch_tokens)
    opts = {r: torch.optim.Adam(adapter_parameters(pol.model, pol.adapter_name(r)), lr=1e-5) for r in roles}
    per_agent_mb = {}
    for r in roles:
        n_params = sum(p.numel() for p in adapter_parameters(pol.model, pol.adapter_name(r)))
        per_agent_mb[r] = n_params * 4 * 4 / 2**20  # weights + gradient + two Adam moments, float32
    before = _peak_rss_mb()
    t = time.perf_counter()
    stats = ppo_update(pol.model, buf, cfg, agents=roles, adapter_names={r: pol.adapter_name(r) for r in roles},
                       optimizers=opts, pad_id=pol.tokenizer.pad_token_id, generator=torch.Generator().manual_seed(0))
    return {"peak_rss_mb": _peak_rss_mb(), "peak_before_update_mb": before, "seconds": time.perf_counter() - t,
            "tokens": stats.tokens, "micro_batches_per_agent": len(micro_batches(_of(buf, roles[0]), micro_batch_tokens)),
            "adapter_state_mb_per_agent": per_agent_mb[roles[0]]}


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


def plain_step(model, batches, names, opts) -> None:
    """What a naive trainer would run: per agent, one padded forward+backward (cross-entropy on the
    completion tokens) and an optimizer step."""
    import torch

    from marft_lg.training.policy import only_adapter_trainable

    for r, t in batches.items():
        with only_adapter_trainable(model, names[r]):
            opts[r].zero_grad()
            logits = model(input_ids=t["input_ids"], attention_mask=t["attention_mask"], use_cache=False).logits
            labels = t["input_ids"][:, 1:].masked_fill(t["completion_mask"][:, 1:] == 0, -100)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                                     labels.reshape(-1))
            loss.backward()
            opts[r].step()
            del logits, loss


def case_throughput(model, per_role, prompt_len, completion_len, repeats, mixed=False, micro_batch_tokens=1024):
    """Tokens/s of the PPO update vs a plain forward+backward (CE on the same completion tokens, one
    padded batch per agent, as a naive trainer would run it)."""
    import torch

    from marft_lg.training.buffer import collate
    from marft_lg.training.policy import adapter_parameters
    from marft_lg.training.ppo import ppo_update

    pol, roles, cfg, buf = _setup(model, 1, per_role, prompt_len, completion_len, mixed=mixed,
                                  micro_batch_tokens=micro_batch_tokens)
    names = {r: pol.adapter_name(r) for r in roles}
    opts = {r: torch.optim.Adam(adapter_parameters(pol.model, names[r]), lr=1e-5) for r in roles}
    batches = {r: collate(_of(buf, r), pol.tokenizer.pad_token_id) for r in roles}
    n_tokens = sum(r.n_tokens for r in buf.records)
    seq_tokens = sum(len(r.prompt_ids) + r.n_tokens for r in buf.records)
    padded_tokens = sum(int(t["input_ids"].numel()) for t in batches.values())
    from marft_lg.training.batch import BaseModel, build_batch
    from marft_lg.training.buffer import RolloutBuffer

    warm = build_batch(RolloutBuffer([_of(buf, r)[0] for r in roles]),  # Adam state and lazy inits outside the timing
                       {"": BaseModel(pol.model, pol.tokenizer.pad_token_id)}, cfg, agents=roles,
                       adapter_for=lambda r: names[r.agent], critic=None)
    ppo_update(pol.model, warm, cfg, agents=roles, adapter_names=names, optimizers=opts,
               pad_id=pol.tokenizer.pad_token_id, generator=torch.Generator().manual_seed(0))
    one_batch = dataclasses.replace(cfg, micro_batch_tokens=None)  # one padded batch per agent: the old path
    ppo_s, one_batch_s, plain_s = [], [], []
    for _ in range(repeats):
        for c, times in ((cfg, ppo_s), (one_batch, one_batch_s)):
            s = time.perf_counter()
            ppo_update(pol.model, buf, c, agents=roles, adapter_names=names, optimizers=opts,
                       pad_id=pol.tokenizer.pad_token_id, generator=torch.Generator().manual_seed(0))
            times.append(time.perf_counter() - s)
        s = time.perf_counter()
        plain_step(pol.model, batches, names, opts)
        plain_s.append(time.perf_counter() - s)
    ppo, plain = min(ppo_s), min(plain_s)
    return {"agents": len(roles), "actions": len(buf.records), "tokens": n_tokens, "sequence_tokens": seq_tokens,
            "padded_tokens_one_batch_per_agent": padded_tokens, "micro_batch_tokens": micro_batch_tokens,
            "ppo_seconds": ppo, "plain_seconds": plain, "ppo_tokens_per_s": n_tokens / ppo,
            "ppo_one_batch_per_agent_tokens_per_s": n_tokens / min(one_batch_s),
            "plain_tokens_per_s": n_tokens / plain, "ratio": plain / ppo,
            "speedup_vs_one_batch_per_agent": min(one_batch_s) / ppo}


SHARED_SHAPES = {
    # role: (shared prefix, own prompt tokens, completion tokens, actions); the math team's from the demo's records
    "math_team": {"reasoner": (165, (10, 26), (20, 33), 16), "actor": (193, (30, 61), (10, 25), 16)},
    "tool_worker": {"worker": (1200, (50, 250), (10, 60), 8)},
}


def _shared_records(tokenizer, shape: str, seed: int = 0) -> list:
    """Random tokens laid out like `SHARED_SHAPES[shape]`: per role one prefix every action starts with."""
    import numpy as np

    from marft_lg.training.buffer import ActionRecord

    rng = np.random.default_rng(seed)
    vocab = len(tokenizer)
    out = []
    for order, (role, (prefix, own, comp, n)) in enumerate(SHARED_SHAPES[shape].items()):
        head = rng.integers(0, vocab, prefix).tolist()
        for e in range(n):
            p, c = int(rng.integers(*own)), int(rng.integers(*comp))
            ids = rng.integers(0, vocab, p + c).tolist()
            out.append(ActionRecord(episode_id=f"e{e}", scenario_id=f"s{e // 4}", order=order, agent=role,
                                    adapter_version="v0", prompt_ids=head + ids[:p], completion_ids=ids[p:],
                                    behaviour_logprobs=None, reward=float(rng.random() < 0.3), done=True,
                                    words=max(1, c // 2)))
    return out


def case_shared_prefix(model, shape, repeats, micro_batch_tokens=1024):
    """One PPO update and one no-grad log-prob pass over a batch whose rows share their role's prompt prefix."""
    import torch

    from marft_lg.training.batch import (
        BaseModel,
        build_batch,
        completion_logprobs,
        index_batches,
        inference_batches,
    )
    from marft_lg.training.buffer import RolloutBuffer
    from marft_lg.training.config import MARFTConfig
    from marft_lg.training.policy import LocalPolicy, adapter_parameters, only_adapter_trainable
    from marft_lg.training.ppo import ppo_update

    torch.set_num_threads(2)
    roles = list(SHARED_SHAPES[shape])
    pol = LocalPolicy(model, roles)
    names = {r: pol.adapter_name(r) for r in roles}
    pad = pol.tokenizer.pad_token_id
    cfg = MARFTConfig(update_scheme="simultaneous", use_critic=False, group_size=4, kl_cut=None, learning_rate=1e-5,
                      micro_batch_tokens=micro_batch_tokens)
    batch = build_batch(RolloutBuffer(_shared_records(pol.tokenizer, shape)), {"": BaseModel(pol.model, pad)}, cfg,
                        agents=roles, adapter_for=lambda r: names[r.agent], critic=None)
    opts = {r: torch.optim.Adam(adapter_parameters(pol.model, names[r]), lr=1e-5) for r in roles}
    by_role = {r: [i for i, x in enumerate(batch.records) if x.agent == r] for r in roles}

    def update() -> None:
        ppo_update(pol.model, batch, cfg, agents=roles, adapter_names=names, optimizers=opts, pad_id=pad,
                   generator=torch.Generator().manual_seed(0))

    def logprob_pass() -> None:
        for r, idx in by_role.items():
            with only_adapter_trainable(pol.model, names[r]):
                completion_logprobs(pol.model, batch.records, idx, cfg, pad)

    update()  # Adam state and lazy inits outside the timing
    times: dict[str, list[float]] = {"update": [], "logprob_pass": []}
    for _ in range(repeats):
        for key, fn in (("update", update), ("logprob_pass", logprob_pass)):
            t = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t)
    tokens = sum(r.n_tokens for r in batch.records)
    return {"shape": shape, "actions": len(batch.records), "tokens": tokens,
            "sequence_tokens": sum(len(r.prompt_ids) + r.n_tokens for r in batch.records),
            "micro_batch_tokens": micro_batch_tokens,
            "micro_batches": {r: len(index_batches(batch.records, idx, micro_batch_tokens)) for r, idx in by_role.items()},
            "logprob_batches": {r: len(inference_batches(batch.records, idx, cfg, 8)) for r, idx in by_role.items()},
            "update_s": min(times["update"]), "logprob_pass_s": min(times["logprob_pass"]),
            "update_tokens_per_s": tokens / min(times["update"]), "repeats": repeats}


def _shared_prefix_cases(quick: bool, baseline: str | None) -> dict:
    """`case_shared_prefix` per shape with this code and, given `baseline`, with that revision's trainer."""
    repeats = 1 if quick else 3
    out: dict = {}
    for shape in SHARED_SHAPES:
        out[shape] = {"now": _sub("shared_prefix", shape=shape, repeats=repeats)}
        if baseline:
            out[shape]["baseline"] = _at_revision(baseline, "shared_prefix", shape=shape, repeats=repeats)
            out[shape]["update_speedup"] = out[shape]["baseline"]["update_s"] / out[shape]["now"]["update_s"]
            out[shape]["logprob_pass_speedup"] = (out[shape]["baseline"]["logprob_pass_s"]
                                                  / out[shape]["now"]["logprob_pass_s"])
    if baseline:
        out["baseline_commit"] = subprocess.run(["git", "rev-parse", baseline], cwd=ROOT, capture_output=True,
                                                text=True, check=True).stdout.strip()
    return out


def _at_revision(rev: str, case: str, **kw) -> dict:
    """`case` run by this script against the marft_lg of git revision `rev` (a temporary detached worktree)."""
    import shutil
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="marft-bench-")) / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tmp), rev], cwd=ROOT, check=True)
    try:
        script = tmp / "benchmarks" / "_training_now.py"
        shutil.copy(__file__, script)
        return run_case(script, case, **kw)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tmp)], cwd=ROOT, check=False)
        shutil.rmtree(tmp.parent, ignore_errors=True)


def _sub(case: str, **kw) -> dict:
    return run_case(__file__, case, **kw)


def run_case(script: str | Path, case: str, **kw) -> dict:
    """Run `script --case CASE --kw JSON` in a fresh process (so its peak RSS is its own) and return the JSON
    it prints last."""
    cmd = [sys.executable, str(script), "--case", case, "--kw", json.dumps(kw)]
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
    ap.add_argument("--only", default="", help="comma-separated result keys to re-measure (ppo_step_rss, throughput_mixed, "
                    "throughput, logprob_memory, shared_prefix); the others are kept from --out")
    ap.add_argument("--baseline", default=None, metavar="REV",
                    help="also run the shared-prefix cases with git revision REV's trainer (a temporary worktree)")
    args = ap.parse_args()
    from marft_lg.serving.engine.models import resolve_model

    model = str(resolve_model(args.model))
    if args.case:
        fn = {"ppo_step": case_ppo_step, "logprob_memory": case_logprob_memory, "throughput": case_throughput,
              "shared_prefix": case_shared_prefix}[args.case]
        print(json.dumps(fn(model, **json.loads(args.kw))))
        return
    q = args.quick
    shape = {"prompt_len": 64 if q else 192, "completion_len": 32 if q else 64}
    from rich.progress import Progress

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    only = {c for c in args.only.split(",") if c}
    kept = json.loads(out.read_text()) if only and out.exists() else {}
    from marft_lg._provenance import code_state

    results: dict = {**kept, **code_state(), "model": args.model, "quick": q, **shape, "complete": False}
    if only:
        results["measured_now"] = sorted(only)

    def wanted(case: str) -> bool:
        return not only or case in only

    def save() -> None:  # after every case, so a long run that is stopped keeps what it measured
        out.write_text(json.dumps(results, indent=2))

    with Progress() as prog:
        task = prog.add_task("training benchmarks", total=7)
        if wanted("ppo_step_rss"):
            step = {"per_role": 4, "micro_batch_tokens": 2 * (shape["prompt_len"] + shape["completion_len"]), **shape}
            one = _sub("ppo_step", n_agents=1, **step)
            prog.advance(task)
            four = _sub("ppo_step", n_agents=4, **step)
            results["ppo_step_rss"] = {
                "per_role": step["per_role"], "micro_batch_tokens": step["micro_batch_tokens"],
                "one_agent": one, "four_agents": four, "ratio_4_vs_1": four["peak_rss_mb"] / one["peak_rss_mb"],
                "growth_ratio_4_vs_1": ((four["peak_rss_mb"] - four["peak_before_update_mb"])
                                        / max(one["peak_rss_mb"] - one["peak_before_update_mb"], 1e-9)),
                "target": "<= 1.2"}
            save()
        prog.advance(task, 2 - prog.tasks[0].completed)
        if wanted("throughput_mixed"):
            results["throughput_mixed"] = {**_sub("throughput", per_role=4 if q else 8, repeats=1 if q else 3, mixed=True,
                                                  prompt_len=0, completion_len=0), "target": ">= 0.7"}
            save()
        prog.advance(task)
        if wanted("throughput"):
            results["throughput"] = {**_sub("throughput", per_role=4, repeats=2, **shape), "target": ">= 0.7"}
            save()
        prog.advance(task)
        if wanted("logprob_memory"):
            lp_shape = {"batch": 2 if q else 4, "prompt_len": 64 if q else 128, "completion_len": 128 if q else 384}
            chunked = _sub("logprob_memory", mode="chunked", **lp_shape)
            prog.advance(task)
            naive = _sub("logprob_memory", mode="naive", **lp_shape)
            results["logprob_memory"] = {**lp_shape, "chunked": chunked, "naive": naive,
                                         "growth_ratio_chunked_vs_naive": chunked["growth_mb"] / max(naive["growth_mb"], 1e-9)}
        prog.advance(task, 6 - prog.tasks[0].completed)
        if wanted("shared_prefix"):
            results["shared_prefix"] = _shared_prefix_cases(q, args.baseline)
        prog.advance(task)
        results["complete"] = True
        save()
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
