"""HFEngine(decode="static" | "compiled"): per-slot preallocated keys and values, one step function per bucket,
the same tokens as the eager engine for seeded (greedy and sampled) requests, mixed adapters, joins while decoding,
cancelled rows, shared prefixes and constrained rows."""

from __future__ import annotations

import threading
import time

import jsonschema
import pytest
import torch

from marft_lg.constraints import constraint_for
from marft_lg.serving.engine.hf import HFEngine
from marft_lg.serving.engine.static_decode import batch_buckets, bucket, width_buckets
from marft_lg.serving.registry.lora import LoraSettings
from marft_lg.serving.types import ChatRequest
from marft_lg.tool_calls import parse_completion, render_messages

MSG = [{"role": "user", "content": "Plan a short trip."}]
LONGER = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Write two lines about the sea."}]
SYSTEM = {"role": "system", "content": "You are a careful planner. Answer in one short paragraph, no lists, no code."}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
VERDICT = {"type": "object", "properties": {"accept": {"type": "boolean"}, "score": {"type": "integer"}},
           "required": ["accept", "score"]}


def _engine(model_dir: str, decode: str, **kw) -> HFEngine:
    eng = HFEngine(model_dir, batch_wait_s=0.02, decode=decode, max_batch_size=kw.pop("max_batch_size", 8), **kw)
    eng.add_adapter("ad1", LoraSettings(r=4, init=False), seed=1)  # random B: adapters differ from the base
    eng.add_adapter("ad2", LoraSettings(r=4, init=False), seed=2)
    return eng


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    torch.set_num_threads(1)
    eager, static = _engine(tiny_model_dir, "eager"), _engine(tiny_model_dir, "static")
    yield eager, static
    eager.close()
    static.close()


def _same(a, b, atol=1e-4):
    for x, y in zip(a, b, strict=True):
        assert x.completion_token_ids == y.completion_token_ids
        assert x.finish_reason == y.finish_reason and x.text == y.text
        assert x.logprobs == pytest.approx(y.logprobs, abs=atol)


def _mixed_batch():
    return ([ChatRequest(MSG, max_tokens=12, seed=3, ignore_eos=True),
             ChatRequest(LONGER, max_tokens=20, seed=4, temperature=0.7, top_p=0.9, ignore_eos=True),
             ChatRequest(MSG, max_tokens=5, temperature=0, ignore_eos=True),
             ChatRequest(LONGER, max_tokens=9, temperature=0, ignore_eos=True),
             ChatRequest(MSG, max_tokens=7, seed=11, top_logprobs=3, ignore_eos=True)],
            ["ad1", "ad2", None, "ad1", "ad2"])


def test_buckets():
    assert batch_buckets(8) == [1, 2, 4, 8] and batch_buckets(12) == [1, 2, 4, 8, 12] and batch_buckets(1) == [1]
    assert width_buckets(2048) == [64, 128, 256, 512, 1024, 2048] and width_buckets(100) == [64, 100]
    assert width_buckets(40) == [40]
    assert bucket(3, [1, 2, 4, 8]) == 4 and bucket(8, [1, 2, 4, 8]) == 8 and bucket(1, [1, 2]) == 1


def test_the_default_stays_eager_and_a_bad_mode_is_refused(engines, tiny_model_dir):
    eager, static = engines
    assert eager.decode == "eager" and eager._scheduler._static is None
    assert static._scheduler._static is not None
    with pytest.raises(ValueError, match="decode must be one of"):
        HFEngine(tiny_model_dir, decode="fast")


def test_static_gives_the_eager_tokens_on_mixed_adapters_greedy_and_sampled(engines):
    eager, static = engines
    reqs, names = _mixed_batch()
    a, b = eager.generate(reqs, names), static.generate(reqs, names)
    _same(a, b)
    assert [len(c.completion_token_ids) for c in b] == [12, 20, 5, 9, 7]
    assert b[4].extra["top_logprobs"][0].keys() == a[4].extra["top_logprobs"][0].keys()
    dec = static._scheduler._static
    assert dec.steps > 0 and all(w == 64 and bt in (1, 2, 4, 8) for bt, w in dec.traced)
    assert dec.slots.keys[0].shape[0] == 8 and dec.slots.keys[0].shape[2] == static.max_context()


def test_one_adapter_alone_and_the_base_alone(engines):
    eager, static = engines
    for name in ("ad2", None):
        reqs = [ChatRequest(MSG, max_tokens=10, seed=s, ignore_eos=True) for s in range(3)]
        _same(eager.generate(reqs, [name] * 3), static.generate(reqs, [name] * 3))


def test_more_requests_than_slots_reuse_freed_slots(engines):
    eager, static = engines
    reqs = [ChatRequest(LONGER if i % 2 else MSG, max_tokens=3 + i % 5, seed=i, ignore_eos=True) for i in range(19)]
    names = [("ad1", "ad2", None)[i % 3] for i in range(19)]
    _same(eager.generate(reqs, names), static.generate(reqs, names))


def test_a_shared_prefix_is_copied_into_the_slots(engines):
    eager, static = engines
    msgs = [[SYSTEM, {"role": "user", "content": f"Trip number {i} to the coast."}] for i in range(3)]
    reqs = [ChatRequest(m, max_tokens=8, seed=i, ignore_eos=True) for i, m in enumerate(msgs)]
    before = static.stats["shared_prefix_tokens"]
    b = static.generate(reqs, ["ad1"] * 3)
    assert static.stats["shared_prefix_tokens"] > before  # the prompts' common prefix was prefilled once
    _same(eager.generate(reqs, ["ad1"] * 3), b)


def test_rows_joining_a_running_batch_get_the_eager_tokens(engines):
    eager, static = engines
    first = [ChatRequest(LONGER, max_tokens=40, seed=21, ignore_eos=True)]
    later = [ChatRequest(MSG, max_tokens=6, seed=22, ignore_eos=True),
             ChatRequest(LONGER, max_tokens=4, temperature=0, ignore_eos=True)]
    alone = eager.generate(first + later, ["ad1", "ad2", None])
    joined_before, steps = static.stats["joined_running"], static._scheduler._static.steps
    futs = static.submit(first, ["ad1"])
    deadline = time.time() + 30
    while static._scheduler._static.steps < steps + 2 and time.time() < deadline:
        time.sleep(0.0005)
    futs += static.submit(later, ["ad2", None])
    outs = [f.result() for f in futs]
    _same(alone, outs)
    assert static.stats["joined_running"] == joined_before + 2  # they joined while the first row decoded


def test_a_cancelled_row_frees_its_slot_and_the_others_go_on(engines):
    eager, static = engines
    import asyncio

    reqs = [ChatRequest(MSG, max_tokens=400, seed=31, ignore_eos=True), ChatRequest(LONGER, max_tokens=6, seed=32,
                                                                                  ignore_eos=True)]

    async def main():
        decoding = asyncio.Event()
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(static.agenerate(reqs[:1], ["ad1"], listeners=[
            lambda ids, lps: loop.call_soon_threadsafe(decoding.set)]))
        other = asyncio.ensure_future(static.agenerate(reqs[1:], ["ad2"]))
        await asyncio.wait_for(decoding.wait(), timeout=120)  # cancelled while its row decodes, not while queued
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await other

    cancelled = static.stats["cancelled"]
    out = asyncio.run(main())
    deadline = time.monotonic() + 60  # the scheduler drops the row at its next step, which may follow `other`'s end
    while static.stats["cancelled"] == cancelled and time.monotonic() < deadline:
        time.sleep(0.01)
    assert static.stats["cancelled"] == cancelled + 1
    _same(eager.generate(reqs[1:], ["ad2"]), out)
    again = [reqs[0].__class__(**{**reqs[0].to_dict(), "max_tokens": 12}), reqs[1]]
    _same(eager.generate(again, ["ad1", "ad2"]), static.generate(again, ["ad1", "ad2"]))  # slots usable again


def test_constrained_rows_are_masked_in_the_static_step(engines):
    eager, static = engines
    schema = constraint_for(response_format={"type": "json_schema", "json_schema": {"name": "V", "schema": VERDICT}})
    forced = constraint_for([ADD], {"type": "function", "function": {"name": "add"}})
    user = [{"role": "user", "content": "Add 2 and 3."}]
    reqs = [ChatRequest(render_messages(user, None, None), max_tokens=64, seed=41, constraint=schema),
            ChatRequest(render_messages(user, [ADD], "add"), max_tokens=96, seed=42, constraint=forced),
            ChatRequest(MSG, max_tokens=10, seed=43, ignore_eos=True)]
    names = ["ad1", "ad2", "ad1"]
    a, b = eager.generate(reqs, names), static.generate(reqs, names)
    _same(a, b)
    import json

    jsonschema.validate(json.loads(b[0].text), VERDICT)
    call = parse_completion(b[1].text, ["add"])
    assert [c["name"] for c in call.tool_calls] == ["add"] and not call.invalid_tool_calls
    assert b[0].extra.get("logprobs_masked") is True and "logprobs_masked" not in b[2].extra


def test_exclusive_takes_the_hooks_off_and_new_weights_are_decoded(engines):
    eager, static = engines
    req = [ChatRequest(MSG, max_tokens=6, temperature=0, ignore_eos=True)]
    static.generate(req, ["ad1"])
    assert static._scheduler._static._adapters is not None

    def scale(factor):
        for eng in (eager, static):
            with eng.exclusive() as model:
                assert eng is eager or eng._scheduler._static._adapters is None  # no serving hooks while training
                with torch.no_grad():
                    for n, p in model.named_parameters():
                        if ".ad1." in n and "lora_B" in n:
                            p.mul_(4.0 * factor)

    scale(1.0)
    try:
        _same(eager.generate(req * 2, ["ad1", "ad2"]), static.generate(req * 2, ["ad1", "ad2"]))
    finally:
        scale(1 / 16)  # exactly the weights before (powers of two), for the other tests


def test_weights_updated_in_place_outside_exclusive_are_decoded_at_the_next_batch(engines):
    eager, static = engines
    req = [ChatRequest(MSG, max_tokens=6, temperature=0, ignore_eos=True)] * 2
    static.generate(req, ["ad2", "ad1"])

    def scale(factor):
        for eng in (eager, static):
            with torch.no_grad():  # an optimizer step on the live model, between two batches
                for n, p in eng.model.named_parameters():
                    if ".ad2." in n and "lora_B" in n:
                        p.mul_(factor)

    scale(-2.0)
    try:
        changed = static.generate(req, ["ad2", "ad1"])
        _same(eager.generate(req, ["ad2", "ad1"]), changed)
    finally:
        scale(-0.5)  # exactly the weights before (powers of two), for the other tests
    assert static.generate(req, ["ad2", "ad1"])[0].logprobs != changed[0].logprobs


@pytest.mark.parametrize("mode", ["eager", "static"])
def test_weights_updated_in_place_while_a_session_runs_are_decoded_by_the_rows_admitted_after(engines, mode):
    """The race CI hit: a caller's optimizer step lands after its answer came back but before the session ended,
    and its next request joins that session; it must not decode with the mixed batch's stale stacked matrices."""
    eager, static = engines
    eng = eager if mode == "eager" else static
    first = [ChatRequest(LONGER, max_tokens=300, seed=21, ignore_eos=True)]  # long enough to still run when joined
    later = [ChatRequest(MSG, max_tokens=6, temperature=0, ignore_eos=True)]
    eng.generate(later, ["ad2"])  # a prefix and a plan made from the weights before
    joined = eng.stats["joined_running"]
    futs = eng.submit(first, ["ad1"])
    deadline = time.time() + 30
    while not futs[0].running() and time.time() < deadline:  # admitted: its session decodes it
        time.sleep(0.0005)

    def scale(factor):
        with torch.no_grad():
            for n, p in eng.model.named_parameters():
                if ".ad2." in n and "lora_B" in n:
                    p.mul_(factor)

    scale(-2.0)
    try:
        futs += eng.submit(later, ["ad2"])
        outs = [f.result() for f in futs]
        assert eng.stats["joined_running"] == joined + 1  # it joined the running session, mixed with ad1's row
        with torch.no_grad():  # the reference: the same weights, copied into the other engine
            other = static if eng is eager else eager
            params = dict(other.model.named_parameters())
            saved = {n: params[n].clone() for n, _ in eng.model.named_parameters() if ".ad2." in n}
            for n, p in eng.model.named_parameters():
                if n in saved:
                    params[n].copy_(p)
        try:
            _same(other.generate(later, ["ad2"]), outs[1:])
        finally:
            with torch.no_grad():
                for n, v in saved.items():
                    params[n].copy_(v)
    finally:
        scale(-0.5)


def test_a_team_takes_the_decode_mode_from_its_engine_options(tiny_model_dir):
    from marft_lg.serving.team import Team

    with Team(tiny_model_dir, ["planner"], lora=LoraSettings(r=4), versions=None, model_name="tiny",
              engine_options={"decode": "static", "max_batch_size": 4, "static_max_len": 512}) as team:
        out = team.chat([ChatRequest(MSG, agent="planner", max_tokens=4, seed=1, ignore_eos=True)])[0]
        assert len(out.completion_token_ids) == 4 and team.engine.decode == "static"
        assert team.engine._scheduler._static.steps == 3 and team.engine.max_context() == 512


def test_static_max_len_bounds_the_context(tiny_model_dir):
    eng = HFEngine(tiny_model_dir, decode="static", static_max_len=256, max_batch_size=2)
    try:
        assert eng.max_context() == 256
        out = eng.generate([ChatRequest(MSG, max_tokens=5, seed=1, ignore_eos=True)], [None])[0]
        assert len(out.completion_token_ids) == 5
        assert eng._scheduler._static.slots.keys[0].shape[:3] == (2, eng._scheduler._static.slots.keys[0].shape[1], 256)
    finally:
        eng.close()


def test_adapters_that_cannot_be_stacked_take_peft_per_row_path(engines, monkeypatch):
    from marft_lg.serving.engine.mixed_forward import RowAdapters

    eager, static = engines
    reqs, names = _mixed_batch()
    expected = eager.generate(reqs, names)
    static._scheduler.weights_changed()  # a new plan is made at the next step
    monkeypatch.setattr(RowAdapters, "supported", staticmethod(lambda model, adapters: False))
    try:
        _same(expected, static.generate(reqs, names))
        assert static._scheduler._static._fallback and static._scheduler._static._adapters is None
    finally:
        monkeypatch.undo()
        static._scheduler.weights_changed()
    _same(expected, static.generate(reqs, names))
    assert not static._scheduler._static._fallback


@pytest.mark.slow
def test_compiled_gives_the_eager_tokens(engines, tiny_model_dir):
    """torch.compile of the step on CPU (about 35 s for its one bucket on a 2-core box)."""
    eager, _ = engines
    compiled = _engine(tiny_model_dir, "compiled", max_batch_size=4)
    try:
        reqs, names = _mixed_batch()
        reqs, names = reqs[:4], names[:4]
        _same(eager.generate(reqs, names), compiled.generate(reqs, names))
        assert compiled._scheduler._static._compiled is not None
    finally:
        compiled.close()


def test_a_static_engine_serves_from_threads(engines):
    eager, static = engines
    reqs = [ChatRequest(MSG, max_tokens=5, seed=50 + i, ignore_eos=True) for i in range(4)]
    results: list = [None] * 4

    def go(i):
        results[i] = static.generate([reqs[i]], [("ad1", "ad2")[i % 2]])[0]

    threads = [threading.Thread(target=go, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _same(eager.generate(reqs, ["ad1", "ad2", "ad1", "ad2"]), results)
