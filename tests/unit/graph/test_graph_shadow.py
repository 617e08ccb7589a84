"""Live shadow mirroring: the live answer never changes, the shadow is traced as the pair's other side."""

from __future__ import annotations

import asyncio
import threading

import pytest
from graph_apps import by_episode, chats, linear, spans
from graph_fakes import FakeEngine

from marft_lg.graph import TeamChatModel, wrap
from marft_lg.tracing import attributes as A


class GatedEngine(FakeEngine):
    """Blocks every call until `gate` is set (a hung candidate, without sleeping in tests)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def chat(self, requests):
        self.entered.set()
        self.gate.wait(30)
        return super().chat(requests)


def _roots(got):
    return [s for s in got if s["parent_span_id"] is None and s["name"].startswith("invoke_workflow")]


def test_version_map_shadow_pairs_and_live_output_unchanged(tmp_path):
    eng = FakeEngine()
    graph = linear(TeamChatModel())
    expected = wrap(graph, team=FakeEngine(), trace_dir=tmp_path / "plain").invoke({"msgs": ["q"]}, seed=3)
    app = wrap(graph, team=eng, trace_dir=tmp_path / "tr", shadow={"writer": "v2"}, sample_rate=1.0)
    out = app.invoke({"msgs": ["q"]}, seed=3, episode_id="live-1", scenario_id="s1")
    assert out == expected
    assert app.wait_for_shadows(10)
    assert app.shadow_stats["completed"] == 1 and app.shadow_stats["failed"] == 0
    got = spans(app, tmp_path / "tr")
    live = _roots(by_episode(got, "live-1"))[0]["attributes"]
    shadow = _roots(by_episode(got, "live-1-shadow"))[0]["attributes"]
    assert live[A.MARFT_MIRROR_SIDE] == "live" and shadow[A.MARFT_MIRROR_SIDE] == "shadow"
    assert live[A.MARFT_MIRROR_PAIR_ID] == shadow[A.MARFT_MIRROR_PAIR_ID]
    assert shadow[A.MARFT_SCENARIO_ID] == "s1"
    assert [c["attributes"][A.MARFT_ADAPTER_VERSION] for c in chats(by_episode(got, "live-1"))] == ["v1", "v1", "v1"]
    assert [c["attributes"][A.MARFT_ADAPTER_VERSION] for c in chats(by_episode(got, "live-1-shadow"))] == ["v1", "v2", "v1"]
    # same seeds on both sides: the planner (same version) answers identically
    lp = chats(by_episode(got, "live-1"))[0]["attributes"]
    sp = chats(by_episode(got, "live-1-shadow"))[0]["attributes"]
    assert lp[A.GEN_AI_REQUEST_SEED] == sp[A.GEN_AI_REQUEST_SEED]
    assert lp[A.GEN_AI_OUTPUT_MESSAGES] == sp[A.GEN_AI_OUTPUT_MESSAGES]


def test_crashing_shadow_engine_is_isolated_and_counted(tmp_path):
    eng = FakeEngine()
    graph = linear(TeamChatModel())
    app = wrap(graph, team=eng, trace_dir=tmp_path, shadow=FakeEngine(fail=True), sample_rate=1.0)
    no_shadow = wrap(graph, team=FakeEngine(), trace_dir=tmp_path / "ref")
    for i in range(3):
        assert app.invoke({"msgs": [f"q{i}"]}, seed=i) == no_shadow.invoke({"msgs": [f"q{i}"]}, seed=i)
    assert app.wait_for_shadows(10)
    assert app.shadow_stats["failed"] == 3 and app.shadow_stats["completed"] == 0
    shadow_roots = [r for r in _roots(spans(app, tmp_path)) if r["attributes"].get(A.MARFT_MIRROR_SIDE) == "shadow"]
    assert len(shadow_roots) == 3 and all(r["status_code"] == 2 for r in shadow_roots)


def test_hung_shadow_never_blocks_and_times_out(tmp_path):
    hung = GatedEngine()
    app = wrap(linear(TeamChatModel()), team=FakeEngine(), trace_dir=tmp_path, shadow=hung, sample_rate=1.0,
               shadow_timeout_s=0.5)
    out = app.invoke({"msgs": ["q"]}, episode_id="h", seed=1)
    assert hung.entered.wait(10)  # the shadow is running, blocked, while the live answer is already back
    assert out == wrap(linear(TeamChatModel()), team=FakeEngine(), trace_dir=tmp_path / "r").invoke({"msgs": ["q"]}, seed=1)
    assert app.wait_for_shadows(10)
    assert app.shadow_stats["timed_out"] == 1
    shadow_root = _roots(by_episode(spans(app, tmp_path), "h-shadow"))[0]
    assert shadow_root["status_code"] == 2 and "TimeoutError" in shadow_root["status_message"]
    hung.gate.set()


def test_full_queue_drops_mirrors_not_requests(tmp_path):
    hung = GatedEngine()
    app = wrap(linear(TeamChatModel(), names=("planner",)), team=FakeEngine(), trace_dir=tmp_path, shadow=hung,
               sample_rate=1.0, shadow_queue_size=1, shadow_timeout_s=30)
    for i in range(5):
        assert app.invoke({"msgs": [f"q{i}"]})["msgs"][0] == f"q{i}"
    stats = app.shadow_stats
    assert stats["sampled"] == 5 and stats["dropped"] >= 3 and stats["submitted"] + stats["dropped"] == 5
    hung.gate.set()
    assert app.wait_for_shadows(10)
    assert app.shadow_stats["completed"] == stats["submitted"]


def test_sample_rate_and_async_mirroring(tmp_path):
    eng = FakeEngine()
    app = wrap(linear(TeamChatModel(), names=("planner",)), team=eng, trace_dir=tmp_path, shadow="candidate",
               sample_rate=0.5, shadow_seed=7)

    async def run():
        return [await app.ainvoke({"msgs": [str(i)]}) for i in range(40)]

    outs = asyncio.run(run())
    assert [o["msgs"][1].startswith("planner@v1") for o in outs] == [True] * 40
    assert app.wait_for_shadows(10)
    stats = app.shadow_stats
    n = stats["sampled"]
    assert 8 <= n <= 32
    # a full queue drops a mirror (counted) rather than block the live call; on a slow machine some may be
    assert stats["submitted"] + stats["dropped"] == n and stats["submitted"] >= 8
    assert stats["completed"] == stats["submitted"] and stats["failed"] == stats["timed_out"] == 0
    shadow_calls = [r for r in eng.requests if r.version == "candidate"]
    assert len(shadow_calls) == stats["completed"]


def test_shadow_arguments_are_validated():
    with pytest.raises(ValueError, match="needs shadow"):
        wrap(object(), trace_dir=None, sample_rate=0.1)
    with pytest.raises(ValueError, match="needs team"):
        wrap(object(), trace_dir=None, shadow={"writer": "v2"}, sample_rate=0.1)
    with pytest.raises(ValueError, match="sample_rate"):
        wrap(object(), trace_dir=None, team=FakeEngine(), shadow="candidate", sample_rate=2)
