"""Mining's memory habits: the collector paused while spans are read, one copy of repeated texts in `mine()`'s
batches, and compact JSON columns that hold the same values as the general encoder."""

from __future__ import annotations

import gc
import json
import random

from marft_lg.trajectories.pipeline import gc_paused
from marft_lg.trajectories.quarantine import Quarantine


def test_gc_paused_restores_the_collector():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_gc_paused_hands_its_survivors_to_the_oldest_generation_and_still_collects_cycles():
    import weakref

    class Node:
        pass

    collections: list[int] = []

    def record(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    gc.collect()
    gc.callbacks.append(record)
    try:
        with gc_paused():
            kept = [[i] for i in range(50_000)]
            cycle = Node()
            cycle.me = cycle
            alive = weakref.ref(cycle)
            del cycle
        ran = list(collections)
    finally:
        gc.callbacks.remove(record)
    assert ran == []  # leaving the pause did not walk the 50,000 young objects
    assert gc.get_count()[0] < 1000 and gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None and len(kept) == 50_000  # the cycle made in the pause is still found and freed


def test_gc_paused_leaves_a_callers_frozen_objects_frozen():
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with gc_paused():
            [[i] for i in range(100)]
        assert gc.get_freeze_count() > frozen // 2  # not unfrozen (frozen objects may still be freed meanwhile)
    finally:
        gc.unfreeze()



def test_parquet_batches_skip_string_sharing_and_hold_the_same_values(tmp_path):
    from collections import Counter

    from trajectory_spans import line, own_episode, write

    from marft_lg.trajectories.pipeline import assemble_batches, read_traces

    path = write(tmp_path / "t.jsonl", [line(own_episode(e, f"e{e}", base=10 * e)) for e in range(1, 6)])

    def batches(share: bool):
        traces = read_traces([path], Quarantine(None), max_attribute_bytes=1 << 20, stats={}, formats=Counter())
        episodes = {m[next(iter(m))].episode_id: list(m.values()) for m in traces.values()}
        return list(assemble_batches(episodes, Quarantine(None), {}, {}, None, set(), 100, Counter(),
                                     share_strings=share))

    shared, plain = batches(True), batches(False)
    assert shared == plain
    system = [m[0]["content"] for m in shared[0][1]["messages"] if m[0]["role"] == "system"]
    assert len(system) == 5 and len({id(s) for s in system}) == 1  # one copy of the repeated system prompt
    system = [m[0]["content"] for m in plain[0][1]["messages"] if m[0]["role"] == "system"]
    assert len({id(s) for s in system}) == 5


def test_parsed_json_columns_encode_the_same_values_as_the_general_encoder():
    from marft_lg.trajectories.columns import json_texts

    rng = random.Random(5)

    def value(depth=0):
        kind = rng.randrange(8 if depth < 3 else 5)
        if kind == 0:
            return "".join(rng.choice("ab \"\\\n\té€😀\u2028\x00") for _ in range(rng.randrange(8)))
        if kind == 1:
            return rng.choice([0, -1, 2**63 - 1, 2**64 + 5, -(2**70)])  # over 64 bits: the general encoder
        if kind == 2:
            return rng.choice([0.1, -2.5e-300, 1e16, 123456.789])
        if kind == 3:
            return rng.choice([True, False, None])
        if kind == 4:
            return {}
        if kind == 5:
            return [value(depth + 1) for _ in range(rng.randrange(4))]
        return {str(value(3)) + str(i): value(depth + 1) for i in range(rng.randrange(4))}

    values = [value() for _ in range(3000)] + [None, [], {}]
    fast, general = json_texts(values, parsed=True), json_texts(values)
    assert [None if t is None else json.loads(t) for t in fast] == [None if t is None else json.loads(t) for t in general]
    assert any(f != g for f, g in zip(fast, general, strict=True))  # the fast texts are compact: it did take them
