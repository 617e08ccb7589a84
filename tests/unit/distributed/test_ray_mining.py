"""Mining over Ray (`marft_lg.distributed.mining`, `marft-lg mine --ray`) gives the tables, report and quarantine of
mining in one process: on the sample traces, on damage of every kind, and when a trace or a conversation is cut
between two Ray actors. Runs on a private 2-CPU Ray cluster on 127.0.0.1."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

ray = pytest.importorskip("ray")

TRAJECTORY_TESTS = Path(__file__).resolve().parents[1] / "trajectories"
sys.path.insert(0, str(TRAJECTORY_TESTS))  # the span builders and cut inputs of the multi-process tests

from test_mining_parallel import SAMPLES, _damaged_input, _quarantine  # noqa: E402
from trajectory_spans import feedback_span, line, own_episode, span, write  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from marft_lg.cli import app  # noqa: E402
from marft_lg.distributed import mining as ray_mining  # noqa: E402
from marft_lg.distributed.config import RayConfig  # noqa: E402
from marft_lg.trajectories.mining import mine_to_parquet, mine_with_report  # noqa: E402
from marft_lg.trajectories.ranges import plan_ranges  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def cluster():
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", _temp_dir=temp,
             configure_logging=False, log_to_driver=False)
    yield
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)


def _files(paths) -> list[Path]:
    from marft_lg.tracing.files import trace_files

    return trace_files(paths)


def _records(path: Path) -> list[str]:
    return _quarantine(path) if path.exists() else []


def _parquet(directory: Path) -> dict[str, object]:
    """Both tables, rows in key order (episodes that cross workers are written first)."""
    import pyarrow.parquet as pq

    return {name: pq.read_table(directory / f"{name}.parquet").sort_by([(k, "ascending") for k in keys])
            for name, keys in (("episodes", ["episode_id"]), ("actions", ["episode_id", "order"]))}


def _same_as_one_process(tmp_path: Path, paths, *, ray_arg="local", workers: int | None = None, **options):
    """Mine `paths` in one process and on Ray (`mine_with_report` and `mine_to_parquet`) and check that tables,
    reports and quarantine records are the same, and that Ray actors read the input (one per range group, every
    one of them given ranges); returns the one-process (dataset, report)."""
    one, report = mine_with_report(paths, quarantine=tmp_path / "q-one.jsonl", workers=1, **options)
    started: list[tuple[int, int]] = []
    start = ray_mining.RayExecutor.start

    def spy(self, index, ranges, **kw):  # each actor the run starts: which group, how many ranges it reads
        started.append((index, len(ranges)))
        return start(self, index, ranges, **kw)

    ray_mining.RayExecutor.start = spy
    try:
        on_ray, ray_report = ray_mining.mine_with_report(paths, quarantine=tmp_path / "q-ray.jsonl", ray=ray_arg,
                                                         workers=workers, progress=lambda n: None, **options)
    finally:
        ray_mining.RayExecutor.start = start
    assert started and [i for i, _ in started] == list(range(len(started))) and all(n > 0 for _, n in started)
    assert workers is None or len(started) == len(plan_ranges(list(_files(paths)), workers))
    pd.testing.assert_frame_equal(one.episodes, on_ray.episodes, check_exact=True)
    pd.testing.assert_frame_equal(one.actions, on_ray.actions, check_exact=True)
    assert ray_report == replace(report, quarantine_path=ray_report.quarantine_path)
    assert _records(tmp_path / "q-ray.jsonl") == _records(tmp_path / "q-one.jsonl")

    pq_one = mine_to_parquet(paths, tmp_path / "one", quarantine=tmp_path / "pq-one.jsonl", workers=1,
                             chunk_actions=3, **options)
    pq_ray = ray_mining.mine_to_parquet(paths, tmp_path / "ray", quarantine=tmp_path / "pq-ray.jsonl", ray=ray_arg,
                                        workers=workers, chunk_actions=3, **options)
    assert pq_ray == replace(pq_one, quarantine_path=pq_ray.quarantine_path)
    assert _records(tmp_path / "pq-ray.jsonl") == _records(tmp_path / "pq-one.jsonl")
    a, b = _parquet(tmp_path / "one"), _parquet(tmp_path / "ray")
    for name in a:
        assert a[name].num_rows > 0 and a[name].schema == b[name].schema and a[name].equals(b[name]), name
    assert ray.is_initialized()  # the connection this process had is left open
    return one, report


def _every_reason(tmp_path: Path) -> Path:
    """Damage of every quarantine reason, spread over the whole file (so over every actor's range), with e0's
    trace cut between the first and the last line and its spans re-exported across the cut."""
    e0 = own_episode(1, "e0")
    no_span_id = dict(own_episode(2, "e1")[1], spanId="")
    no_start = {k: v for k, v in own_episode(3, "e2")[2].items() if k != "startTimeUnixNano"}
    backwards = dict(own_episode(4, "e3")[4], endTimeUnixNano="1")
    huge = json.loads(json.dumps(own_episode(5, "e4")[4]))
    huge["attributes"].append({"key": "app.blob", "value": {"stringValue": "x" * 5000}})
    early_tool = dict(own_episode(6, "e5")[5], spanId=f"{99:016x}", startTimeUnixNano=e0[0]["startTimeUnixNano"],
                      endTimeUnixNano=e0[0]["startTimeUnixNano"])
    lonely_tool = span(70, 1, None, "execute_tool lookup", 0, 1, {"gen_ai.operation.name": "execute_tool",
                                                                 "gen_ai.tool.name": "lookup"})
    episodes = [line(own_episode(i + 1, f"e{i}", t=10.0 * i)) for i in range(1, 7)]
    lines = [line(e0[:3]), "not json at all", '{"hello": "world"}', *episodes[:2], line([huge]), *episodes[2:4],
             line([no_span_id, no_start, backwards]), *episodes[4:], line([early_tool, lonely_tool]),
             line([feedback_span(500, 1, "e0", "thumbs", 1, 5000), feedback_span(501, 1, "e-missing", "thumbs", 0, 5001),
                   feedback_span(502, 1, "e3", "", 1, 5002)]),
             '{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": 5}]}]}]}',
             line(e0[3:] + [e0[0]] + own_episode(3, "e2", t=20.0)[:2]), line(own_episode(3, "e2", t=20.0)[:1])[:-7]]
    return write(tmp_path / "damaged.jsonl", lines)


def test_samples_on_ray_are_mined_as_in_one_process(tmp_path):
    samples = sorted(SAMPLES.glob("*.jsonl"))
    one, report = _same_as_one_process(tmp_path, samples, workers=2)
    assert len(plan_ranges(samples, 2)) == 2 and report.episodes == len(one) == 9


def test_every_quarantine_reason_on_ray(tmp_path):
    src = _every_reason(tmp_path)
    starts = [group[0].first_line for group in plan_ranges([src], 3)]
    assert len(starts) == 3
    _, report = _same_as_one_process(tmp_path, src, workers=3, max_attribute_bytes=4096)
    assert set(report.quarantined) == {"invalid_json", "not_otlp", "missing_id", "bad_time", "end_before_start",
                                       "attribute_too_large", "duplicate", "tool_without_action",
                                       "feedback_without_episode", "bad_feedback"}
    damaged = {int(json.loads(r)["source"].rsplit(":", 1)[1]) for r in _records(tmp_path / "q-one.jsonl")}
    for first, after in zip(starts, [*starts[1:], 10**9], strict=True):  # damage in every actor's range
        assert any(first <= n < after for n in damaged), (first, after, sorted(damaged))


@pytest.mark.parametrize("workers", [2, 3])
def test_a_trace_cut_between_two_actors(tmp_path, workers):
    """e0's trace starts on the first line and ends on the last, a conversation has a trace at each end, and spans
    are re-exported across the cut: the driver merges them as the multi-process miner does."""
    src = _damaged_input(tmp_path)
    groups = plan_ranges([src], workers)
    assert len(groups) == workers and groups[0][0].start == 0 and groups[-1][-1].end is None
    one, report = _same_as_one_process(tmp_path, src, workers=workers)
    assert report.quarantined["duplicate"] == 3 and len(one) == 21
    assert one.actions[one.actions["episode_id"] == "conv-x"]["agent"].tolist() == ["asker", "checker"]


def test_ray_accepts_a_config_and_none_mines_here(tmp_path):
    src = _damaged_input(tmp_path)
    _same_as_one_process(tmp_path, src, ray_arg=RayConfig(address="auto"))  # workers: the cluster's 2 CPUs
    local = ray_mining.mine(src, ray=None, workers=1)
    pd.testing.assert_frame_equal(local.actions, mine_with_report(src, workers=1)[0].actions, check_exact=True)


def test_cli_mine_with_ray_writes_the_one_process_parquet(tmp_path):
    src = _damaged_input(tmp_path)
    mine_to_parquet(src, tmp_path / "one", workers=1, quarantine=tmp_path / "q-one.jsonl")
    result = CliRunner().invoke(app, ["mine", str(src), "--out", str(tmp_path / "ray"), "--ray", "local",
                                      "--workers", "2", "--quarantine", str(tmp_path / "q.jsonl")])
    assert result.exit_code == 0, result.output
    a, b = _parquet(tmp_path / "one"), _parquet(tmp_path / "ray")
    assert all(a[name].equals(b[name]) for name in a)
    assert "duplicate" in result.output and _records(tmp_path / "q.jsonl") == _records(tmp_path / "q-one.jsonl")
    bad = CliRunner().invoke(app, ["mine", str(src), "--out", str(tmp_path / "x"), "--ray", "nowhere"])
    assert bad.exit_code == 2 and "ray address" in bad.output


def test_cli_starts_and_stops_its_own_local_cluster(tmp_path):
    """`marft-lg mine --ray local` in a fresh process: a private cluster, started and stopped by the command."""
    src = _damaged_input(tmp_path)
    mine_to_parquet(src, tmp_path / "one", workers=1)
    done = subprocess.run([sys.executable, "-m", "marft_lg.cli", "mine", str(src), "--out", str(tmp_path / "ray"),
                           "--ray", "local", "--workers", "2"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    a, b = _parquet(tmp_path / "one"), _parquet(tmp_path / "ray")
    assert all(a[name].equals(b[name]) for name in a)


def test_a_failing_actor_raises_with_its_error_and_is_stopped(tmp_path):
    """An actor that cannot read its range (the file is not at that path on its node) fails the run with the
    actor's error, instead of quarantining the file as one process would; the actors are stopped."""
    from marft_lg.trajectories.otlp import FileRange
    from marft_lg.trajectories.parallel import ParallelRun

    run = ParallelRun([[FileRange(tmp_path / "not-on-this-node.jsonl")]], quarantine=None, max_attribute_bytes=2**20,
                      watermark=None, chunk_actions=10, progress=None, executor=ray_mining.RayExecutor(ray))
    try:
        run.start()
        with pytest.raises(RuntimeError, match=r"mining worker 0 \(a Ray actor\) failed(.|\n)*not-on-this-node(.|\n)*shared filesystem"):
            run.parse()
    finally:
        run.close()
    assert all(w.actor is None for w in run._workers)
