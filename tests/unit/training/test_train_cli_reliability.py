"""`marft-lg train` on hostile input: every bad config or missing file is one line naming file:line: key, exit 2,
never a traceback; a run directory that holds another run is refused unless --resume or --overwrite."""

from __future__ import annotations

import json
import re
import types
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from marft_lg._config import ConfigError, ConfigNotFound
from marft_lg.cli import app
from marft_lg.training.commands import TrainFile
from marft_lg.training.config import MARFTConfig
from tests.cli_text import flat

runner = CliRunner()


class _OneEpisode(list):
    """A stand-in dataset with one episode and one action: enough for `train` to go on to the trainer."""

    def __init__(self) -> None:
        import pandas as pd

        super().__init__([{"episode_id": "e"}])
        self.actions = [{"episode_id": "e"}]
        self.episodes = pd.DataFrame({"episode_id": ["e"]})


def _write(tmp_path, text: str):
    p = tmp_path / "train.yaml"
    p.write_text(text)
    return p


def _invoke(*args):
    result = runner.invoke(app, ["train", *map(str, args)])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result, flat(result.output)


BASE = ("model: /nonexistent/model\nagents: [reasoner, actor]\nreward: {weights: {step_count: -0.1}}\n"
        "phases: [offline]\ndata: data\n")


def test_phases_as_a_single_string_is_one_phase(tmp_path):
    spec = TrainFile.load(_write(tmp_path, "agents: [a]\nreward: r.yaml\nphases: offline\n"))
    assert spec.phases == ["offline"]
    with pytest.raises(ConfigError, match=r"train.yaml:3: phases: phases \['offlin'\] unknown"):
        TrainFile.load(_write(tmp_path, "agents: [a]\nreward: r.yaml\nphases: offlin\n"))


def test_agents_as_a_single_string_and_duplicates(tmp_path):
    assert TrainFile.load(_write(tmp_path, "agents: reasoner\nreward: r.yaml\n")).agents == ["reasoner"]
    with pytest.raises(ConfigError, match=r"train.yaml:1: agents: duplicate agent roles \['a'\]"):
        TrainFile.load(_write(tmp_path, "agents: [a, b, a]\nreward: r.yaml\n"))
    result, text = _invoke("--config", _write(tmp_path, BASE.replace("[reasoner, actor]", "[actor, actor]")))
    assert result.exit_code == 2 and "train.yaml:2: agents: duplicate agent roles ['actor']" in text
    assert "Traceback" not in result.output


def test_yaml_syntax_error_names_file_line_and_column(tmp_path):
    result, text = _invoke("--config", _write(tmp_path, "agents: [a]\nreward: {weights: [1,\nphases: x\n"))
    assert result.exit_code == 2, result.output
    assert re.search(r"train\.yaml:\d+:\d+: not valid YAML", text) and "Traceback" not in result.output


def test_a_word_for_a_learning_rate_names_the_key_and_line(tmp_path):
    p = _write(tmp_path, BASE + "marft:\n  kl_cut: null\n  learning_rate: fast\n")
    with pytest.raises(ConfigError, match=r"train.yaml:8: marft.learning_rate: expected a number, got str 'fast'"):
        TrainFile.load(p)
    result, text = _invoke("--config", p)
    assert result.exit_code == 2 and "train.yaml:8: marft.learning_rate: expected a number" in text
    assert MARFTConfig.from_dict({"learning_rate": "5e-5"}).learning_rate == 5e-5  # YAML 1.1 reads 5e-5 as text


@pytest.mark.parametrize(("extra", "message"), [
    ("marft: {clip_low: -1}\n", r"train.yaml:6: marft.clip_low: must be >= 0 and < 1, got -1"),
    ("marft: {gamma: 1.5}\n", r"train.yaml:6: marft.gamma: must be >= 0 and <= 1"),
    ("marft: {ppo_epochs: 2.5}\n", r"train.yaml:6: marft.ppo_epochs: expected an integer, got float 2.5"),
    ("versions: 5\n", r"train.yaml:6: versions: expected an alias name .* got int 5"),
    ("versions: {critic: v1}\n", r"train.yaml:6: versions.critic: role 'critic' is not one of the agents"),
    ("online: {iterations: -3}\n", r"train.yaml:6: online.iterations: must be >= 0"),
    ("online: {recursion_limit: 0}\n", r"train.yaml:6: online.recursion_limit: must be >= 1"),
    ("online: {recursion_limit: many}\n", r"train.yaml:6: online.recursion_limit: expected an integer"),
    ("run_dir: [a]\n", r"train.yaml:6: run_dir: expected text, got list"),
])
def test_types_and_ranges_are_checked(tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        TrainFile.load(_write(tmp_path, BASE + extra))
    assert MARFTConfig.from_dict({}).clip_low == 0.2
    with pytest.raises(ConfigError, match="clip_low: must be >= 0"):
        MARFTConfig(clip_low=-1)


@pytest.mark.parametrize(("edit", "message"), [
    ({"reward": "missing.yaml"}, r"train.yaml:\d+: reward: reward file .*missing.yaml does not exist"),
    ({"scenarios": "missing.jsonl"}, r"train.yaml:\d+: scenarios: scenario file .*missing.jsonl does not exist"),
    ({}, r"train.yaml:\d+: data: .*data does not exist"),
])
def test_missing_paths_exit_2_without_traceback(tmp_path, edit, message):
    data = yaml.safe_load(BASE)
    data.update(edit)
    p = tmp_path / "train.yaml"
    p.write_text(yaml.safe_dump(data, sort_keys=False))
    if edit:
        (tmp_path / "data").mkdir()
    with pytest.raises(ConfigNotFound, match=message):
        TrainFile.load(p).check_inputs()
    result, text = _invoke("--config", p)
    assert result.exit_code == 2, result.output
    assert re.search(message, text) and "Traceback" not in result.output


def test_a_run_directory_holding_a_run_is_refused_without_resume_or_overwrite(tmp_path):
    (tmp_path / "data").mkdir()
    run = tmp_path / "runs" / "train"
    (run / "checkpoints" / "iter_000014").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"iteration": i}) + "\n" for i in range(14)))
    result, text = _invoke("--config", _write(tmp_path, BASE))
    assert result.exit_code == 2, result.output
    assert "already holds a run (metrics.jsonl with 14 row(s), 1 checkpoint(s), newest iter_000014)" in text
    assert "--resume" in text and "--overwrite" in text and "Traceback" not in result.output
    result, text = _invoke("--config", tmp_path / "train.yaml", "--resume", "--overwrite")
    assert result.exit_code == 2 and "give one of them" in text


def test_overwrite_deletes_the_run_files_and_keeps_the_rest(tmp_path, monkeypatch):
    seen = {}

    class FakeTeam:
        def __init__(self, model, agents, **kw):
            self.registry = types.SimpleNamespace(set_alias=lambda *a, **k: None)

        def save_version(self, role, **kw):
            return "v1"

        def versions(self):
            return {}

        def close(self):
            pass

    class FakeTrainer:
        run_id, iteration, unpublished, frozen_roles = "run", 1, set(), []
        roles, update_steps = ["reasoner", "actor"], {"reasoner": 1, "actor": 1}
        cfg = types.SimpleNamespace(checkpoint_every=1, update_scheme="parallel")
        tracker = types.SimpleNamespace(context={})

        def __init__(self, team, reward, cfg, run_dir):
            seen["run_dir_files"] = sorted(p.name for p in Path(run_dir).iterdir())

        def close(self, status):
            pass

        def fit_offline(self, dataset, scenarios):
            seen["fit"] = True

    monkeypatch.setattr("marft_lg.serving.team_factory.team", FakeTeam)
    monkeypatch.setattr("marft_lg.training.trainer.MARFTTrainer", FakeTrainer)
    monkeypatch.setattr("marft_lg.training.commands._load_dataset", lambda spec, max_line_mb, *more: _OneEpisode())
    (tmp_path / "data").mkdir()
    run = tmp_path / "runs" / "train"
    (run / "checkpoints" / "iter_000001").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"iteration": 0}\n')
    (run / "notes.txt").write_text("mine")
    result, text = _invoke("--config", _write(tmp_path, BASE), "--overwrite")
    assert result.exit_code == 0, result.output
    assert "--overwrite: deleted metrics.jsonl, checkpoints" in text
    assert seen == {"run_dir_files": ["notes.txt"], "fit": True}


def test_damaged_checkpoints_on_resume_exit_2_naming_them(tmp_path, monkeypatch):
    from marft_lg.training.checkpoint import CheckpointError

    class FakeTeam:
        def __init__(self, *a, **kw):
            pass

        def close(self):
            pass

    class FakeTrainer:
        frozen_roles: list[str] = []

        def __init__(self, *a, **kw):
            pass

        def resume(self):
            raise CheckpointError("cannot resume runs/train: no checkpoint can be used:\n  - iter_000002: truncated")

    monkeypatch.setattr("marft_lg.serving.team_factory.team", FakeTeam)
    monkeypatch.setattr("marft_lg.training.trainer.MARFTTrainer", FakeTrainer)
    monkeypatch.setattr("marft_lg.training.commands._load_dataset", lambda spec, max_line_mb, *more: _OneEpisode())
    (tmp_path / "data").mkdir()
    result, text = _invoke("--config", _write(tmp_path, BASE), "--resume")
    assert result.exit_code == 2 and "iter_000002: truncated" in text and "Traceback" not in result.output
