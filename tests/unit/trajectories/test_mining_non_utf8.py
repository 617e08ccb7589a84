"""Lines with bytes that are not UTF-8 are still mined (the bytes read as U+FFFD, as before) and counted in the
mining report (`non_utf8_lines`) and the `marft-lg mine` summary, with one and with two worker processes."""

from __future__ import annotations

from trajectory_spans import line, own_episode
from typer.testing import CliRunner

from marft_lg.cli import app
from marft_lg.trajectories.mining import mine_to_parquet, mine_with_report


def _corpus(tmp_path, n_bad: int = 2):
    lines = [line(own_episode(i + 1, f"e{i}", base=10 * i)).encode() for i in range(4)]
    for i in range(n_bad):  # a Latin-1 byte inside the planner's output text
        lines[i] = lines[i].replace(b"refund_policy please", b"refund_policy pl\xe9ase", 1)
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_non_utf8_lines_are_counted_and_still_mined(tmp_path):
    dataset, report = mine_with_report(_corpus(tmp_path))
    assert report.non_utf8_lines == 2 and report.quarantined_total == 0
    assert dataset.episode_ids == ["e0", "e1", "e2", "e3"]
    planner = dataset.actions[dataset.actions["agent"] == "planner"]["completion"].tolist()
    assert planner.count("TOPICS: refund_policy pl\ufffdase") == 2
    clean, report = mine_with_report(_corpus(tmp_path, n_bad=0))
    assert report.non_utf8_lines == 0 and len(clean) == 4


def test_non_utf8_count_with_workers_and_in_the_cli(tmp_path):
    src = _corpus(tmp_path)
    assert mine_to_parquet(src, tmp_path / "out", workers=2).non_utf8_lines == 2
    result = CliRunner().invoke(app, ["mine", str(src), "--out", str(tmp_path / "cli")])
    assert result.exit_code == 0, result.output
    assert "lines with non-UTF-8 bytes" in " ".join(result.output.split())
