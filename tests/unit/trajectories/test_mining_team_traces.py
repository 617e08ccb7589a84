"""The support team served by a real Team (tiny random model, or the embedded 135M model), traced by
`wrap`, then mined: token ids, log-probs and adapter versions come through from the engine."""

from __future__ import annotations

import pytest

from examples.support_team.app import build_graph
from marft_lg.trajectories.mining import mine_with_report

AGENTS = ["planner", "researcher", "writer", "critic"]


def _run_and_mine(model_dir, trace_dir, questions, max_tokens):
    import torch

    from marft_lg.graph.chat_model import TeamChatModel
    from marft_lg.graph.wrap import wrap
    from marft_lg.serving.team import Team

    torch.set_num_threads(1)
    team = Team(model_dir, AGENTS)
    try:
        app = wrap(build_graph(TeamChatModel(team=team, max_tokens=max_tokens, temperature=1.0, seed=3)),
                   team=team, trace_dir=trace_dir)
        for i, q in enumerate(questions):
            app.invoke({"question": q}, {"max_concurrency": 1}, episode_id=f"real-{i}", scenario_id=f"s{i}", seed=i)
        app.flush()
        app.close()
        versions = team.versions()
    finally:
        team.close()
    dataset, report = mine_with_report(trace_dir)
    return dataset, report, versions


def _check(dataset, report, versions, n_episodes):
    assert report.quarantined == {} and report.formats == {"own": report.spans_kept}
    assert sorted(dataset.episode_ids) == [f"real-{i}" for i in range(n_episodes)]
    acts = dataset.actions
    for _episode, group in acts.groupby("episode_id"):
        agents = group["agent"].tolist()
        assert agents[0] == "planner" and agents[-1] == "critic" and "writer" in agents
        assert group["order"].tolist() == list(range(len(group)))
        writer = group[group["agent"] == "writer"].iloc[0]
        researchers = group[group["agent"] == "researcher"]
        assert set(researchers["order"]) <= set(writer["depends_on"])  # the writer saw the findings' step
    for row in acts.to_dict("records"):
        assert row["prompt_token_ids"] and row["completion_token_ids"]
        assert len(row["completion_logprobs"]) == len(row["completion_token_ids"])
        assert all(lp <= 0.0 for lp in row["completion_logprobs"])
        assert row["adapter_version"] is not None and row["adapter_version"].endswith(versions[row["agent"]])


def test_tiny_model_team_traces_mine_with_token_data(tiny_model_dir, tmp_path):
    dataset, report, versions = _run_and_mine(tiny_model_dir, tmp_path, ["How long is the refund window?"], 6)
    _check(dataset, report, versions, 1)


@pytest.mark.integration
def test_embedded_model_team_traces_mine_with_token_data(embedded_model_dir, tmp_path):
    questions = ["How many days do I have to ask for a refund?"]
    dataset, report, versions = _run_and_mine(embedded_model_dir, tmp_path, questions, 12)
    _check(dataset, report, versions, 1)
