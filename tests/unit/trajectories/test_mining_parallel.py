"""Multi-process mining gives exactly the one-process tables, also when the cut between workers falls inside
a trace or an episode, with re-exports on both sides, feedback far from its episode and damage in each part."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest
from trajectory_spans import feedback_span, line, own_episode, span, write

from marft_lg.tracing import attributes as A
from marft_lg.tracing.files import trace_files
from marft_lg.trajectories.dataset import TrajectoryDataset
from marft_lg.trajectories.mining import mine_to_parquet, mine_with_report
from marft_lg.trajectories.ranges import number_lines, plan_ranges

SAMPLES = Path(__file__).resolve().parents[3] / "traces" / "samples"


def _genai_call(trace: int, sid: int, conversation: str, agent: str, t: float, prompt: str, answer: str) -> dict:
    return span(trace, sid, None, f"chat {agent}", t, t + 5, {
        "gen_ai.operation.name": "chat", "gen_ai.agent.name": agent, "gen_ai.conversation.id": conversation,
        "gen_ai.input.messages": A.to_genai_messages([{"role": "user", "content": prompt}]),
        "gen_ai.output.messages": A.to_genai_messages([{"role": "assistant", "content": answer}])})


def _damaged_input(tmp_path):
    """Twenty episodes over many lines; e0's trace is cut in two (first and last line), a conversation has one
    trace at each end, spans are re-exported across the cut, and each half holds garbage."""
    lines = []
    e0 = own_episode(1, "e0")
    lines.append(line(e0[:3]))
    lines.append(line([_genai_call(900, 1, "conv-x", "asker", 0, "What is the refund window?", "Thirty days, sir.")]))
    lines.append("not json at all")
    for i in range(1, 20):
        lines.append(line(own_episode(10 + i, f"e{i}", t=10.0 * i, tool_error=i % 7 == 0)))
    lines.append(line([feedback_span(500, 1, "e0", "thumbs", 1, 5000), feedback_span(501, 1, "e5", "thumbs", 0, 5001),
                       feedback_span(502, 1, "e-missing", "thumbs", 1, 5002)]))
    lines.append('{"hello": "world"}')
    lines.append(line([_genai_call(901, 1, "conv-x", "checker", 50, "Answer: Thirty days, sir. OK?", "Yes, correct.")]))
    lines.append(line(e0[3:] + [e0[0]] + own_episode(12, "e2", t=20.0)[:2]))  # rest of e0, re-exports of e0 and e2
    return write(tmp_path / "spans.jsonl", lines)


def _quarantine(path):
    return sorted(json.dumps(json.loads(ln), sort_keys=True) for ln in path.read_text().splitlines())


def test_plan_ranges_cover_every_line_once(tmp_path):
    src = _damaged_input(tmp_path)
    other = write(tmp_path / "b.jsonl", ["x", "y", "z"])
    groups = plan_ranges(trace_files([src, other]), 3)
    assert len(groups) == 3
    seen = []
    for group in groups:
        for r in group:
            data = r.path.read_bytes()
            end = len(data) if r.end is None else r.end
            assert r.start == 0 or data[r.start - 1:r.start] == b"\n"  # ranges start at a line start
            assert r.first_line == data[:r.start].count(b"\n") + 1
            seen.append((r.path, r.start, end))
    for path in (src, other):
        spans = sorted((s, e) for p, s, e in seen if p == path)
        assert spans[0][0] == 0 and spans[-1][1] == path.stat().st_size
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))


def test_line_numbers_counted_after_planning_are_the_same(tmp_path):
    src = _damaged_input(tmp_path)
    other = write(tmp_path / "b.jsonl", ["x", "y", "z"] * 50)
    files = trace_files([src, other])
    for workers in (2, 3, 5):
        lazy = plan_ranges(files, workers, count_lines=False)
        assert all(r.first_line == 1 for r in lazy[0])  # the first worker starts before any counting
        assert number_lines(lazy) == plan_ranges(files, workers)


@pytest.mark.parametrize("workers", [2, 3])
def test_workers_give_the_one_process_tables_and_quarantine(tmp_path, workers):
    src = _damaged_input(tmp_path)
    one, rep1 = mine_with_report(src, quarantine=tmp_path / "q1.jsonl", workers=1)
    many, rep2 = mine_with_report(src, quarantine=tmp_path / "q2.jsonl", workers=workers)
    assert len(plan_ranges([src], workers)) == workers
    pd.testing.assert_frame_equal(one.episodes, many.episodes)
    pd.testing.assert_frame_equal(one.actions, many.actions)
    assert rep1 == rep2.__class__(**{**rep2.__dict__, "quarantine_path": rep1.quarantine_path})
    assert _quarantine(tmp_path / "q1.jsonl") == _quarantine(tmp_path / "q2.jsonl")
    # what the input was built to exercise
    assert rep1.quarantined == {"duplicate": 3, "feedback_without_episode": 1, "invalid_json": 1, "not_otlp": 1}
    assert "conv-x" in one.episode_ids and len(one) == 21
    e0 = one.actions[one.actions["episode_id"] == "e0"]
    assert e0["agent"].tolist() == ["planner", "researcher"]
    feedback = one.episodes.set_index("episode_id")["feedback"]
    assert feedback["e0"] == {"thumbs": 1} and feedback["e5"] == {"thumbs": 0}
    conv = one.actions[one.actions["episode_id"] == "conv-x"]
    assert conv["agent"].tolist() == ["asker", "checker"] and conv["depends_on"].tolist() == [[], [0]]


def test_workers_write_the_one_process_parquet(tmp_path):
    src = _damaged_input(tmp_path)
    rep1 = mine_to_parquet(src, tmp_path / "one", workers=1, chunk_actions=4)
    rep2 = mine_to_parquet(src, tmp_path / "two", workers=2, chunk_actions=4)
    assert rep1.actions_per_agent == rep2.actions_per_agent and rep1.episodes == rep2.episodes == 21
    a, b = TrajectoryDataset.from_parquet(tmp_path / "one"), TrajectoryDataset.from_parquet(tmp_path / "two")
    pd.testing.assert_frame_equal(a.episodes, b.episodes)
    pd.testing.assert_frame_equal(a.actions, b.actions)
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == ["actions.parquet", "episodes.parquet"]


def test_samples_mined_by_several_workers(tmp_path):
    one, rep1 = mine_with_report(SAMPLES, workers=1)
    many, rep2 = mine_with_report(SAMPLES, workers=4)
    pd.testing.assert_frame_equal(one.actions, many.actions)
    pd.testing.assert_frame_equal(one.episodes, many.episodes)
    assert Counter(rep1.formats) == Counter(rep2.formats)


def test_workers_stream_batches_that_the_parent_writes_in_order(tmp_path):
    """Workers send their batches to the parent (no pyarrow in them); the parent writes several row groups per
    worker part and the concatenated files hold exactly the one-process rows (episodes that cross workers come
    first, assembled by the parent, so rows are compared in key order)."""
    import pyarrow.parquet as pq

    src = _damaged_input(tmp_path)
    mine_to_parquet(src, tmp_path / "one", workers=1, chunk_actions=3)
    mine_to_parquet(src, tmp_path / "three", workers=3, chunk_actions=3)
    for name, keys in (("episodes", ["episode_id"]), ("actions", ["episode_id", "order"])):
        one, three = (pq.read_table(tmp_path / run / f"{name}.parquet").sort_by([(k, "ascending") for k in keys])
                      for run in ("one", "three"))
        assert one.num_rows > 0 and one.equals(three), name
    groups = pq.ParquetFile(tmp_path / "three" / "actions.parquet").num_row_groups
    assert groups > 3 + 1  # more than one batch per worker part (and the parent's own)


def test_batch_files_give_back_what_was_written(tmp_path):
    """A worker's batch file (marshal records: plain values, flat columns as raw bytes, tagged values where marshal
    cannot write one) reads back equal, column order and flat columns included."""
    from datetime import datetime

    import numpy as np

    from marft_lg.trajectories.flat_columns import TokenColumn
    from marft_lg.trajectories.range_worker import _dump_batch, _load_batch

    tokens = TokenColumn("int", np.array([1, 2, 3]), np.array([0, 1, 3]), np.array([True, True]))
    rows = [{"episode_id": "e1", "metadata": {"k": [1, 2.5, None, True]}, "n": 2**70}]
    cols = {"order": [0, 1], "prompt_token_ids": tokens, "messages": [[{"role": "user", "content": "é"}], []]}
    odd_rows = [{"episode_id": "e2", "when": datetime(2026, 1, 1)}]  # marshal cannot write a datetime
    path = tmp_path / "rows.bin"
    with path.open("wb") as fh:
        _dump_batch(fh, rows, cols)
        _dump_batch(fh, odd_rows, {"order": [5]})
    with path.open("rb") as fh:
        got_rows, got_cols = _load_batch(fh)
        assert got_rows == rows and list(got_cols) == list(cols)
        assert got_cols["order"] == [0, 1] and got_cols["messages"] == cols["messages"]
        assert got_cols["prompt_token_ids"].to_lists() == [[1], [2, 3]]
        assert _load_batch(fh) == (odd_rows, {"order": [5]})
        with pytest.raises(EOFError):
            _load_batch(fh)
