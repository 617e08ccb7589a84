"""Edges found by trying the CLI and the server as a hostile user ([reliability-2]): each is one line naming the
file or flag and an exit code (or a 4xx), never a traceback, and never a silent success."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from marft_lg.cli import app
from tests.cli_text import flat

runner = CliRunner()

TRAIN = ("model: /nonexistent/model\nagents: [reasoner, actor]\nreward: {weights: {step_count: -0.1}}\n"
         "phases: [offline]\ndata: data\nregistry: registry\n")


def _invoke(*args: object):
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    return result, flat(result.output)


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

    from marft_lg.serving.http.server import create_app
    from marft_lg.serving.registry.lora import LoraSettings
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


def test_a_message_with_an_unknown_role_is_400(served):
    r = served.post("/v1/chat/completions", json={"model": "planner", "max_tokens": 2,
                                                  "messages": [{"role": "bogus", "content": "hi"}]})
    message = _error(r, 400)
    assert "messages[0]" in message and "'bogus'" in message and r.json()["error"]["param"] == "messages"


def _traces(tmp_path):
    """A trace folder with one line (no episode in it: these flags are checked before anything is read)."""
    (tmp_path / "traces").mkdir(exist_ok=True)
    (tmp_path / "traces" / "a.jsonl").write_text('{"resourceSpans": []}\n')
    return tmp_path / "traces"


def test_mine_refuses_bad_output_flags_before_reading(tmp_path):
    traces = _traces(tmp_path)
    (tmp_path / "afile").write_text("mine")
    result, text = _invoke("mine", traces, "--out", tmp_path / "afile")
    assert result.exit_code == 2 and f"marft-lg mine: --out {tmp_path / 'afile'} is a file" in text
    assert (tmp_path / "afile").read_text() == "mine"
    (tmp_path / "qdir").mkdir()
    result, text = _invoke("mine", traces, "--out", tmp_path / "out", "--quarantine", tmp_path / "qdir")
    assert result.exit_code == 2 and f"marft-lg mine: --quarantine {tmp_path / 'qdir'} is a directory" in text
    for mb in ("-1", "0"):
        result, text = _invoke("mine", traces, "--out", tmp_path / "out", "--max-attribute-mb", mb)
        assert result.exit_code == 2 and f"--max-attribute-mb must be > 0, got {float(mb)}" in text


def test_compare_from_traces_with_a_missing_or_empty_folder_is_a_usage_error(tmp_path):
    (tmp_path / "reward.yaml").write_text("weights: {step_count: -0.1}\n")
    (tmp_path / "empty").mkdir()
    for folder, says in ((tmp_path / "missing", "is not a trace directory"), (tmp_path / "empty", "no mirrored pairs")):
        result, text = _invoke("compare", "--from-traces", folder, "--reward", tmp_path / "reward.yaml",
                               "--out", tmp_path / "cmp")
        assert result.exit_code == 2, result.output
        assert "--from-traces" in text and str(folder) in text and says in text


def test_compare_refuses_a_missing_registry_unless_asked_to_create_it(tmp_path):
    (tmp_path / "reward.yaml").write_text("weights: {step_count: -0.1}\n")
    missing = tmp_path / "registy"
    args = ("compare", "--registry", missing, "--reward", tmp_path / "reward.yaml", "--out", tmp_path / "cmp")
    result, text = _invoke(*args)
    assert result.exit_code == 2 and f"--registry {missing} does not exist" in text and "--create-registry" in text
    assert not missing.exists() and not (tmp_path / "cmp").exists()  # nothing created, not even the report folder
    result, text = _invoke(*args, "--create-registry")
    assert result.exit_code == 2 and "does not exist" not in text and "replay needs --scenarios" in text  # past it


def test_jobs_list_on_another_programs_sqlite_file_refuses_it_and_adds_nothing(tmp_path):
    import sqlite3

    other = tmp_path / "app.db"
    with sqlite3.connect(other) as db:
        db.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)")
    result, text = _invoke("jobs", "list", "--store", other)
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert f"error: {other} is an SQLite database of another program (tables: customers), not a job store" in text
    with sqlite3.connect(other) as db:
        assert [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")] == ["customers"]


def test_promote_with_a_missing_or_non_json_decision_is_one_line(tmp_path):
    (tmp_path / "registry").mkdir()
    (tmp_path / "decision.json").write_text("not json")
    (tmp_path / "list.json").write_text("[1, 2]")
    cases = ((tmp_path / "nope.json", f"no gate decision at {tmp_path / 'nope.json'}"),
             (tmp_path / "decision.json", f"gate decision {tmp_path / 'decision.json'} cannot be read as JSON"),
             (tmp_path / "list.json", f"gate decision {tmp_path / 'list.json'} is not a `marft-lg compare` decision"))
    for decision, says in cases:
        result, text = _invoke("promote", "--registry", tmp_path / "registry", "--decision", decision)
        assert result.exit_code == 1 and text.startswith("not promoted: --decision: ") and says in text, text
    assert sorted(p.name for p in (tmp_path / "registry").iterdir()) == []


def test_jobs_list_on_a_file_that_is_not_sqlite_names_it(tmp_path):
    (tmp_path / "jobs.sqlite").write_text("not a database, just text that is long enough to have a header\n" * 4)
    result, text = _invoke("jobs", "list", "--store", tmp_path / "jobs.sqlite")
    assert result.exit_code == 2 and f"error: {tmp_path / 'jobs.sqlite'} is not a job store" in text


def test_score_with_a_binary_scenario_file_names_it(tmp_path):
    from marft_lg.trajectories.dataset import TrajectoryDataset

    TrajectoryDataset().to_parquet(tmp_path / "data")
    (tmp_path / "reward.yaml").write_text("weights: {step_count: -0.1}\n")
    (tmp_path / "s.jsonl").write_bytes(b"\x00\x01\xff\xfe\x80binary")
    result, text = _invoke("score", tmp_path / "data", "--reward", tmp_path / "reward.yaml",
                           "--scenarios", tmp_path / "s.jsonl", "--out", tmp_path / "scores.parquet")
    assert result.exit_code == 2 and f"{tmp_path / 's.jsonl'}: not a scenario file: byte 2 is not UTF-8" in text


def test_serve_with_a_garbage_config_json_names_the_file(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("garbage{")
    line = _serve_line("--model", tmp_path / "model", "--port", "0", "--no-trace")
    assert line.startswith(f"marft-lg serve: {tmp_path / 'model' / 'config.json'}: not a model config (JSON)")


def test_a_role_with_a_space_is_refused(tmp_path):
    line = _serve_line("--agents", "a b", "--model", tmp_path / "no-model", "--port", "0")
    assert "invalid agent role 'a b'" in line
    (tmp_path / "r.yaml").write_text("weights: {step_count: -0.1}\n")
    (tmp_path / "s.jsonl").write_text('{"scenario_id": "s1", "inputs": {"question": "1+1"}}\n')
    result, text = _invoke("compare", "--agents", "a b", "--app", "x.py:g", "--scenarios", tmp_path / "s.jsonl",
                           "--reward", tmp_path / "r.yaml", "--out", tmp_path / "cmp")
    assert result.exit_code == 2 and "invalid agent role 'a b'" in text
