"""examples/wrap_existing: a plain ChatOpenAI app served by `marft-lg serve`, wrapped, traced and mined."""

from __future__ import annotations

import os

import pytest

from examples.wrap_existing import run as example

pytestmark = pytest.mark.e2e


def test_plain_app_is_traced_and_mined_through_the_server(tiny_model_dir, tmp_path):
    port = example.free_port()
    proc = example.start_server(tiny_model_dir, port, tmp_path / "server.log")
    try:
        out = example.run(f"http://127.0.0.1:{port}/v1", tmp_path / "traces", example.QUESTIONS[:2])
    finally:
        example.stop_server(proc)
    assert proc.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.kill(proc.pid, 0)

    dataset = out["dataset"]
    assert len(out["answers"]) == 2 and all(isinstance(a, str) for a in out["answers"])
    assert len(dataset) == 2
    assert sorted(dataset.episodes["scenario_id"]) == ["q0", "q1"]
    actions = dataset.actions
    assert actions.groupby("episode_id")["agent"].apply(list).tolist() == [["researcher", "writer"]] * 2
    # the writer's prompt holds the researcher's notes, so it depends on the researcher's action
    assert all(deps == [0] for deps in actions[actions["agent"] == "writer"]["depends_on"])
    # ChatOpenAI asked for logprobs: the server's per-token log-probs reach the trajectories
    for row in actions.itertuples():
        assert row.completion_logprobs is not None and len(row.completion_logprobs) == row.output_tokens > 0
        assert all(lp <= 0.0 for lp in row.completion_logprobs)
