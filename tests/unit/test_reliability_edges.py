"""Edges found by trying the CLI and the server as a hostile user ([reliability-2]): each is one line naming the
file or flag and an exit code (or a 4xx), never a traceback, and never a silent success."""

from __future__ import annotations

import re

import pytest
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


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    """The server on the tiny model with an API key; the client sends the key."""
    import torch
    from fastapi.testclient import TestClient

    from marft_lg.serving.lora import LoraSettings
    from marft_lg.serving.server import create_app
    from marft_lg.serving.team import Team

    torch.set_num_threads(1)
    team = Team(tiny_model_dir, ["planner"], lora=LoraSettings(r=4, init=False), versions=None, model_name="tiny")
    with TestClient(create_app(team, api_key="sekret")) as client:
        client.headers["Authorization"] = "Bearer sekret"
        yield client
    team.close()


def _error(r, status: int) -> str:
    assert r.status_code == status, r.text
    return r.json()["error"]["message"]


def test_a_tool_schema_that_is_not_a_schema_is_400_naming_the_tool(served):
    good = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    bad = {"type": "function", "function": {"name": "sub", "parameters": {"type": "object", "required": 7}}}
    r = served.post("/v1/chat/completions", json={"model": "planner", "max_tokens": 2, "tools": [good, bad],
                                                  "messages": [{"role": "user", "content": "2-1?"}]})
    message = _error(r, 400)
    assert message.startswith("tools[1].function.parameters is not a valid JSON schema: required: 7 is not")
    assert r.json()["error"]["param"] == "tools"


def test_example_arguments_tolerates_a_required_that_is_not_a_list():
    from marft_lg.tool_calls import example_arguments

    assert example_arguments({"type": "object", "required": 7}) == {}
    assert example_arguments({"properties": {"a": {"type": "integer"}}, "required": ["a", 3]}) == {"a": 1}


def test_the_api_docs_need_the_key_when_the_server_has_one(served):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert served.get(path).status_code == 200
        assert served.get(path, headers={"Authorization": ""}).status_code == 401, path
    assert served.get("/health", headers={"Authorization": ""}).status_code == 200
