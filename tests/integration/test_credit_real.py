"""Counterfactual replay and blame on the real 135M model. The math team (reasoner -> actor): a replay repeats the
recorded upstream token for token (prompt ids, completion ids, log-probs) and differs from the replayed step on;
replays are never mined. A relay team (messenger -> recorder): the agent whose adapter is broken is the one blamed
when each step is replaced by the base model."""

from __future__ import annotations

import pytest
import torch

from marft_lg.examples.math_team.graph import ROLES, build_graph
from marft_lg.examples.math_team.problems import make_problems

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def stack(embedded_model_dir, tmp_path_factory):
    from marft_lg.graph.chat_model import TeamChatModel
    from marft_lg.graph.collect import GraphCollector
    from marft_lg.graph.wrap import wrap
    from marft_lg.serving.team import Team

    torch.set_num_threads(2)
    root = tmp_path_factory.mktemp("credit")
    team = Team(embedded_model_dir, ROLES, registry=root / "registry", versions=None, seed=0)
    app = wrap(build_graph(TeamChatModel(team=team, max_tokens=24, temperature=0.8), reasoner_tokens=24,
                           actor_tokens=16), team=team, trace_dir=root / "traces")
    yield team, app, GraphCollector(app, concurrency=16), root
    app.close()
    team.close()


def test_a_replay_repeats_the_upstream_token_for_token(stack):
    from marft_lg.graph.replays import ReplayBudget, plan_replays, step_order
    from marft_lg.trajectories.mining import mine

    team, app, collector, root = stack
    problems = list(make_problems(3, 0, seed=4))
    ds = collector.run([j for j in _jobs(problems)])
    batch = plan_replays(ds, {s.scenario_id: s for s in problems}, ReplayBudget(per_action=1), seed=2)
    replayed = collector.run(batch.jobs)
    assert not collector.failures and len(batch.jobs) == 3 * 2
    redrawn = []
    for job in batch.jobs:
        rows = replayed.actions[replayed.actions["episode_id"] == job.episode_id].sort_values("order")
        orig = ds.actions[ds.actions["episode_id"] == job.replay.episode_id].sort_values("order")
        step = step_order(rows, job.replay)
        assert step == job.replay.step
        for k in range(step):  # held: the same prompt ids, completion ids and log-probs as recorded
            r, o = rows.iloc[k], orig.iloc[k]
            assert list(r["prompt_token_ids"]) == list(o["prompt_token_ids"])
            assert list(r["completion_token_ids"]) == list(o["completion_token_ids"])
            assert list(r["completion_logprobs"]) == list(o["completion_logprobs"])
        a, b = rows.iloc[step], orig.iloc[step]  # the step: asked the same, drawn anew
        assert list(a["prompt_token_ids"]) == list(b["prompt_token_ids"])
        if job.replay.agent == "reasoner":  # 24 sampled tokens: a redraw almost never repeats them all
            redrawn.append(list(a["completion_token_ids"]) != list(b["completion_token_ids"]))
            # what follows the step sees the new step (the actor's prompt holds the reasoner's new text)
            assert (list(rows.iloc[1]["prompt_token_ids"]) != list(orig.iloc[1]["prompt_token_ids"])) == redrawn[-1]
    assert sum(redrawn) >= len(redrawn) - 1
    app.flush()
    assert set(mine(root / "traces").episode_ids) == set(ds.episode_ids)  # replays are never mined


def _jobs(problems, seed=7):
    from marft_lg.graph.collect import plan_episodes

    return plan_episodes("real", problems, 1, 0, seed)


@pytest.mark.parametrize("sabotaged", ["messenger", "recorder"])
def test_the_sabotaged_agent_is_blamed(embedded_model_dir, tmp_path, sabotaged):
    from marft_lg.evaluation.attribution import attribute, blame_markdown
    from marft_lg.examples.relay import ROLES as RELAY
    from marft_lg.examples.relay import build_graph as relay_graph
    from marft_lg.examples.relay import relay_reward, relay_scenarios
    from marft_lg.graph.chat_model import TeamChatModel
    from marft_lg.graph.collect import GraphCollector, plan_episodes
    from marft_lg.graph.replays import ReplayBudget
    from marft_lg.graph.wrap import wrap
    from marft_lg.serving.team import Team
    from marft_lg.training.policy import adapter_parameters

    team = Team(embedded_model_dir, RELAY, registry=tmp_path / "registry", versions=None, seed=0)
    app = wrap(relay_graph(TeamChatModel(team=team, max_tokens=16, temperature=0.7)), team=team,
               trace_dir=tmp_path / "traces")
    try:
        gen = torch.Generator().manual_seed(0)
        with team.exclusive(), torch.no_grad():  # its adapter's weights broken: the agent answers garbage
            for p in adapter_parameters(team.model, team.adapter_name(sabotaged)):
                p.add_(torch.randn(p.shape, generator=gen) * 0.5)
        scenarios = relay_scenarios(6)
        collector = GraphCollector(app, concurrency=16)
        ds = collector.run(plan_episodes("blame", scenarios, 1, 0, 5))
        result = attribute(collector, ds, {s.scenario_id: s for s in scenarios}, relay_reward(),
                           budget=ReplayBudget(per_action=2, reference="base"), seed=0)
        text = blame_markdown(result)
        assert result.failed_episodes == len(scenarios) and result.used == len(scenarios) * 2 * 2, text
        assert result.blamed == sabotaged, text
        by = {a.agent: a for a in result.agents}
        other = "recorder" if sabotaged == "messenger" else "messenger"
        assert result.significant and by[sabotaged].shift.low > 0 >= by[other].shift.mean, text
    finally:
        app.close()
        team.close()
