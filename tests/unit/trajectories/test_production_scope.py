"""Settled data: an episode that talked to a recording server is settled only when each of its calls has token ids
of its own or its server record; one mined before the server's sink wrote a record is kept but marked and counted.
Also: server records of another run left out in every mining path (one process, workers, parquet)."""

from __future__ import annotations

import logging

from test_served_merge import _app_call, _root, _served

from marft_lg.tracing import attributes as A
from marft_lg.tracing.sink import make_record_sink
from marft_lg.trajectories.dataset import TrajectoryDataset
from marft_lg.trajectories.mining import mine_to_parquet, mine_with_report


def _write(folder, records, prefix="spans"):
    sink = make_record_sink(folder, file_prefix=prefix)
    for r in records:
        sink.submit(r)
    sink.shutdown()
    return folder


def _episode(trace: int, episode: str):
    """A workflow with two calls (a drafter's, a writer's), and the server's record of each."""
    root = _root(trace, episode)
    first = _app_call(trace, root.span_id, episode, "drafter")
    second = _app_call(trace, root.span_id, episode, "writer", t=2_000)
    records = [_served(trace, first.span_id, "drafter", [4], response_id=f"r{trace}a", episode=episode),
               _served(trace, second.span_id, "writer", [5], response_id=f"r{trace}b", end=3_900, episode=episode)]
    return [root, first, second], records


def test_an_episode_mined_before_its_last_server_record_is_not_settled(tmp_path, caplog):
    app, records = _episode(1, "ep")
    _write(tmp_path / "app", app)
    _write(tmp_path / "server", records[:1], "served")  # the writer's record is still in the server's sink
    with caplog.at_level(logging.WARNING, logger="marft_lg.mining"):
        ds, report = mine_with_report([tmp_path / "app", tmp_path / "server"])
    assert list(ds.episodes["settled"]) == [False] and report.unsettled == 1 and len(ds) == 1  # kept, marked
    assert report.actions_without_token_ids == {"writer": 1} and "1 episode(s) are not settled" in caplog.text

    _write(tmp_path / "server", records[1:], "served")  # the sink drained
    ds, report = mine_with_report([tmp_path / "app", tmp_path / "server"])
    assert list(ds.episodes["settled"]) == [True] and report.unsettled == 0


def test_calls_that_expect_no_record_are_settled(tmp_path):
    hosted, _ = _episode(1, "hosted")  # a ChatOpenAI on a hosted model: no server record is ever written
    own_root = _root(2, "own")
    own = _app_call(2, own_root.span_id, "own", "writer")  # a TeamChatModel call: its own token ids
    own.attributes[A.MARFT_PROMPT_TOKEN_IDS] = A.encode_ints([1, 2])
    own.attributes[A.MARFT_COMPLETION_TOKEN_IDS] = A.encode_ints([3])
    ds, report = mine_with_report(_write(tmp_path / "app", [*hosted, own_root, own]))
    assert list(ds.episodes["settled"]) == [True, True] and report.unsettled == 0


def test_another_runs_records_are_left_out_by_workers_and_in_parquet(tmp_path):
    ours_app, ours_served = _episode(1, "ours")
    _, theirs_served = _episode(2, "theirs")
    _write(tmp_path / "app", ours_app)
    _write(tmp_path / "server", ours_served[:1] + theirs_served + ours_served[1:], "served")
    for workers in (1, 2):
        ds, report = mine_with_report([tmp_path / "app", tmp_path / "server"], workers=workers)
        assert ds.episode_ids == ["ours"] and report.served_merged == 2 and report.server_records_unjoined == 2
    report = mine_to_parquet([tmp_path / "app", tmp_path / "server"], tmp_path / "out", workers=2)
    assert report.server_records_unjoined == 2 and list(report.server_records_unjoined_in.values()) == [2]
    written = TrajectoryDataset.from_parquet(tmp_path / "out")
    assert written.episode_ids == ["ours"] and list(written.episodes["settled"]) == [True]
    kept, report = mine_with_report([tmp_path / "server"], server_records_only=True, workers=2)
    assert sorted(kept.episode_ids) == ["ours", "theirs"] and report.server_records_unjoined == 0


def test_train_yamls_data_leaves_other_runs_records_out_unless_server_records_only(tmp_path, capsys):
    from marft_lg.training.commands import _load_dataset

    _, served = _episode(3, "unwrapped")
    _write(tmp_path / "server", served, "served")
    assert len(_load_dataset(str(tmp_path / "server"), 64.0)) == 0
    assert "set server_records_only: true" in capsys.readouterr().err
    assert _load_dataset(str(tmp_path / "server"), 64.0, server_records_only=True).episode_ids == ["unwrapped"]
