"""A support desk written as langgraph-swarm's tutorial writes it (two prebuilt ReAct agents on plain `ChatOpenAI`,
hand-off tools, a checkpointer), on the real SmolLM2-135M behind `marft-lg serve`'s server in this process.

alice's v2 adapter is tuned (a few supervised steps, here) to hand weather questions off to bob; v1 is the
untuned adapter, which never does. Checked: the app run by thread id (`stream`, `astream_events`) is mined with
the prompt token ids the server rendered, the completion ids, log-probs and versions; its hand-offs are trained;
a comparison of v1 vs v2 serves each side its own version through the app's own ChatOpenAIs; on-policy training
runs the app's episodes on the adapters being trained."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "graph"))

from chatopenai_apps import swarm  # noqa: E402

pytestmark = pytest.mark.integration

HANDOFF = '<tool_call>{"name": "transfer_to_bob", "arguments": {}}</tool_call>'
QUESTIONS = ["What is the weather in Paris?", "Is it sunny in Rome?"]


def _ask(q: str) -> dict:
    return {"messages": [{"role": "user", "content": q}]}


@pytest.fixture(scope="module")
def desk(embedded_model_dir, tmp_path_factory):
    """The team (alice v1 untuned, alice v2 tuned to hand off; bob v1) and the prompts alice is tuned on."""
    from marft_lg.serving.team import Team
    from marft_lg.training.buffer import ActionRecord, collate
    from marft_lg.training.policy import adapter_parameters, only_adapter_trainable, token_logprobs
    from marft_lg.trajectories.mining import mine

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("desk")
    team = Team(embedded_model_dir, ["alice", "bob"], registry=root / "registry", versions=None, seed=0)
    v1 = {role: team.save_version(role) for role in ("alice", "bob")}
    wrapped = _app(team, root / "probe")  # alice's prompts as the server renders them (tools included)
    for i, q in enumerate(QUESTIONS):
        wrapped.invoke(_ask(q), episode_id=f"probe-{i}", seed=i)
    wrapped.close()
    prompts = [list(p) for p in mine([root / "probe"]).actions["prompt_token_ids"]][: len(QUESTIONS)]
    tok = team.tokenizer
    target = tok(HANDOFF + "<|im_end|>", add_special_tokens=False)["input_ids"]
    batch = collate([ActionRecord("e", None, 0, "alice", None, p, target, None, 0.0, True, 1) for p in prompts],
                    tok.pad_token_id or 0)
    name = team.adapter_name("alice")
    with team.exclusive():
        optimizer = torch.optim.Adam(adapter_parameters(team.model, name), lr=5e-3)
        for _ in range(4):
            with only_adapter_trainable(team.model, name):
                lp, _ = token_logprobs(team.model, batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
                loss = -lp.sum() / batch["completion_mask"].sum()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    v2 = team.save_version("alice")
    for role, version in v1.items():
        team.load_version(role, version)
    team.registry.set_alias("live", v1)
    yield {"team": team, "root": root, "v1": v1, "v2": v2}
    team.close()


def _app(team, trace_dir):
    from marft_lg.graph.app_spec import AppSpec

    return AppSpec(app=lambda: swarm(), agents=["alice", "bob"]).build_app(team, trace_dir)


def test_the_desk_by_thread_id_is_mined_with_the_servers_ids_and_its_hand_offs_are_trained(desk, tmp_path):
    import numpy as np

    from marft_lg.graph.wrap import wrap
    from marft_lg.serving.http.local_server import LocalServer
    from marft_lg.tracing.sink import make_record_sink
    from marft_lg.training.buffer import _prompt_ids, build_buffer
    from marft_lg.trajectories.mining import mine_with_report

    team = desk["team"]
    team.load_version("alice", desk["v2"])
    requests = []
    real = team.achat

    async def seen(reqs):  # what the server's team was asked, to render it independently
        requests.extend(reqs)
        return await real(reqs)

    team.achat = seen
    sink = make_record_sink(tmp_path / "server", file_prefix="served")
    server = LocalServer(team, sink)  # `marft-lg serve`, in this process
    try:
        app = wrap(swarm(server.base_url, temperature=0.0), trace_dir=tmp_path / "app")
        list(app.stream(_ask(QUESTIONS[0]), {"configurable": {"thread_id": "desk-1"}}, stream_mode="updates"))

        async def events():
            return [e async for e in app.astream_events(_ask(QUESTIONS[1]), {"configurable": {"thread_id": "desk-2"}},
                                                        version="v2")]

        asyncio.run(events())
        app.flush()
        sink.flush()
    finally:
        server.close()
        del team.achat
        team.load_version("alice", desk["v1"]["alice"])
    ds, report = mine_with_report([tmp_path / "app", tmp_path / "server"])
    acts = ds.actions
    assert report.actions_without_token_ids == {} and report.served_merged == len(acts) == len(requests)
    assert sorted(tuple(p) for p in acts["prompt_token_ids"]) == sorted(tuple(team.engine.encode(r)) for r in requests)
    tok = team.tokenizer
    alice = acts[acts["agent"] == "alice"].to_dict("records")
    assert len(alice) == 2 and {r["adapter_version"] for r in alice} == {desk["v2"]}
    for r in alice:  # the hand-off: a tool-call-only answer, with its tokens, log-probs and the server's prompt
        assert [c["name"] for c in r["tool_calls"]] == ["transfer_to_bob"] and r["tool_errors"] == 0
        assert tok.decode(r["completion_token_ids"], skip_special_tokens=True).strip() == HANDOFF
        assert len(r["completion_logprobs"]) == len(r["completion_token_ids"])
        assert len(r["prompt_token_ids"]) > len(_prompt_ids(r, tok))  # the tools block a re-render would lose
    assert set(acts["agent"]) == {"alice", "bob"}  # each conversation went on with bob
    assert set(acts["adapter_version"][acts["agent"] == "bob"]) == {desk["v1"]["bob"]}
    buffer = build_buffer(ds, {e: np.zeros(n) for e, n in zip(ds.episodes["episode_id"], ds.episodes["n_actions"],
                                                                strict=True)}, tok, max_context=2048)
    handoffs = [rec for rec in buffer.records if rec.agent == "alice"]
    assert len(handoffs) == 2 and not buffer.skipped and not buffer.retokenised


def test_compare_v1_v2_serves_the_candidate_episodes_on_v2(desk, tmp_path):
    from marft_lg.evaluation.shadow import shadow_compare
    from marft_lg.rewards.composite import CompositeReward
    from marft_lg.trajectories.scenarios import Scenario

    team = desk["team"]
    wrapped = _app(team, tmp_path / "compare")
    reward = CompositeReward.from_yaml({"weights": {"step_count": -0.1}})
    scenarios = [Scenario(f"q{i}", _ask(q)) for i, q in enumerate(QUESTIONS)]
    result = shadow_compare(wrapped, "live", {"alice": desk["v2"]}, scenarios, reward, drift=False, progress=False)
    wrapped.close()
    cand, base = result.datasets["candidate"].actions, result.datasets["baseline"].actions
    assert set(cand["adapter_version"][cand["agent"] == "alice"]) == {desk["v2"]}
    assert set(base["adapter_version"][base["agent"] == "alice"]) == {desk["v1"]["alice"]}
    assert all("transfer_to_bob" in c for c in cand["completion"][cand["agent"] == "alice"])
    assert "bob" in set(cand["agent"]) and result.meta["invoke_failures"] == {"baseline": 0, "candidate": 0}


def test_on_policy_training_runs_the_desk_on_the_adapters_being_trained(desk, tmp_path):
    from marft_lg.rewards.composite import CompositeReward
    from marft_lg.training.config import MARFTConfig
    from marft_lg.training.policy import adapter_parameters
    from marft_lg.training.trainer import MARFTTrainer
    from marft_lg.trajectories.mining import mine
    from marft_lg.trajectories.scenarios import Scenario

    team = desk["team"]
    team.load_version("alice", desk["v2"])
    wrapped = _app(team, tmp_path / "online")
    cfg = MARFTConfig(group_size=2, update_scheme="simultaneous", learning_rate=1e-4, plots=False, seed=0,
                      rollout_concurrency=4, max_new_tokens=16)
    trainer = MARFTTrainer(team, CompositeReward.from_yaml({"weights": {"step_count": -0.1}}), cfg, tmp_path / "run",
                           progress=False)
    before = [p.detach().clone() for p in adapter_parameters(team.model, team.adapter_name("alice"))]
    try:
        [row] = trainer.fit_online(wrapped, [Scenario("paris", _ask(QUESTIONS[0]))], iterations=1)
        after = [p.detach().clone() for p in adapter_parameters(team.model, team.adapter_name("alice"))]
    finally:
        wrapped.close()
        team.load_version("alice", desk["v1"]["alice"])
    assert row["episodes"] == 2 and row["retokenised"] == {} and not row["skipped"]
    assert wrapped.server.redirected == row["actions"] >= 2  # the app's own calls, all served by the team
    episodes = mine([tmp_path / "online"])
    assert set(episodes.actions["adapter_version"][episodes.actions["agent"] == "alice"]) == {desk["v2"]}
    assert team.adapter_name("alice") != f"alice@{row['published']['alice']}"  # (v1 restored for the others)
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))  # alice's hand-offs were trained
