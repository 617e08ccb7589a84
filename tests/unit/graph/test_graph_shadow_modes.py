"""Shadow mirroring beyond invoke: stream, astream, batch and abatch episodes are mirrored too."""

from __future__ import annotations

import asyncio

from graph_apps import by_episode, chats, linear, spans
from graph_fakes import FakeEngine

from marft_lg.graph import TeamChatModel, wrap
from marft_lg.tracing import attributes as A


def _root(got, episode_id):
    return [s for s in by_episode(got, episode_id) if s["parent_span_id"] is None][0]["attributes"]


def _check_pair(got, live_id):
    live, shadow = _root(got, live_id), _root(got, f"{live_id}-shadow")
    assert live[A.MARFT_MIRROR_SIDE] == "live" and shadow[A.MARFT_MIRROR_SIDE] == "shadow"
    assert live[A.MARFT_MIRROR_PAIR_ID] == shadow[A.MARFT_MIRROR_PAIR_ID]
    assert [c["attributes"][A.MARFT_ADAPTER_VERSION] for c in chats(by_episode(got, live_id))] == ["v1", "v1", "v1"]
    assert [c["attributes"][A.MARFT_ADAPTER_VERSION]
            for c in chats(by_episode(got, f"{live_id}-shadow"))] == ["v1", "v2", "v1"]


def test_stream_and_astream_are_mirrored_with_unchanged_chunks(tmp_path):
    graph = linear(TeamChatModel())
    plain = list(wrap(graph, team=FakeEngine(), trace_dir=None).stream({"msgs": ["q"]}, seed=5, stream_mode="updates"))
    app = wrap(graph, team=FakeEngine(), trace_dir=tmp_path, shadow={"writer": "v2"}, sample_rate=1.0)
    assert list(app.stream({"msgs": ["q"]}, episode_id="s", seed=5, stream_mode="updates")) == plain

    async def run():
        return [chunk async for chunk in app.astream({"msgs": ["q"]}, episode_id="a", seed=5, stream_mode="updates")]

    assert asyncio.run(run()) == plain
    assert app.wait_for_shadows(10)
    assert app.shadow_stats["completed"] == 2 and app.shadow_stats["failed"] == 0
    got = spans(app, tmp_path)
    _check_pair(got, "s")
    _check_pair(got, "a")
    # the shadow ran the whole graph (with invoke): its root carries the final state as outcome
    assert _root(got, "s-shadow")[A.MARFT_OUTCOME]


def test_batch_and_abatch_mirror_each_input(tmp_path):
    graph = linear(TeamChatModel())
    inputs = [{"msgs": [f"q{i}"]} for i in range(3)]
    expected = wrap(graph, team=FakeEngine(), trace_dir=None).batch(inputs, seeds=[0, 1, 2])
    app = wrap(graph, team=FakeEngine(), trace_dir=tmp_path, shadow={"writer": "v2"}, sample_rate=1.0,
               shadow_queue_size=16)
    assert app.batch(inputs, episode_ids=["b0", "b1", "b2"], seeds=[0, 1, 2]) == expected
    assert asyncio.run(app.abatch(inputs, episode_ids=["c0", "c1", "c2"], seeds=[0, 1, 2])) == expected
    assert app.wait_for_shadows(20)
    stats = app.shadow_stats
    assert stats["sampled"] == 6 and stats["submitted"] == 6 and stats["completed"] == 6
    got = spans(app, tmp_path)
    for live_id in ("b0", "b1", "b2", "c0", "c1", "c2"):
        _check_pair(got, live_id)


def test_a_stream_closed_early_is_still_traced_and_mirrored(tmp_path):
    app = wrap(linear(TeamChatModel()), team=FakeEngine(), trace_dir=tmp_path, shadow={"writer": "v2"}, sample_rate=1.0)
    stream = app.stream({"msgs": ["q"]}, episode_id="early", seed=1, stream_mode="updates")
    next(stream)
    stream.close()
    assert app.wait_for_shadows(10)
    got = spans(app, tmp_path)
    live = [s for s in by_episode(got, "early") if s["parent_span_id"] is None][0]
    assert live["status_code"] != 2  # the caller stopped reading: not a failure
    assert _root(got, "early-shadow")[A.MARFT_MIRROR_SIDE] == "shadow"
    assert len(chats(by_episode(got, "early-shadow"))) == 3
