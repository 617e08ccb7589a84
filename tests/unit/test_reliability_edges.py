"""Edges found by trying the CLI and the server as a hostile user ([reliability-2]): each is one line naming the
file or flag and an exit code (or a 4xx), never a traceback, and never a silent success."""

from __future__ import annotations

import re

from typer.testing import CliRunner

from marft_lg.cli import app

runner = CliRunner()

TRAIN = ("model: /nonexistent/model\nagents: [reasoner, actor]\nreward: {weights: {step_count: -0.1}}\n"
         "phases: [offline]\ndata: data\nregistry: registry\n")


def _flat(text: str) -> str:
    return " ".join(re.sub("[│╭╮╰╯─]", " ", text).split())


def _invoke(*args: object):
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    return result, _flat(result.output)


def test_train_on_data_without_episodes_exits_1_naming_what_was_read(tmp_path):
    (tmp_path / "train.yaml").write_text(TRAIN)
    (tmp_path / "data").mkdir()
    result, text = _invoke("train", "--config", tmp_path / "train.yaml")
    assert result.exit_code == 1, result.output
    assert f"no usable episodes in 0 trace file(s) under {tmp_path / 'data'}: 0 episode(s), 0 action(s)" in text
    (tmp_path / "data" / "noise.jsonl").write_text('{"resourceSpans": []}\n{"not": "a trace"}\n')
    result, text = _invoke("train", "--config", tmp_path / "train.yaml")
    assert result.exit_code == 1 and "in 1 trace file(s)" in text and "0 episode(s), 0 action(s)" in text
    assert not (tmp_path / "registry").exists()  # nothing trained, nothing published


def _serve_line(*args: object) -> str:
    """`serve`'s failure: exit 2 and exactly one line."""
    result, _ = _invoke("serve", "--agents", "planner", *args)
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    return lines[0]


def test_serve_refuses_a_missing_registry_unless_asked_to_create_it(tmp_path):
    missing = tmp_path / "registy"
    line = _serve_line("--model", tmp_path / "no-model", "--registry", missing, "--port", "0")
    assert line.startswith(f"marft-lg serve: --registry {missing} does not exist") and "--create-registry" in line
    assert not missing.exists()
    line = _serve_line("--model", tmp_path / "no-model", "--registry", missing, "--create-registry", "--port", "0")
    assert "--registry" not in line and str(tmp_path / "no-model") in line  # past the registry: the model is missing


def test_serve_refuses_a_port_outside_0_to_65535(tmp_path):
    for port in ("99999", "65536", "-1"):
        line = _serve_line("--model", tmp_path / "no-model", "--port", port)
        assert line == f"marft-lg serve: --port must be 0..65535 (0: any free port), got {port}"
