"""A trace line longer than the line bound (`max_line_bytes`, `marft-lg mine --max-line-mb`, `max_line_mb` in
train.yaml and job.yaml) is skipped in chunks, never held whole: quarantined as `line_too_long` with its file:line,
and the rest of the file is mined; memory stays flat whatever the line's length."""

from __future__ import annotations

import json
import tracemalloc

import pytest
from trajectory_spans import line, own_episode
from typer.testing import CliRunner

from marft_lg.cli import app
from marft_lg.trajectories.mining import mine_to_parquet, mine_with_report

LONG = 16 * 2**20  # the long line: 16 MB
BOUND = 2**20  # the bound in these tests: 1 MB


def _corpus(tmp_path, *, long: bool = True):
    """Four episodes, one per line, with a 16 MB line (JSON that never closes) as line 3 when `long`."""
    lines = [line(own_episode(i + 1, f"e{i}", base=10 * i)).encode() for i in range(4)]
    if long:
        lines.insert(2, b'{"resourceSpans": [{"junk": "' + b"x" * LONG)
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_a_line_over_the_bound_is_quarantined_with_file_line_and_the_rest_is_mined_in_flat_memory(tmp_path):
    warm = tmp_path / "warm"
    warm.mkdir()
    mine_with_report(_corpus(warm, long=False))  # the lazy imports happen before memory is measured
    src = _corpus(tmp_path)
    quarantine = tmp_path / "q.jsonl"
    tracemalloc.start()
    try:
        dataset, report = mine_with_report(src, quarantine=quarantine, max_line_bytes=BOUND)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert dataset.episode_ids == ["e0", "e1", "e2", "e3"]  # the lines after the long one are mined too
    assert report.quarantined == {"line_too_long": 1} and report.lines == 5
    assert report.first_quarantined == {"line_too_long": [f"{src}:3"]}
    records = [json.loads(r) for r in quarantine.read_text().splitlines()]
    assert [(r["reason"], r["source"]) for r in records] == [("line_too_long", f"{src}:3")]
    assert "raw" not in records[0] and str(LONG + len(b'{"resourceSpans": [{"junk": "') + 1) in records[0]["detail"]
    assert peak < LONG / 4, f"peak {peak / 2**20:.1f} MB: the 16 MB line was held"


def test_the_bound_holds_with_worker_processes_and_in_the_cli(tmp_path):
    src = _corpus(tmp_path)
    report = mine_to_parquet(src, tmp_path / "par", workers=2, max_line_bytes=BOUND)
    assert report.episodes == 4 and report.first_quarantined == {"line_too_long": [f"{src}:3"]}
    runner = CliRunner()
    result = runner.invoke(app, ["mine", str(src), "--out", str(tmp_path / "cli"), "--max-line-mb", "1"],
                           env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    assert "line_too_long" in result.output and f"first at {src}:3" in result.output
    default = runner.invoke(app, ["mine", str(src), "--out", str(tmp_path / "default")], env={"COLUMNS": "400"})
    assert default.exit_code == 0 and "invalid_json" in default.output  # under the 64 MB default: read, not JSON
    bad = runner.invoke(app, ["mine", str(src), "--out", str(tmp_path / "bad"), "--max-line-mb", "0"])
    assert bad.exit_code == 2 and "--max-line-mb must be > 0" in bad.output and "Traceback" not in bad.output


def test_train_and_job_configs_take_the_bound(tmp_path, capsys):
    from marft_lg._config import ConfigError
    from marft_lg.jobs.config import RetrainJob
    from marft_lg.training.commands import TrainFile, _load_dataset

    src = _corpus(tmp_path)
    dataset = _load_dataset(str(src), 1.0)
    assert dataset.episode_ids == ["e0", "e1", "e2", "e3"]
    err = capsys.readouterr().err
    assert "warning: data: 1 trace line(s)" in err and f"first at {src}:3" in err and "max_line_mb" in err
    train = tmp_path / "train.yaml"
    train.write_text(f"agents: [planner]\ndata: {src}\nreward: {{weights: {{step_count: -0.1}}}}\nmax_line_mb: 0\n")
    with pytest.raises(ConfigError, match=r"train.yaml:4.*max_line_mb.*> 0"):
        TrainFile.load(train)
    job = tmp_path / "job.yaml"
    job.write_text("app: app.py:build\nmax_line_mb: -1\n")
    with pytest.raises(ConfigError, match=r"job.yaml:2.*max_line_mb"):
        RetrainJob.from_yaml(job)
    job.write_text("app: app.py:build\nmax_line_mb: 0.5\n")
    assert RetrainJob.from_yaml(job).max_line_mb == 0.5
