"""The static and compiled decode steps on a CUDA GPU (issue #49): the eager engine's tokens there too.

Skipped without a GPU (tests/unit/serving/test_static_decode.py covers the CPU). Imports nothing a bare CUDA PyTorch
machine lacks, so `benchmarks/gpu_check.sh` runs it with the device tests.
"""

from __future__ import annotations

import pytest
import torch

from marft_lg.serving.engine.hf import HFEngine
from marft_lg.serving.registry.lora import LoraSettings
from marft_lg.serving.types import ChatRequest

pytestmark = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _run(model_dir: str, decode: str, dtype: str) -> list:
    eng = HFEngine(model_dir, device="cuda", dtype=dtype, decode=decode, max_batch_size=4, batch_wait_s=0.05,
                   **({"static_max_len": 256} if decode != "eager" else {}))
    try:
        eng.add_adapter("ad1", LoraSettings(r=4, init=False), seed=1)
        eng.add_adapter("ad2", LoraSettings(r=4, init=False), seed=2)
        msgs = [[{"role": "user", "content": f"Question {i}: what is {i} + {i}?"}] for i in range(4)]
        reqs = [ChatRequest(m, max_tokens=16, seed=i, temperature=0 if i % 2 else 1.0, ignore_eos=True)
                for i, m in enumerate(msgs)]
        names = ["ad1", "ad2", None, "ad1"]
        eng.generate(reqs, names)  # warm-up (the compiled step's one bucket)
        out = eng.generate(reqs, names)
        graphs = eng._scheduler._static.graphs if decode != "eager" else None
        if graphs is not None:  # each bucket's step ran as a captured CUDA graph, in the scheduler's thread
            assert graphs.failed is None and graphs.captures >= 1 and graphs.graphs
        return out
    finally:
        eng.close()


@needs_gpu
@pytest.mark.parametrize("decode", ["static", "compiled"])
def test_static_and_compiled_decode_give_the_eager_tokens_on_gpu(tiny_model_dir, decode):
    eager, other = _run(tiny_model_dir, "eager", "float32"), _run(tiny_model_dir, decode, "float32")
    for a, b in zip(eager, other, strict=True):
        assert a.completion_token_ids == b.completion_token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-3)


@needs_gpu
def test_compiled_decode_runs_in_bfloat16(tiny_model_dir):
    # a second compiled engine, in a new scheduler thread (inductor's own CUDA graph trees failed there)
    out = _run(tiny_model_dir, "compiled", "bfloat16")
    assert [len(c.completion_token_ids) for c in out] == [16] * 4
