"""RetrainJob.from_yaml: defaults, relative paths, actionable errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from marft_lg.jobs.config import RetrainJob


def write(tmp_path, data) -> Path:
    p = tmp_path / "job.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_relative_paths_resolve_against_the_job_file(tmp_path):
    job = RetrainJob.from_yaml(write(tmp_path, {"name": "n", "traces": "spans/", "reward": {"weights": {"a": 1}},
                                                "min_new_episodes": 5, "settle_s": 1}))
    assert job.traces == [str(tmp_path / "spans")]
    assert job.reward == {"weights": {"a": 1}}
    assert job.trainer == str(tmp_path / "trainer.yaml") and job.gate == str(tmp_path / "gate.yaml")
    assert job.store_path == tmp_path / "retrain_runs" / "jobs.sqlite"
    assert job.lock_path == tmp_path / "retrain_runs" / "n.lock"
    assert job.min_new_episodes == 5 and job.settle_s == 1


def test_unknown_key_names_file_and_known_keys(tmp_path):
    p = write(tmp_path, {"min_episodes": 3})
    with pytest.raises(ValueError, match=r"job\.yaml:1: min_episodes: unknown job key; did you mean 'min_new_episodes'"):
        RetrainJob.from_yaml(p)


def test_wrong_types_and_values_are_reported(tmp_path):
    with pytest.raises(ValueError, match=r"job.yaml:1: min_new_episodes: expected an integer, got str 'many'"):
        RetrainJob.from_yaml(write(tmp_path, {"min_new_episodes": "many"}))
    with pytest.raises(ValueError, match=r"job.yaml:1: min_new_episodes: must be >= 0"):
        RetrainJob.from_yaml(write(tmp_path, {"min_new_episodes": -1}))
    with pytest.raises(ValueError, match=r"job.yaml:1: stages: must be 'module:Class'"):
        RetrainJob.from_yaml(write(tmp_path, {"stages": "nocolon"}))
    with pytest.raises(ValueError, match=r"bad.yaml:2:1: not valid YAML"):
        (tmp_path / "bad.yaml").write_text("a: [1,\n")
        RetrainJob.from_yaml(tmp_path / "bad.yaml")


def test_model_mapping_gives_the_agents_or_must_match_them(tmp_path):
    job = RetrainJob.from_yaml(write(tmp_path, {"model": {"planner": "embedded:smollm2-135m-instruct", "writer": "w"}}))
    assert job.model == {"planner": "embedded:smollm2-135m-instruct", "writer": "w"}
    assert job.agents == ["planner", "writer"]
    assert RetrainJob.from_yaml(write(tmp_path, {"model": "m", "agents": ["a"]})).model == "m"
    p = tmp_path / "job.yaml"
    p.write_text("name: n\nmodel:\n  planner: a\n  writer: b\nagents: [planner]\n")
    with pytest.raises(ValueError, match=r"job.yaml:5: agents: agents \['planner'\] do not match the roles of the "
                                         r"model mapping \['planner', 'writer'\]"):  # the message train.yaml gives
        RetrainJob.from_yaml(p)
    p.write_text("name: n\nmodel:\n  planner: a\n  writer: ''\n")
    with pytest.raises(ValueError, match=r"job.yaml:4: model.writer: the model of role 'writer' is empty"):
        RetrainJob.from_yaml(p)
    p.write_text("name: n\nmodel: {}\n")
    with pytest.raises(ValueError, match=r"job.yaml:2: model: model is an empty mapping"):
        RetrainJob.from_yaml(p)
