"""A run whose root span has not reached the traces (exported last, when the run ends; or lost when the app stopped
first) is mined as an "incomplete" episode: its scenario, metadata (a shadow or replay mark included) and result are
unknown, so it is not settled (a retraining job waits for it), it is counted and named in the report, and no reward
scores it. Once the root arrives the same episode is mined whole. Third-party formats, which may have no root, are
not affected."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from test_served_merge import _app_call, _root

sys.path.insert(0, str(Path(__file__).parents[1] / "graph"))
from graph_apps import linear  # noqa: E402
from graph_fakes import FakeEngine  # noqa: E402

from marft_lg.graph import TeamChatModel, wrap  # noqa: E402
from marft_lg.rewards.composite import UNFINISHED, CompositeReward  # noqa: E402
from marft_lg.tracing import attributes as A  # noqa: E402
from marft_lg.tracing.sink import make_record_sink  # noqa: E402
from marft_lg.trajectories.dataset import TrajectoryDataset  # noqa: E402
from marft_lg.trajectories.mining import mine_to_parquet, mine_with_report  # noqa: E402


def _drop_spans(folder, drop) -> int:
    """Rewrite `folder`'s OTLP JSON lines without the spans `drop(span)` selects, as if they were not exported yet."""
    dropped = 0
    for path in sorted(folder.rglob("*.jsonl")):
        lines = []
        for line in path.read_text().splitlines():
            request = json.loads(line)
            for rs in request["resourceSpans"]:
                for ss in rs["scopeSpans"]:
                    kept = [s for s in ss["spans"] if not drop(s)]
                    dropped += len(ss["spans"]) - len(kept)
                    ss["spans"] = kept
            lines.append(json.dumps(request))
        path.write_text("\n".join(lines) + "\n")
    return dropped


def _attr(span, key):
    return next((kv["value"].get("stringValue") for kv in span.get("attributes", []) if kv["key"] == key), None)


def _is_root_of(suffix):
    return lambda s: s["name"].startswith(A.OP_WORKFLOW) and (_attr(s, A.MARFT_EPISODE_ID) or "").endswith(suffix)


def test_shadow_runs_whose_root_is_missing_are_incomplete_never_production_and_never_scored(tmp_path, caplog):
    """The shadow mark lives on the root: without it a mirror would pass for a user's episode."""
    app = wrap(linear(TeamChatModel()), team=FakeEngine(versions={"planner": "v1", "writer": "v1", "critic": "v1"}),
               trace_dir=tmp_path / "traces", shadow={"writer": "v2"}, sample_rate=1.0)
    for i in range(3):
        app.invoke({"msgs": [f"q{i}"]}, seed=i, episode_id=f"user-{i}", scenario_id=f"s{i}",
                   metadata={"reference": "x"})
    assert app.wait_for_shadows(30) and app.flush()
    app.close()
    whole = tmp_path / "traces"
    original = {p: p.read_text() for p in whole.rglob("*.jsonl")}
    assert _drop_spans(whole, _is_root_of("-shadow")) == 3

    with caplog.at_level(logging.WARNING, logger="marft_lg.mining"):
        ds, report = mine_with_report(whole)
    eps = ds.episodes.set_index("episode_id")
    shadows = [f"user-{i}-shadow" for i in range(3)]
    assert sorted(eps.index) == sorted([f"user-{i}" for i in range(3)] + shadows)
    assert report.incomplete == 3 and report.shadows == 0 and report.unsettled == 3
    assert "3 episode(s) are incomplete" in caplog.text
    assert set(eps.loc[shadows, "status"]) == {"incomplete"} and not eps.loc[shadows, "settled"].any()
    assert eps.loc[shadows, "scenario_id"].isna().all()  # the root carries it
    assert set(eps.loc[[f"user-{i}" for i in range(3)], "status"]) == {"ok"}

    result = CompositeReward.from_yaml({"weights": {"step_count": -1.0}}).score(ds)
    scored = result.episodes.set_index("episode_id")
    assert not scored.loc[shadows, "scored"].any() and set(result.action_rewards) == {f"user-{i}" for i in range(3)}
    assert all(e.startswith(f"{UNFINISHED}: status 'incomplete'") for e in scored.loc[shadows, "error"])

    for path, text in original.items():  # the roots arrive: the mirrors are recognised and left out
        path.write_text(text)
    ds, report = mine_with_report(whole)
    assert sorted(ds.episode_ids) == [f"user-{i}" for i in range(3)] and report.shadows == 3
    assert report.incomplete == 0 and report.unsettled == 0 and list(ds.episodes["settled"]) == [True] * 3


def _write(folder, records):
    sink = make_record_sink(folder)
    for r in records:
        sink.submit(r)
    sink.shutdown()
    return folder


def test_every_mining_path_marks_the_episode_and_a_later_mining_completes_it(tmp_path):
    root = _root(1, "ep")
    root.attributes[A.MARFT_SCENARIO_ID] = "s1"
    calls = [_app_call(1, root.span_id, "ep", "planner"), _app_call(1, root.span_id, "ep", "writer", t=2_000)]
    other = [_root(2, "other"), _app_call(2, 0, "other", "writer")]
    other[1].parent_id = other[0].span_id
    _write(tmp_path / "early", [*calls, *other])
    for workers in (1, 2):
        ds, report = mine_with_report(tmp_path / "early", workers=workers)
        eps = ds.episodes.set_index("episode_id")
        assert eps.loc["ep", "status"] == "incomplete" and not eps.loc["ep", "settled"] and report.incomplete == 1
        assert eps.loc["other", "status"] == "ok" and eps.loc["other", "settled"]
        assert (ds.actions["episode_id"] == "ep").sum() == 2  # the actions are kept
    report = mine_to_parquet(tmp_path / "early", tmp_path / "out", workers=2)
    written = TrajectoryDataset.from_parquet(tmp_path / "out").episodes.set_index("episode_id")
    assert report.incomplete == 1 and written.loc["ep", "status"] == "incomplete"

    _write(tmp_path / "late", [root])  # the root span is exported last
    ds, report = mine_with_report([tmp_path / "early", tmp_path / "late"])
    eps = ds.episodes.set_index("episode_id")
    assert eps.loc["ep", "status"] == "ok" and eps.loc["ep", "scenario_id"] == "s1" and report.incomplete == 0


def test_a_third_party_trace_without_a_root_is_not_incomplete(tmp_path):
    call = _app_call(3, 0, "x", "writer")
    for key in (A.MARFT_EPISODE_ID, A.MARFT_AGENT_ROLE):  # plain GenAI semantic conventions: no marft attributes
        del call.attributes[key]
    call.attributes[A.GEN_AI_AGENT_NAME] = "writer"
    ds, report = mine_with_report(_write(tmp_path / "t", [call]))
    assert list(ds.episodes["status"]) == ["ok"] and report.incomplete == 0 and list(ds.episodes["settled"]) == [True]
