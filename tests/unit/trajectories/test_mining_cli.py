"""`marft-lg mine` end to end through typer."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from trajectory_spans import line, own_episode, write
from typer.testing import CliRunner

from marft_lg.distributed.commands import mine as mine_command
from marft_lg.trajectories.dataset import TrajectoryDataset

SAMPLES = Path(__file__).resolve().parents[3] / "traces" / "samples"


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command("mine")(mine_command)
    app.command("noop")(lambda: None)  # keeps typer in multi-command mode, like marft_lg/cli.py
    return app


def test_mine_writes_parquet_and_summary(tmp_path):
    bad = write(tmp_path / "bad.jsonl", ["garbage", line(own_episode(1, "e1"))])
    result = CliRunner().invoke(_app(), ["mine", str(SAMPLES / "openinference.jsonl"), str(bad), "--out",
                                         str(tmp_path / "out"), "--quarantine", str(tmp_path / "q.jsonl")])
    assert result.exit_code == 0, result.output
    ds = TrajectoryDataset.from_parquet(tmp_path / "out")
    assert len(ds) == 4 and "e1" in ds.episode_ids
    assert "actions by researcher" in result.output and "invalid_json" in result.output
    assert json.loads((tmp_path / "q.jsonl").read_text().splitlines()[0])["source"].endswith("bad.jsonl:1")


def test_mine_nothing_usable_exits_nonzero(tmp_path):
    bad = write(tmp_path / "bad.jsonl", ["garbage", "{}"])
    result = CliRunner().invoke(_app(), ["mine", str(bad), "--out", str(tmp_path / "out")])
    assert result.exit_code == 1
    assert "nothing usable" in result.output
    assert not (tmp_path / "out").exists()


def test_mine_missing_path_exits_with_message(tmp_path):
    result = CliRunner().invoke(_app(), ["mine", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and "does not exist" in result.output


def test_mine_since_after_everything_writes_empty_tables(tmp_path):
    src = write(tmp_path / "a.jsonl", [line(own_episode(1, "e1"))])
    result = CliRunner().invoke(_app(), ["mine", str(src), "--out", str(tmp_path / "out"), "--since", "2100-01-01T00:00:00Z"])
    assert result.exit_code == 0, result.output
    assert len(TrajectoryDataset.from_parquet(tmp_path / "out")) == 0
    assert "files written before --since" in result.output  # skipped unread (older than the watermark)


def test_mine_with_worker_processes_matches_one_process(tmp_path):
    bad = write(tmp_path / "bad.jsonl", ["garbage", line(own_episode(1, "e1"))])
    outs = {}
    for workers in ("1", "2"):
        out, q = tmp_path / f"out{workers}", tmp_path / f"q{workers}.jsonl"
        result = CliRunner().invoke(_app(), ["mine", str(SAMPLES), str(bad), "--out", str(out), "--quarantine", str(q),
                                             "--workers", workers])
        assert result.exit_code == 0, result.output
        outs[workers] = (TrajectoryDataset.from_parquet(out), q.read_text())
    (one, q1), (two, q2) = outs["1"], outs["2"]
    assert one.episodes.equals(two.episodes) and one.actions.equals(two.actions)
    assert len(one) == 10 and q1 == q2
