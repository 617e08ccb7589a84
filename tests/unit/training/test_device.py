"""Device placement: the rules on any machine; on a CUDA GPU, the same update and tokens as on the CPU."""

from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np
import pytest
import torch

from marft_lg.serving.engine.device import model_device, resolve_device, resolve_dtype
from marft_lg.training.batch import BaseModel, build_batch
from marft_lg.training.buffer import build_buffer
from marft_lg.training.config import MARFTConfig
from marft_lg.training.policy import LocalPolicy, adapter_parameters, token_logprobs
from marft_lg.training.ppo import ppo_update

ROLES = ["reasoner", "actor"]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
gpu = pytest.mark.gpu


def test_auto_device_and_dtype_rules(monkeypatch):
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setenv("MARFT_LG_DEVICE", "cpu")
    assert resolve_device("auto") == torch.device("cpu")
    monkeypatch.delenv("MARFT_LG_DEVICE")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device(None) == resolve_device("auto")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    monkeypatch.setenv("MARFT_LG_DTYPE", "bf16")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32
    monkeypatch.delenv("MARFT_LG_DTYPE")
    assert resolve_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    assert resolve_dtype(torch.float16, torch.device("cpu")) == torch.float16
    with pytest.raises(ValueError, match="not one of auto"):
        resolve_dtype("int8", torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_asking_for_cuda_without_a_gpu_says_what_to_do():
    with pytest.raises(ValueError, match="no CUDA GPU.*device='cpu'"):
        resolve_device("cuda")


def test_cpu_policy_is_float32_on_cpu(tiny_model_dir):
    policy = LocalPolicy(tiny_model_dir, ["a"], device="cpu")
    assert model_device(policy.model) == torch.device("cpu")
    assert all(p.dtype == torch.float32 for p in policy.model.parameters())


def _policy(model_dir, device, dtype="float32", like=None):
    """A two-agent policy; `like`: copy its adapter weights (GPU and CPU RNGs initialise differently)."""
    policy = LocalPolicy(model_dir, ROLES, seed=0, device=device, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for role in ROLES:
            params = adapter_parameters(policy.model, policy.adapter_name(role))
            source = adapter_parameters(like.model, like.adapter_name(role)) if like is not None else None
            for i, p in enumerate(params):
                p.copy_(source[i] if source is not None else torch.randn(p.shape, generator=g) * 0.05)
    return policy


def _buffer(policy, cfg, seed=0):
    from marft_lg.training.rollout import ChainCollector
    from marft_lg.trajectories.scenarios import Scenario

    def prompt(role, scenario, previous):
        msgs = [{"role": "system", "content": f"You are the {role}."}, {"role": "user", "content": scenario.inputs["q"]}]
        if previous:
            msgs.append({"role": "user", "content": "Reasoner: " + previous[0]["completion"]})
        return msgs

    scenarios = [Scenario(f"s{i}", {"q": f"question {i}"}) for i in range(3)]
    ds = ChainCollector(policy, ROLES, prompt, max_new_tokens=6).collect(scenarios, 2, 0, 0)
    rng = np.random.default_rng(seed)
    buf = build_buffer(ds, {e: rng.normal(size=2) for e in ds.episode_ids}, policy.tokenizer, max_context=4096)
    # move the behaviour policy away from the current one so the ratio is not 1
    buf.records = [replace(r, behaviour_logprobs=[v + float(rng.normal(0, 0.3)) for v in r.behaviour_logprobs])
                   for r in buf.records]
    return build_batch(buf, {"": BaseModel(policy.model, policy.tokenizer.pad_token_id)}, cfg, agents=ROLES,
                       adapter_for=lambda r: policy.adapter_name(r.agent), critic=None)


def _update(policy, buf, cfg):
    """One SGD (lr 1) PPO update of both agents; returns the weight change per role and the stats."""
    start = {r: [p.detach().cpu().clone() for p in adapter_parameters(policy.model, policy.adapter_name(r))] for r in ROLES}
    opts = {r: torch.optim.SGD(adapter_parameters(policy.model, policy.adapter_name(r)), lr=1.0) for r in ROLES}
    stats = ppo_update(policy.model, buf, cfg, agents=ROLES, adapter_names={r: policy.adapter_name(r) for r in ROLES},
                       optimizers=opts, pad_id=policy.tokenizer.pad_token_id, generator=torch.Generator().manual_seed(0))
    delta = {r: [p.detach().cpu() - s for p, s in zip(adapter_parameters(policy.model, policy.adapter_name(r)), start[r],
                                                       strict=True)] for r in ROLES}
    return delta, stats


def test_the_gpu_tests_steps_run_on_cpu(tiny_model_dir, tmp_path):
    """What the `gpu` tests below do, on the CPU: their imports and helpers work here (and on a bare CUDA PyTorch
    machine: tests/unit/training/test_device_bare.py runs this file with LangChain, LangGraph, OpenTelemetry and the
    embedded model package hidden), so a borrowed GPU's few minutes are not lost to an ImportError."""
    from marft_lg.serving.engine.hf import HFEngine
    from marft_lg.serving.types import ChatRequest
    from marft_lg.training.checkpoint import load_checkpoint, save_checkpoint

    cfg = MARFTConfig(use_critic=False, group_size=2, kl_cut=None, update_scheme="simultaneous", granularity="token",
                      kl_ref_coef=0.1)
    policy = _policy(tiny_model_dir, "cpu")
    delta, stats = _update(policy, _buffer(policy, cfg), cfg)
    assert all(stats.agents[r].steps == 1 and any(d.abs().sum() > 0 for d in delta[r]) for r in ROLES)
    names = {r: policy.adapter_name(r) for r in ROLES}
    path = save_checkpoint(tmp_path, 1, adapters={r: adapter_parameters(policy.model, n) for r, n in names.items()},
                           adapter_names=names, state={"iteration": 1})
    assert load_checkpoint(path, adapters={r: adapter_parameters(policy.model, n) for r, n in names.items()})["iteration"] == 1
    engine = HFEngine(tiny_model_dir, device="cpu", dtype="float32")
    try:
        out = engine.generate([ChatRequest(messages=[{"role": "user", "content": "Count."}], max_tokens=4, seed=7)], [None])
        assert 1 <= len(out[0].completion_token_ids) <= 4
    finally:
        engine.close()


@gpu
@cuda
@pytest.mark.parametrize("granularity", ["action", "token"])
def test_ppo_update_on_gpu_equals_cpu(tiny_model_dir, granularity):
    cfg = MARFTConfig(use_critic=False, group_size=2, kl_cut=None, max_grad_norm=1e9, entropy_coef=0.05,
                      update_scheme="simultaneous", granularity=granularity, kl_ref_coef=0.1)
    cpu = _policy(tiny_model_dir, "cpu")
    gpu = _policy(tiny_model_dir, "cuda", like=cpu)
    assert model_device(gpu.model).type == "cuda"
    buf_cpu = _buffer(cpu, cfg)
    buf_gpu = copy.deepcopy(buf_cpu)  # the same records for both
    d_cpu, s_cpu = _update(cpu, buf_cpu, cfg)
    d_gpu, s_gpu = _update(gpu, buf_gpu, cfg)
    for role in ROLES:
        assert any(d.abs().sum() > 0 for d in d_cpu[role])
        for a, b in zip(d_cpu[role], d_gpu[role], strict=True):
            torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-5)
        for key in ("policy_loss", "approx_kl", "entropy", "clip_fraction", "tokens"):
            assert getattr(s_gpu.agents[role], key) == pytest.approx(getattr(s_cpu.agents[role], key), rel=1e-3, abs=1e-6)


@gpu
@cuda
def test_engine_on_gpu_decodes_the_same_tokens_as_on_cpu(tiny_model_dir):
    from marft_lg.serving.engine.hf import HFEngine
    from marft_lg.serving.types import ChatRequest

    requests = [ChatRequest(messages=[{"role": "user", "content": f"Count to {i}."}], max_tokens=12, temperature=t, seed=7)
                for i in range(3) for t in (0.0, 1.0)]
    outs = {}
    for device in ("cpu", "cuda"):
        engine = HFEngine(tiny_model_dir, device=device, dtype="float32")
        try:
            assert model_device(engine.model).type == device
            outs[device] = engine.generate(requests, [None] * len(requests))
        finally:
            engine.close()
    for a, b in zip(outs["cpu"], outs["cuda"], strict=True):
        assert b.completion_token_ids == a.completion_token_ids  # greedy and seeded sampling alike (CPU draws)
        np.testing.assert_allclose(b.logprobs, a.logprobs, rtol=1e-3, atol=1e-4)


@gpu
@cuda
def test_bf16_base_on_gpu_trains_float32_adapters(tiny_model_dir, monkeypatch):
    monkeypatch.delenv("MARFT_LG_DTYPE", raising=False)  # "auto" itself is under test
    cfg = MARFTConfig(use_critic=False, group_size=2, kl_cut=None, update_scheme="simultaneous")
    policy = _policy(tiny_model_dir, "cuda", dtype="auto")
    assert policy.model.get_base_model().model.embed_tokens.weight.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for r in ROLES for p in adapter_parameters(policy.model, policy.adapter_name(r)))
    buf = _buffer(policy, cfg)
    delta, stats = _update(policy, buf, cfg)
    for role in ROLES:
        assert stats.agents[role].steps == 1
        assert any(d.abs().sum() > 0 for d in delta[role])
        assert all(torch.isfinite(d).all() for d in delta[role])
    t = {"input_ids": torch.tensor([[1, 2, 3, 4]], device="cuda"), "attention_mask": torch.ones(1, 4, dtype=torch.long, device="cuda"),
         "completion_mask": torch.tensor([[0, 0, 1, 1]], device="cuda")}
    lp, _ = token_logprobs(policy.model, t["input_ids"], t["attention_mask"], t["completion_mask"])
    assert lp.dtype == torch.float32 and bool(torch.isfinite(lp).all())


@gpu
@cuda
def test_checkpoint_written_on_gpu_loads_on_cpu(tiny_model_dir, tmp_path):
    from marft_lg.training.checkpoint import load_checkpoint, save_checkpoint

    gpu = _policy(tiny_model_dir, "cuda")
    names = {r: gpu.adapter_name(r) for r in ROLES}
    path = save_checkpoint(tmp_path, 3, adapters={r: adapter_parameters(gpu.model, n) for r, n in names.items()},
                           adapter_names=names, state={"iteration": 3})
    cpu = LocalPolicy(tiny_model_dir, ROLES, seed=5, device="cpu")
    live = {r: adapter_parameters(cpu.model, cpu.adapter_name(r)) for r in ROLES}
    assert load_checkpoint(path, adapters=live)["iteration"] == 3
    for r in ROLES:
        for a, b in zip(adapter_parameters(gpu.model, names[r]), adapter_parameters(cpu.model, cpu.adapter_name(r)), strict=True):
            torch.testing.assert_close(b, a.cpu())
