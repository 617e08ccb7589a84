"""Recovery of a dead run is decided before anything else can fail; a stages object is checked; job.yaml,
inline sections and gate files name file:line: key; job records and the lock are durable."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from datetime import UTC, datetime, timedelta

import pytest
import yaml
from jobs_fakes import ROLES, FakeStages, append_episodes, make_job, write_adapter
from typer.testing import CliRunner

from marft_lg._config import ConfigError
from marft_lg.cli import app as cli
from marft_lg.evaluation.gate import PromotionGate
from marft_lg.jobs import store as st
from marft_lg.jobs.config import RetrainJob
from marft_lg.jobs.pipeline import RecoveryPending, load_stages, run_once
from marft_lg.jobs.store import JobStore
from marft_lg.jobs.watermark import format_time
from marft_lg.loading import LoadError
from marft_lg.serving.registry.store import AdapterRegistry

T0 = datetime(2026, 3, 1, 2, 0, tzinfo=UTC)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _promoted_then_died(job: RetrainJob, root) -> tuple[str, str]:
    """What a run killed between the `live` flip and its record leaves: v2 live, its record `running`."""
    reg = AdapterRegistry(job.registry)
    candidate = {r: reg.save(r, write_adapter(root / "cand" / r, 2.0), base_fingerprint="fake", parent="v1")
                 for r in ROLES}
    reg.promote(candidate, reason="retrain run nightly-dead: gate passed")
    store = JobStore(job.store_path)
    store.start_run("nightly-dead", job.name, pid=_dead_pid(), hostname=socket.gethostname())
    window_end = format_time(T0 - timedelta(hours=1))
    store.update_run("nightly-dead", window_end=window_end, baseline={r: "v1" for r in ROLES}, candidate=candidate)
    return "nightly-dead", window_end


def _job(root, **settings) -> RetrainJob:
    return RetrainJob.from_yaml(make_job(root, **settings))


def _variant(root, **settings) -> RetrainJob:
    """The job in `root` with some settings changed (its registry untouched)."""
    data = {**yaml.safe_load((root / "job.yaml").read_text()), **settings}
    path = root / "variant.yaml"
    path.write_text(yaml.safe_dump(data))
    return RetrainJob.from_yaml(path)


def test_recovery_survives_stages_that_fail_to_load(tmp_path):
    root = tmp_path / "job"
    job = _job(root)
    run_id, window_end = _promoted_then_died(job, root)
    store = JobStore(job.store_path)
    store.start_run("nightly-early", job.name, pid=_dead_pid(), hostname=socket.gethostname())  # died mining
    broken = _variant(root, stages="no_such_stages_mod_xyz:Stages")
    with pytest.raises(LoadError, match="no module named 'no_such_stages_mod_xyz'"):
        run_once(broken, now=T0, log=lambda m: None)
    assert store.get(run_id).status == st.RUNNING  # not written off as a plain crash
    assert store.get("nightly-early").status == st.CRASHED  # nothing to check: settled at once
    assert store.watermark(job.name) is None
    append_episodes(root / "traces" / "spans.jsonl", [(T0 - timedelta(minutes=m)).isoformat() for m in (30, 20, 10)], "b")
    result = run_once(job, stages=FakeStages(job), now=T0, log=lambda m: None)
    assert [(r.run_id, r.status) for r in result.crashed] == [(run_id, st.PROMOTED)]
    assert "then stopped before recording it" in store.get(run_id).message
    assert result.status == st.PROMOTED and result.record.n_episodes == 3  # only the episodes after its window
    assert store.get(result.record.run_id).window_start == window_end


def test_recovery_that_cannot_read_live_leaves_the_record_and_does_not_start(tmp_path):
    root = tmp_path / "job"
    job = _job(root)
    run_id, _ = _promoted_then_died(job, root)

    class NoLive(FakeStages):
        def live_versions(self, ctx):
            raise OSError("registry unreachable")

    with pytest.raises(RecoveryPending, match="registry unreachable.*stays 'running'"):
        run_once(job, stages=NoLive(job), now=T0, log=lambda m: None)
    store = JobStore(job.store_path)
    assert [(r.run_id, r.status) for r in store.runs()] == [(run_id, st.RUNNING)]
    assert not job.lock_path.exists()


def test_a_dead_run_that_did_not_promote_is_recorded_crashed(tmp_path):
    root = tmp_path / "job"
    job = _job(root)
    store = JobStore(job.store_path)
    store.start_run("nightly-old", job.name, pid=_dead_pid(), hostname=socket.gethostname())
    result = run_once(job, stages=FakeStages(job), now=T0, log=lambda m: None)
    assert [(r.run_id, r.status) for r in result.crashed] == [("nightly-old", st.CRASHED)]
    assert store.get("nightly-old").ended_at is not None


def test_stages_that_are_not_a_stages_class_are_a_clear_error(tmp_path):
    root = tmp_path / "job"
    job = _job(root, stages="os:system")
    with pytest.raises(LoadError, match=r"job.yaml:\d+: cannot build stages 'os:system': calling it with the job "
                                        r"raised TypeError"):
        load_stages(job)
    (root / "half_stages.py").write_text("class Half:\n    def __init__(self, job):\n        pass\n\n"
                                         "    def mine(self, ctx, since):\n        pass\n")
    with pytest.raises(LoadError, match=r"without the RetrainStages method\(s\) \['live_versions', 'train', "):
        load_stages(_job(root, stages="half_stages.py:Half"))
    with pytest.raises(LoadError, match=r"stages 'os:sep' is a str, not a class"):
        load_stages(_job(root, stages="os:sep"))
    out = CliRunner().invoke(cli, ["retrain", "--job", str(root / "job.yaml")])
    assert out.exit_code == 2 and "not a class" in out.output and "Traceback" not in out.output


@pytest.mark.parametrize(("settings", "message"), [
    ({"trainer": {"learning_rate": "fast"}}, r"job.yaml:\d+: trainer.learning_rate: expected a number, got str 'fast'"),
    ({"trainer": {"clip_low": -1}}, r"job.yaml:\d+: trainer.clip_low: must be >= 0"),
    ({"gate": {"max_cost_ratio": -1}}, r"job.yaml:\d+: gate.max_cost_ratio: must be > 0"),
    ({"gate": {"min_pairs": "five"}}, r"job.yaml:\d+: gate.min_pairs: expected an integer"),
    ({"reward": {"weights": {"step_count": "lots"}}}, r"job.yaml:\d+: reward.weights.step_count: expected a number"),
    ({"reward": {"weights": {"a": 1}, "credit": "eventually"}}, r"job.yaml:\d+: reward.credit: credit must be one of"),
    ({"samples_per_scenario": 0}, r"job.yaml:\d+: samples_per_scenario: must be >= 1"),
    ({"recursion_limit": 0}, r"job.yaml:\d+: recursion_limit: must be >= 1 or null"),
    ({"timezone": "Mars/Olympus"}, r"job.yaml:\d+: timezone: unknown time zone"),
    ({"traces": 5}, r"job.yaml:\d+: traces: expected a list of text, got int 5"),
    ({"stages": "os:system", "name": "a b"}, r"job.yaml:\d+: name: must be a non-empty word"),
])
def test_job_yaml_values_are_checked_with_file_line_and_key(tmp_path, settings, message):
    with pytest.raises(ConfigError, match=message):
        _job(tmp_path / "job", **settings)


def test_a_jobs_step_cap_reaches_its_app(tmp_path):
    from marft_lg.jobs.stages import LibraryStages

    job = _job(tmp_path / "job", recursion_limit=12, app="marft_lg.examples.math_team.graph:build_graph")
    assert LibraryStages(job).app_spec().recursion_limit == 12


def test_job_yaml_syntax_error_and_cli_exit_2(tmp_path):
    path = make_job(tmp_path / "job")
    path.write_text(path.read_text() + "gate: {min_pairs: 3\n")
    with pytest.raises(ConfigError, match=r"job.yaml:\d+:\d+: not valid YAML"):
        RetrainJob.from_yaml(path)
    out = CliRunner().invoke(cli, ["retrain", "--job", str(path)])
    assert out.exit_code == 2 and "not valid YAML" in out.output and "Traceback" not in out.output


def test_gate_file_types_and_ranges_name_the_line(tmp_path):
    p = tmp_path / "gate.yaml"
    p.write_text("min_pairs: 5\nsafety:\n  - {name: fmt, component: format, min: 0.9, max: 0.1}\n")
    with pytest.raises(ConfigError, match=r"gate.yaml:3: safety\[0\].min: min 0.9 is above max 0.1"):
        PromotionGate.from_yaml(p)
    p.write_text("gate:\n  component_tolerance: {format: lots}\n")
    with pytest.raises(ConfigError, match=r"gate.yaml:2: gate.component_tolerance.format: expected a number"):
        PromotionGate.from_yaml(p)
    p.write_text("require_ci_lower_above_zero: maybe\n")
    with pytest.raises(ConfigError, match=r"gate.yaml:1: require_ci_lower_above_zero: expected true or false"):
        PromotionGate.from_yaml(p)


def test_job_store_and_lock_writes_are_durable(tmp_path, monkeypatch):
    job = _job(tmp_path / "job")
    store = JobStore(job.store_path)
    with store._connect() as db:
        assert db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL: each commit fsynced
    synced: list[str] = []
    real = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    from marft_lg.jobs.lock import RunLock

    with RunLock(job.lock_path, run_id="r"):
        pass
    assert str(job.lock_path.parent) in synced and any(".nightly.lock." in s for s in synced)


def test_config_errors_survive_a_process_boundary():
    import pickle

    err = ConfigError("bad", path="job.yaml", line=3, key=("gate", "min_pairs"))
    again = pickle.loads(pickle.dumps(err))
    assert str(again) == str(err) == "job.yaml:3: gate.min_pairs: bad"
    load = pickle.loads(pickle.dumps(LoadError("job.yaml: cannot load x", spec="x", source="job.yaml")))
    assert str(load) == "job.yaml: cannot load x" and load.spec == "x"
