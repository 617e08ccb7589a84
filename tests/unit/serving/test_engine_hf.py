"""HFEngine on a tiny random Llama: batching, seeds, stops, log-probs, context errors, exclusive()."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from marft_lg.serving.engine.hf import HFEngine
from marft_lg.serving.engine.mixed_forward import mixed_adapter_forward
from marft_lg.serving.errors import ContextLengthError, UnknownAgentError
from marft_lg.serving.registry.lora import LoraSettings
from marft_lg.serving.types import ChatRequest

MSG = [{"role": "user", "content": "Plan a short trip."}]
LONGER = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Write two lines about the sea."}]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    torch.set_num_threads(1)
    eng = HFEngine(tiny_model_dir, batch_wait_s=0.02)
    eng.add_adapter("ad1", LoraSettings(r=4, init=False), seed=1)  # random B: adapters differ from the base
    eng.add_adapter("ad2", LoraSettings(r=4, init=False), seed=2)
    yield eng
    eng.close()


def _recompute(engine, prompt_ids, completion_ids, adapter):
    ids = torch.tensor([prompt_ids + completion_ids], device=engine.device)
    with torch.inference_mode():
        logits = mixed_adapter_forward(engine.model, [adapter or "__base__"], input_ids=ids).logits[0].float().cpu()
    logp = torch.log_softmax(logits[len(prompt_ids) - 1:-1], dim=-1)
    return logp.gather(1, torch.tensor(completion_ids)[:, None])[:, 0], logp


def test_returned_logprobs_match_a_recomputation(engine):
    reqs = [ChatRequest(MSG, max_tokens=12, seed=3, ignore_eos=True),
            ChatRequest(LONGER, max_tokens=7, seed=4, temperature=0.7, top_p=0.9, ignore_eos=True),
            ChatRequest(MSG, max_tokens=5, seed=5, ignore_eos=True)]
    outs = engine.generate(reqs, ["ad1", "ad2", None])
    for c, req, adapter in zip(outs, reqs, ["ad1", "ad2", None], strict=True):
        assert c.prompt_token_ids == engine.encode(req)
        expected, _ = _recompute(engine, c.prompt_token_ids, c.completion_token_ids, adapter)
        assert torch.allclose(torch.tensor(c.logprobs), expected, atol=1e-4)
    assert [len(c.completion_token_ids) for c in outs] == [12, 7, 5]
    assert all(c.finish_reason == "length" for c in outs)


def test_adapters_change_the_distribution(engine):
    req = ChatRequest(MSG, max_tokens=4, temperature=0, ignore_eos=True)
    a, b, base = engine.generate([req, req, req], ["ad1", "ad2", None])
    assert a.prompt_token_ids == b.prompt_token_ids == base.prompt_token_ids
    assert len({tuple(a.logprobs), tuple(b.logprobs), tuple(base.logprobs)}) == 3


def test_seeded_sampling_is_reproducible_whatever_the_batch(engine):
    req = ChatRequest(MSG, agent=None, max_tokens=10, seed=1234, ignore_eos=True)
    alone = engine.generate([req], ["ad1"])[0]
    batch = engine.generate(
        [ChatRequest(LONGER, max_tokens=3, seed=1), req, ChatRequest(MSG, max_tokens=12, seed=9)], ["ad2", "ad1", None]
    )
    assert batch[1].completion_token_ids == alone.completion_token_ids
    assert batch[1].logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    other = engine.generate([ChatRequest(MSG, max_tokens=10, seed=4321, ignore_eos=True)], ["ad1"])[0]
    assert other.completion_token_ids != alone.completion_token_ids


def test_greedy_and_tiny_top_p_pick_the_most_likely_token(engine):
    greedy = engine.generate([ChatRequest(MSG, max_tokens=6, temperature=0, ignore_eos=True)], ["ad1"])[0]
    _, logp = _recompute(engine, greedy.prompt_token_ids, greedy.completion_token_ids, "ad1")
    assert greedy.completion_token_ids == logp.argmax(-1).tolist()
    nucleus = engine.generate([ChatRequest(MSG, max_tokens=6, top_p=1e-6, seed=7, ignore_eos=True)], ["ad1"])[0]
    assert nucleus.completion_token_ids == greedy.completion_token_ids


def test_stop_strings_cut_the_text_and_end_generation(engine):
    full = engine.generate([ChatRequest(MSG, max_tokens=16, seed=11, ignore_eos=True)], ["ad1"])[0]
    k = next(i for i in range(3, 16) if engine.tokenizer.decode([full.completion_token_ids[i]]).strip())
    stop = engine.tokenizer.decode([full.completion_token_ids[k]]).strip()
    cut = engine.generate([ChatRequest(MSG, max_tokens=16, seed=11, ignore_eos=True, stop=[stop])], ["ad1"])[0]
    assert cut.finish_reason == "stop"
    assert stop not in cut.text
    assert cut.text == full.text[: full.text.find(stop)]
    n = len(cut.completion_token_ids)
    assert n <= k + 1 and cut.completion_token_ids == full.completion_token_ids[:n]
    as_str = engine.generate([ChatRequest(MSG, max_tokens=16, seed=11, ignore_eos=True, stop=stop)], ["ad1"])[0]
    assert as_str.completion_token_ids == cut.completion_token_ids


def test_eos_ends_with_stop_and_keeps_the_eos_token(engine, monkeypatch):
    greedy = engine.generate([ChatRequest(MSG, max_tokens=3, temperature=0, ignore_eos=True)], ["ad2"])[0]
    monkeypatch.setattr(engine, "eos_token_ids", {greedy.completion_token_ids[1]})
    out = engine.generate([ChatRequest(MSG, max_tokens=3, temperature=0)], ["ad2"])[0]
    assert out.finish_reason == "stop"
    assert out.completion_token_ids == greedy.completion_token_ids[:2]
    assert len(out.logprobs) == 2


def test_concurrent_callers_are_batched(engine):
    before = dict(engine.stats)
    results: list = [None] * 8
    barrier = threading.Barrier(8)

    def call(i):
        barrier.wait()
        results[i] = engine.generate([ChatRequest(MSG, max_tokens=4, seed=i)], ["ad1" if i % 2 else "ad2"])[0]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(r is not None and len(r.completion_token_ids) >= 1 for r in results)
    assert engine.stats["requests"] - before["requests"] == 8
    assert engine.stats["batches"] - before["batches"] < 8
    assert engine.stats["largest_batch"] > 1


def test_agenerate_batches_concurrent_coroutines(engine):
    async def main():
        return await asyncio.gather(*(engine.agenerate([ChatRequest(MSG, max_tokens=3, seed=i)], ["ad1"]) for i in range(4)))

    before = engine.stats["batches"]
    outs = asyncio.run(main())
    assert [len(o) for o in outs] == [1, 1, 1, 1]
    assert engine.stats["batches"] - before < 4


def test_a_caller_that_gives_up_while_its_request_is_queued_stops_it(engine, monkeypatch):
    """Cancelled while its prompt is still being tokenized (the worker thread of `agenerate`), the request still
    reaches the queue; it must be dropped there, not decoded to its end for nobody."""
    queued = threading.Event()
    enqueue = engine._enqueue

    def slow_enqueue(*args):
        time.sleep(0.3)
        items = enqueue(*args)
        queued.set()
        return items

    monkeypatch.setattr(engine, "_enqueue", slow_enqueue)
    before = engine.stats["cancelled"]

    async def main():
        long = ChatRequest(MSG, max_tokens=engine.max_context() - 64, ignore_eos=True)
        task = asyncio.ensure_future(engine.agenerate([long], ["ad1"]))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert queued.wait(5)
    deadline = time.time() + 30
    while engine.stats["cancelled"] == before and time.time() < deadline:
        time.sleep(0.01)
    assert engine.stats["cancelled"] == before + 1


def test_prompt_longer_than_context_is_refused_not_truncated(engine):
    long = [{"role": "user", "content": "word " * 2100}]
    with pytest.raises(ContextLengthError, match="maximum context length is 2048"):
        engine.generate([ChatRequest(long, max_tokens=1)], ["ad1"])
    n = len(engine.encode(ChatRequest(MSG)))
    with pytest.raises(ContextLengthError):
        engine.generate([ChatRequest(MSG, max_tokens=2048 - n + 1)], ["ad1"])


def test_bad_requests_are_refused_before_queueing(engine):
    with pytest.raises(UnknownAgentError, match="known: ad1, ad2"):
        engine.generate([ChatRequest(MSG)], ["nope"])
    for bad in (ChatRequest(MSG, max_tokens=0), ChatRequest(MSG, top_p=0.0), ChatRequest(MSG, stop=[""]),
                ChatRequest([{"content": "no role"}]), ChatRequest([])):
        with pytest.raises(ValueError):
            engine.generate([bad], ["ad1"])


def test_exclusive_pauses_serving_and_refuses_reentry(engine):
    with engine.exclusive() as model:
        assert model is engine.model
        with pytest.raises(RuntimeError, match="inside exclusive"):
            engine.generate([ChatRequest(MSG, max_tokens=2)], ["ad1"])
        fut = None

        def submit():
            nonlocal fut
            fut = engine.submit([ChatRequest(MSG, max_tokens=2, seed=1)], ["ad1"])[0]

        t = threading.Thread(target=submit)
        t.start()
        t.join(10)
        time.sleep(0.3)
        assert fut is not None and not fut.done()
    assert len(fut.result(timeout=60).completion_token_ids) >= 1


def test_adapters_load_and_unload_between_steps(engine, tmp_path):
    from marft_lg.serving.registry.lora import save_adapter

    save_adapter(engine.model, "ad1", tmp_path / "a-copy")
    engine.load_adapter("ad3", tmp_path / "a-copy")
    engine.load_adapter("ad3", tmp_path / "a-copy")  # idempotent
    req = ChatRequest(MSG, max_tokens=5, seed=2, ignore_eos=True)
    x, y = engine.generate([req, req], ["ad1", "ad3"])
    assert x.completion_token_ids == y.completion_token_ids
    engine.unload_adapter("ad3")
    assert "ad3" not in engine.loaded_adapters()
    with pytest.raises(UnknownAgentError):
        engine.generate([req], ["ad3"])


SYSTEM = {"role": "system", "content": "You are the Actor. Work step by step and answer inside \\boxed{}. " * 3}
SHARED = [[SYSTEM, {"role": "user", "content": q}] for q in ("What is 2 + 3?", "Add seven and one, please.", "9 - 4?")]


@pytest.mark.parametrize("adapter", ["ad1", None])
def test_shared_prefix_is_prefilled_once_with_the_same_results(engine, adapter):
    reqs = [ChatRequest(m, max_tokens=6, seed=i, temperature=0.8, ignore_eos=True) for i, m in enumerate(SHARED)]
    before = engine.stats["shared_prefix_tokens"]
    shared = engine.generate(reqs, [adapter] * 3)
    prefix = min(len(c.prompt_token_ids) for c in shared)
    assert engine.stats["shared_prefix_tokens"] - before >= 2 * 16  # prefix prefilled once, not three times
    saved, engine.min_shared_prefix = engine.min_shared_prefix, 10**9
    try:
        plain = engine.generate(reqs, [adapter] * 3)
    finally:
        engine.min_shared_prefix = saved
    for a, b in zip(shared, plain, strict=True):
        assert a.completion_token_ids == b.completion_token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        expected, _ = _recompute(engine, a.prompt_token_ids, a.completion_token_ids, adapter)
        assert torch.allclose(torch.tensor(a.logprobs), expected, atol=1e-4)
    assert prefix > 16


def test_one_adapter_batches_leave_other_adapters_intact(engine):
    req = ChatRequest(MSG, max_tokens=5, temperature=0, ignore_eos=True)
    mixed = engine.generate([req, req], ["ad1", "ad2"])
    alone1, alone2 = engine.generate([req], ["ad1"])[0], engine.generate([req], ["ad2"])[0]
    assert alone1.completion_token_ids == mixed[0].completion_token_ids
    assert alone2.completion_token_ids == mixed[1].completion_token_ids
    assert alone1.logprobs == pytest.approx(mixed[0].logprobs, abs=1e-4)
    assert alone2.logprobs == pytest.approx(mixed[1].logprobs, abs=1e-4)


def test_mixed_batch_decodes_together_with_a_prefix_per_adapter(engine):
    # two teams answering the same few-shot prompts (a shadow comparison): each adapter's rows prefill
    # their shared prefix once, then all rows decode in one batch (one base pass + per-row LoRA deltas)
    reqs = [ChatRequest(m, max_tokens=4, seed=i, temperature=0.8, ignore_eos=True) for i, m in enumerate(SHARED)]
    names = ["ad1"] * 3 + ["ad2"] * 3 + [None]
    reqs = reqs + reqs + reqs[:1]
    before = dict(engine.stats)
    together = engine.generate(reqs, names)
    assert engine.stats["batches"] == before["batches"] + 1
    assert engine.stats["largest_batch"] >= 7
    assert engine.stats["shared_prefix_tokens"] - before["shared_prefix_tokens"] >= 2 * 2 * 16
    saved, engine.min_shared_prefix = engine.min_shared_prefix, 10**9
    try:
        alone = [engine.generate([r], [n])[0] for r, n in zip(reqs, names, strict=True)]
    finally:
        engine.min_shared_prefix = saved
    for a, b, adapter in zip(together, alone, names, strict=True):
        assert a.completion_token_ids == b.completion_token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        expected, _ = _recompute(engine, a.prompt_token_ids, a.completion_token_ids, adapter)
        assert torch.allclose(torch.tensor(a.logprobs), expected, atol=1e-4)


def test_row_adapters_equal_peft_per_row_forward(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from marft_lg.serving.engine.mixed_forward import BASE, RowAdapters

    eng = HFEngine(tiny_model_dir)
    try:
        eng.add_adapter("r2", LoraSettings(r=2, init=False), seed=3)
        eng.add_adapter("r6", LoraSettings(r=6, alpha=3, init=False, target_modules=["q_proj", "v_proj"]), seed=4)
        eng.add_adapter("r4", LoraSettings(r=4, init=False), seed=5)
        model = eng.model.eval()
        names = ["r6", BASE, "r2", "r6", "r4"]
        ids = torch.randint(0, 100, (len(names), 9))
        plan = RowAdapters(model, ["r2", "r4", "r6"])
        assert RowAdapters.supported(model, names)
        with torch.inference_mode():
            ours = plan.forward(plan.masks(names), input_ids=ids).logits
            peft = mixed_adapter_forward(model, names, input_ids=ids).logits
            model.set_adapter("r4")
            active = model(input_ids=ids).logits  # peft's flags are restored afterwards
        assert torch.allclose(ours, peft, atol=1e-5)
        assert torch.allclose(active[4], peft[4], atol=1e-5)
        assert not torch.allclose(ours[0], ours[1], atol=1e-3)  # the adapters really differ from the base
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
        with torch.inference_mode():
            assert torch.allclose(ours[1], base(input_ids=ids[1:2]).logits[0], atol=1e-5)
    finally:
        eng.close()


def test_a_request_joins_a_running_batch_and_is_answered_first(engine):
    long = ChatRequest(MSG, max_tokens=60, seed=5, ignore_eos=True)
    short = ChatRequest(LONGER, max_tokens=2, seed=6, ignore_eos=True)
    expected_short = engine.generate([short], ["ad2"])[0]
    expected_long = engine.generate([long], ["ad1"])[0]
    joined = engine.stats["joined_running"]
    slow = engine.submit([long], ["ad1"])[0]
    while not slow.running():
        time.sleep(0.001)
    quick = engine.submit([short], ["ad2"])[0]
    got_short = quick.result(timeout=60)
    assert not slow.done()  # answered while the long request was still decoding
    got_long = slow.result(timeout=60)
    assert engine.stats["joined_running"] == joined + 1
    assert got_short.completion_token_ids == expected_short.completion_token_ids
    # the long row decoded on the same distribution once joined: its log-probs are the model's for its own tokens
    # (a seeded draw that lands within ~1e-6 of a CDF boundary may pick another token than the solo run did: the
    # padded two-row pass differs from the one-row pass in the last float bits)
    recomputed, _ = _recompute(engine, got_long.prompt_token_ids, got_long.completion_token_ids, "ad1")
    assert torch.allclose(torch.tensor(got_long.logprobs), recomputed, atol=1e-4)
    parted = next((i for i, (a, b) in enumerate(zip(got_long.completion_token_ids, expected_long.completion_token_ids,
                                                     strict=True)) if a != b), None)
    if parted is not None:  # up to where the two runs part, they agree
        assert got_long.logprobs[:parted] == pytest.approx(expected_long.logprobs[:parted], abs=1e-4)


def test_prefix_store_is_reused_and_never_stale(engine):
    reqs = [ChatRequest(m, max_tokens=3, temperature=0, ignore_eos=True) for m in SHARED]
    engine.generate(reqs[:1], ["ad2"])
    hits = engine.stats["prefix_cache_hits"]
    first = engine.generate(reqs[1:2], ["ad2"])[0]
    assert engine.stats["prefix_cache_hits"] == hits + 1
    expected, _ = _recompute(engine, first.prompt_token_ids, first.completion_token_ids, "ad2")
    assert torch.allclose(torch.tensor(first.logprobs), expected, atol=1e-4)
    # weights changed in place (an optimizer step outside exclusive()): the stored prefix must not be used
    param = next(p for n, p in engine.model.named_parameters() if ".ad2." in n and "lora_B" in n and "k_proj" in n)
    saved = param.detach().clone()
    with torch.no_grad():
        param.add_(0.5)
    try:
        hits = engine.stats["prefix_cache_hits"]
        changed = engine.generate(reqs[1:2], ["ad2"])[0]
        assert engine.stats["prefix_cache_hits"] == hits
        expected, _ = _recompute(engine, changed.prompt_token_ids, changed.completion_token_ids, "ad2")
        assert torch.allclose(torch.tensor(changed.logprobs), expected, atol=1e-4)
        assert changed.logprobs != pytest.approx(first.logprobs, abs=1e-4)
    finally:
        with torch.no_grad():
            param.copy_(saved)


def test_exclusive_gets_in_under_constant_load(engine):
    stop = threading.Event()

    def load():
        while not stop.is_set():
            engine.generate([ChatRequest(MSG, max_tokens=8, seed=1, ignore_eos=True)] * 2, ["ad1", "ad2"])

    threads = [threading.Thread(target=load) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.3)
        got = threading.Event()

        def enter():
            with engine.exclusive():
                got.set()

        t = threading.Thread(target=enter)
        t.start()
        t.join(30)
        assert got.is_set()
    finally:
        stop.set()
        for t in threads:
            t.join(60)


@pytest.mark.parametrize(("sequences", "expected"), [
    ([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 9]], 2),
    ([[1, 2, 3], [1, 2, 3]], 2),  # identical: the last token stays out so each row has its own logits
    ([[7, 1], [8, 1]], 0),
    ([[5]], 0),
    ([], 0),
])
def test_common_prefix_length(sequences, expected):
    from marft_lg.serving.engine.prefix import common_prefix_length

    assert common_prefix_length(sequences) == expected
