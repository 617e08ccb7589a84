"""Constrained actions train on the distribution they were sampled from.

A forced tool call and a structured answer are decoded under a grammar's mask; the trace records the constraint
(span -> actions.parquet -> ActionRecord) and log-probs under the masked distribution, and the trainer re-applies
the mask when it recomputes log-probs: the PPO ratio starts at 1, and tokens the grammar ruled out get no gradient.
"""

from __future__ import annotations

import json
import operator
from typing import Annotated, Literal, TypedDict

import numpy as np
import pytest
import torch
from langchain_core.tools import tool
from langgraph.graph import END, START, StateGraph
from pydantic import BaseModel as Schema

from marft_lg.constraints import Grammars, load_constraint, unpack_bitmask
from marft_lg.graph import TeamChatModel
from marft_lg.graph.wrap import wrap
from marft_lg.rewards.components.tools import ToolSelectionAccuracy
from marft_lg.serving.registry.lora import LoraSettings
from marft_lg.serving.team import Team
from marft_lg.training.batch import BaseModel, LazyGrammars, build_batch, stacked_masks
from marft_lg.training.buffer import build_buffer, collate
from marft_lg.training.config import MARFTConfig
from marft_lg.training.policy import _chunk_logp_entropy, only_adapter_trainable, token_logprobs
from marft_lg.trajectories.dataset import Episode
from marft_lg.trajectories.mining import mine


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool
def transfer_to_writer() -> str:
    """Hand over to the writer."""
    return "ok"


class Verdict(Schema):
    accept: bool
    label: Literal["good", "bad"]


class State(TypedDict, total=False):
    msgs: Annotated[list, operator.add]


def _app(llm: TeamChatModel):
    """planner: a forced call of one of two tools; writer: a call of the tool it is told to call; critic: a
    structured verdict; then a free answer."""
    g = StateGraph(State)
    g.add_node("planner", lambda s: {"msgs": [llm.bind_tools([add, transfer_to_writer], tool_choice="any")
                                               .invoke("Add 2 and 3.").content]})
    g.add_node("writer", lambda s: {"msgs": [llm.bind_tools([add, transfer_to_writer], tool_choice="add")
                                              .invoke("Add 2 and 3.").content]})
    g.add_node("critic", lambda s: {"msgs": [str(llm.with_structured_output(Verdict).invoke("Judge: 2 + 3 = 5."))]})
    g.add_node("free", lambda s: {"msgs": [llm.invoke("Say hi.").content]})
    for a, b in ((START, "planner"), ("planner", "writer"), ("writer", "critic"), ("critic", "free"), ("free", END)):
        g.add_edge(a, b)
    return g.compile()


@pytest.fixture(scope="module")
def mined(tiny_model_dir, tmp_path_factory):
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("constrained")
    team = Team(tiny_model_dir, ["planner", "writer", "critic", "free"], lora=LoraSettings(r=4), versions=None, seed=0)
    app = wrap(_app(TeamChatModel(max_tokens=200, seed=3)), team=team, trace_dir=tmp / "traces")
    for i in range(3):
        app.invoke({"msgs": [f"go {i}"]})
    app.flush()
    yield team, mine([tmp / "traces"])
    app.close()
    team.close()


def test_the_constraint_reaches_actions_parquet_and_the_records(mined, tmp_path):
    team, ds = mined
    ds.to_parquet(tmp_path / "ds")
    from marft_lg.trajectories.dataset import TrajectoryDataset

    back = TrajectoryDataset.from_parquet(tmp_path / "ds")
    by_agent = {a: [load_constraint(c) for c in back.actions["constraint"][back.actions["agent"] == a]]
                for a in ("planner", "writer", "critic", "free")}
    assert all(c["type"] == "tool_calls" and c["choice"] == "required" for c in by_agent["planner"])
    assert all(c["type"] == "tool_calls" and c["choice"] == "add" for c in by_agent["writer"])
    assert all(c["type"] == "json_schema" and c["name"] == "Verdict" for c in by_agent["critic"])
    assert by_agent["free"] == [None] * 3
    for row in back.actions.to_dict("records"):
        assert row["completion_logprobs"] is not None and len(row["completion_logprobs"]) == len(row["completion_token_ids"])
    buffer = build_buffer(back, {eid: np.zeros(4) for eid in back.episode_ids}, team.tokenizer, max_context=4096)
    assert len(buffer.records) == 12 and not buffer.recomputed
    assert sum(r.constraint is not None for r in buffer.records) == 9


def _batch(team, ds):
    buffer = build_buffer(ds, {eid: np.linspace(0, 1, 4) for eid in ds.episode_ids}, team.tokenizer, max_context=4096)
    model = team.engine.model
    cfg = MARFTConfig(kl_ref_coef=0.0)
    base = BaseModel(model, team.tokenizer.pad_token_id or 0, LazyGrammars(model, team.tokenizer))
    with team.engine.exclusive():
        batch = build_batch(buffer, {"": base}, cfg, agents=["planner", "writer", "critic", "free"],
                            adapter_for=lambda r: team.adapter_name(r.agent), critic=None)
    return buffer, batch, cfg


def _new_logprobs(team, batch, idx, masked: bool):
    model = team.engine.model
    recs = [batch.records[i] for i in idx]
    t = collate(recs, team.tokenizer.pad_token_id or 0)
    with team.engine.exclusive(), torch.no_grad(), only_adapter_trainable(model, team.adapter_name(recs[0].agent)):
        lp, _ = token_logprobs(model, t["input_ids"], t["attention_mask"], t["completion_mask"],
                               allowed_bits=batch.mask_bits(idx) if masked else None)
    return lp[t["completion_mask"].bool()]


def test_the_ratio_starts_at_one_on_constrained_actions(mined):
    team, ds = mined
    buffer, batch, _ = _batch(team, ds)
    constrained = [i for i, r in enumerate(batch.records) if r.constraint is not None]
    assert set(batch.masks) == set(constrained) and len(constrained) == 9
    for agent in ("planner", "writer", "critic", "free"):
        idx = [i for i, r in enumerate(batch.records) if r.agent == agent]
        old = torch.cat([batch.behaviour[i] for i in idx])  # the engine's: sampled under the grammar's mask
        ratio = (_new_logprobs(team, batch, idx, masked=True) - old).exp()
        assert torch.allclose(ratio, torch.ones_like(ratio), atol=2e-3), (agent, ratio)
        if agent != "free":  # without the mask the trainer would see another distribution
            unmasked = (_new_logprobs(team, batch, idx, masked=False) - old).exp()
            assert float(unmasked.min()) < 0.5, agent
    # a forced token (the only one the grammar allowed) has log-prob 0 under the mask: nothing to learn there
    forced = [i for i in constrained if batch.records[i].agent == "writer"]
    assert float(torch.cat([batch.behaviour[i] for i in forced]).max()) == pytest.approx(0.0, abs=1e-5)


def test_masked_out_tokens_get_no_gradient():
    torch.manual_seed(0)
    vocab, n = 70, 5
    logits = torch.randn(n, vocab, requires_grad=True)
    allowed = torch.zeros(n, vocab, dtype=torch.bool)
    allowed[:, :3] = True
    allowed[2] = True  # a free step in the middle
    bits = torch.zeros(n, 3, dtype=torch.int32)
    for r in range(n):
        for v in allowed[r].nonzero()[:, 0].tolist():
            bits[r, v // 32] |= torch.tensor(1 << (v % 32)).to(torch.int32)
    assert torch.equal(unpack_bitmask(bits, vocab), allowed)
    targets = torch.tensor([0, 1, 50, 2, 1])
    lp, ent = _chunk_logp_entropy(logits, targets, torch.nn.Identity(), bits)
    (lp.sum() + ent.sum()).backward()
    grad = logits.grad
    assert torch.isfinite(grad).all() and torch.isfinite(lp).all() and torch.isfinite(ent).all()
    assert float(grad[~allowed].abs().max()) == 0.0  # masked-out logits: no gradient at all
    assert float(grad[allowed].abs().max()) > 0
    expected = torch.log_softmax(logits.detach()[0, :3], -1)[0]
    assert float(lp[0]) == pytest.approx(float(expected), abs=1e-6)  # renormalised over the allowed tokens


def test_stacked_masks_cover_free_records_with_all_ones(mined):
    team, ds = mined
    _, batch, _ = _batch(team, ds)
    free = next(i for i, r in enumerate(batch.records) if r.constraint is None)
    forced = next(iter(batch.masks))
    bits = stacked_masks(batch.masks, batch.records, [free, forced])
    n_free = batch.records[free].n_tokens
    assert bits.shape[0] == n_free + batch.records[forced].n_tokens
    assert bool((bits[:n_free] == -1).all()) and torch.equal(bits[n_free:], batch.masks[forced])
    assert stacked_masks(batch.masks, batch.records, [free]) is None


def test_a_call_forced_by_name_is_not_credited_as_a_choice(mined):
    _, ds = mined
    eid = ds.episode_ids[0]
    actions = ds.actions[ds.actions["episode_id"] == eid].to_dict("records")
    scenario = {"expected_tools": ["add"]}
    ep = Episode(episode_id=eid, info={}, actions=actions, scenario=scenario)
    writer_calls = [tc["name"] for a in actions if a["agent"] == "writer" for tc in a["tool_calls"]]
    assert writer_calls == ["add"]  # the writer was made to call add ...
    score = ToolSelectionAccuracy(metric="recall")(ep)
    planner_calls = [tc["name"] for a in actions if a["agent"] == "planner" for tc in a["tool_calls"]]
    assert score == (1.0 if "add" in planner_calls else 0.0)  # ... so only the planner's own choice counts


def test_grammars_for_a_model_stop_where_the_engine_stops(mined):
    team, _ = mined
    g = Grammars.for_model(team.engine.model, team.tokenizer)
    assert g.vocab_size == team.engine.model.get_output_embeddings().weight.shape[0]
    assert set(g.info.stop_token_ids) == set(team.engine.eos_token_ids)
    assert json.loads(json.dumps(sorted(g.info.stop_token_ids)))  # plain ints


def test_a_chatopenai_app_on_the_server_records_its_constraint_and_masked_logprobs(tiny_model_dir, tmp_path):
    """The server's span carries the constraint; mining merges it into the app's action, and the trainer can use
    the server's (masked) log-probs as they are."""
    from langchain_openai import ChatOpenAI

    from marft_lg.serving.http.local_server import LocalServer
    from marft_lg.tracing.sink import make_record_sink

    team = Team(tiny_model_dir, ["planner"], lora=LoraSettings(r=4), versions=None, seed=0)
    sink = make_record_sink(tmp_path / "server", file_prefix="served")
    server = LocalServer(team, sink)
    try:
        llm = ChatOpenAI(model="planner", base_url=server.base_url, api_key="none", max_retries=0, max_tokens=200,
                         seed=5)
        g = StateGraph(State)
        g.add_node("planner", lambda s: {"msgs": [str(llm.bind_tools([add], tool_choice="required")
                                                       .invoke("Add 2 and 3.").tool_calls)]})
        g.add_edge(START, "planner")
        g.add_edge("planner", END)
        app = wrap(g.compile(), trace_dir=tmp_path / "app")
        app.invoke({"msgs": ["go"]})
        app.flush()
        sink.flush()
        ds = mine([tmp_path / "app", tmp_path / "server"])
        (row,) = ds.actions.to_dict("records")
        assert load_constraint(row["constraint"])["choice"] == "required"
        assert [c["name"] for c in row["tool_calls"]] == ["add"] and row["tool_errors"] == 0
        assert len(row["completion_logprobs"]) == len(row["completion_token_ids"])
        buffer = build_buffer(ds, {ds.episode_ids[0]: np.ones(1)}, team.tokenizer, max_context=4096)
        (rec,) = buffer.records
        assert rec.constraint is not None and rec.behaviour_logprobs is not None and not buffer.retokenised
        app.close()
    finally:
        server.close()
        sink.shutdown()
        team.close()
