"""The trainer trains only on what really happened.

A structured answer whose schema's properties are not in alphabetical order, sampled by `marft-lg serve` for a
`ChatOpenAI.with_structured_output` app and for a raw `openai` client app, is recorded with its schema as sent and
trained with a first PPO ratio of 1. Records corrupted after the fact (a prompt rendered with another template, a
re-sorted schema, a shifted completion token) are caught, named and left out; an iteration with nothing to train
stops with a `TrainingDataError`.
"""

from __future__ import annotations

import json
import operator
from typing import Annotated, Literal, TypedDict

import numpy as np
import pytest
import torch
from langgraph.graph import END, START, StateGraph
from pydantic import BaseModel as Schema

from marft_lg.constraints import load_constraint
from marft_lg.graph.wrap import wrap
from marft_lg.serving.registry.lora import LoraSettings
from marft_lg.serving.team import Team
from marft_lg.training.checks import GRAMMAR_REJECTED, LOGPROB_MISMATCH, TrainingDataError
from marft_lg.training.config import MARFTConfig
from marft_lg.training.policy import adapter_parameters
from marft_lg.training.trainer import MARFTTrainer
from marft_lg.trajectories.dataset import TrajectoryDataset
from marft_lg.trajectories.mining import mine


class Extract(Schema):
    """Fields not in alphabetical order, each with few values (a tiny random model ends its answer in time)."""

    zeta: Literal["x", "y"]
    alpha: bool


class State(TypedDict, total=False):
    msgs: Annotated[list, operator.add]


def _app(base_url: str, seed: int):
    """One node, three calls to the server: ChatOpenAI's structured output, the same schema through the raw openai
    client, and a free reply."""
    import openai
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="extractor", base_url=base_url, api_key="none", max_retries=0, max_tokens=60, seed=seed)
    raw = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
    schema = {"type": "json_schema", "json_schema": {"name": "Extract", "schema": Extract.model_json_schema(),
                                                     "strict": True}}

    def extractor(state: State) -> State:
        a = llm.with_structured_output(Extract, method="json_schema").invoke("Extract: zeta is x, alpha is true.")
        b = raw.chat.completions.create(model="extractor", messages=[{"role": "user", "content": "Extract it."}],
                                        response_format=schema, max_tokens=60, seed=seed + 1)
        c = raw.chat.completions.create(model="extractor", messages=[{"role": "user", "content": "Say hi."}],
                                        max_tokens=8, seed=seed + 2)
        return {"msgs": [str(a), b.choices[0].message.content, c.choices[0].message.content]}

    g = StateGraph(State)
    g.add_node("extractor", extractor)
    g.add_edge(START, "extractor")
    g.add_edge("extractor", END)
    return g.compile()


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    """The tiny team behind `marft-lg serve` in this process, and 4 episodes of the app mined with its records."""
    from marft_lg.serving.http.local_server import LocalServer
    from marft_lg.tracing.sink import make_record_sink

    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("checks")
    team = Team(tiny_model_dir, ["extractor"], lora=LoraSettings(r=4), versions=None, seed=0)
    sink = make_record_sink(tmp / "server", file_prefix="served")
    server = LocalServer(team, sink)
    try:
        for i in range(4):
            app = wrap(_app(server.base_url, seed=10 * i), trace_dir=tmp / "app")
            app.invoke({"msgs": ["go"]})
            app.flush()
            app.close()
        sink.flush()
        yield team, mine([tmp / "app", tmp / "server"])
    finally:
        server.close()
        sink.shutdown()
        team.close()


def _rewards(ds: TrajectoryDataset) -> dict[str, np.ndarray]:
    return {eid: np.full(int((ds.actions["episode_id"] == eid).sum()), float(k))
            for k, eid in enumerate(ds.episode_ids)}


def _fit(team, ds, tmp_path, **cfg):
    """One offline iteration on `ds`; the adapter's weights are put back after (the next test's records are the
    untrained adapter's)."""
    params = adapter_parameters(team.engine.model, team.adapter_name("extractor"))
    before = [p.detach().clone() for p in params]
    trainer = MARFTTrainer(team, lambda ep: 0.0, MARFTConfig(learning_rate=1e-5, plots=False, **cfg), tmp_path,
                           progress=False)
    try:
        return trainer.fit_offline(ds, action_rewards=_rewards(ds))[0]
    finally:
        with torch.no_grad():
            for p, b in zip(params, before, strict=True):
                p.copy_(b)


def _with(ds: TrajectoryDataset, change) -> TrajectoryDataset:
    """A copy of `ds` whose actions were changed by `change(actions)` (which returns the changed rows' orders)."""
    actions = ds.actions.copy()
    change(actions)
    return TrajectoryDataset(ds.episodes.copy(), actions)


def _structured(actions) -> list:
    return [i for i in actions.index if load_constraint(actions.at[i, "constraint"]) is not None]


def _free(actions) -> list:
    return [i for i in actions.index if load_constraint(actions.at[i, "constraint"]) is None]


def test_the_schema_is_recorded_as_sent_and_the_first_ratio_is_one(served, tmp_path):
    team, ds = served
    constraints = [c for c in map(load_constraint, ds.actions["constraint"]) if c is not None]
    assert len(constraints) == 8  # ChatOpenAI's and the raw client's, 4 episodes
    assert all(list(c["schema"]["properties"]) == ["zeta", "alpha"] for c in constraints)
    assert all(len(p) for p in ds.actions["prompt_token_ids"])  # the server's own ids, nothing re-rendered
    row = _fit(team, ds, tmp_path, kl_cut=0.02)
    stats = row["agents"]["extractor"]
    assert row["data_check_failed"] == 0 and row["actions"] == 12
    assert stats["steps"] > 0 and stats["clip_fraction"] == 0.0 and stats["approx_kl"] < 1e-4, stats
    assert row["updated_agents"] == ["extractor"]


def test_a_resorted_schema_a_wrong_template_and_a_shifted_token_are_named_and_left_out(served, tmp_path):
    team, ds = served
    tok = team.tokenizer

    def corrupt(actions):
        structured = _structured(actions)
        first = structured[0]  # a re-sorted schema, as records were written before the fix
        actions.at[first, "constraint"] = json.dumps(json.loads(actions.at[first, "constraint"]), sort_keys=True)
        free = _free(actions)
        template = free[1]  # the prompt rendered with another template: a system turn the server never saw
        sys_ids = tok.apply_chat_template([{"role": "system", "content": "You are terse."}], tokenize=True,
                                        return_dict=False)
        actions.at[template, "prompt_token_ids"] = [*sys_ids, *actions.at[template, "prompt_token_ids"]]
        shifted = free[2]  # completion tokens one position late
        ids = list(actions.at[shifted, "completion_token_ids"])
        actions.at[shifted, "completion_token_ids"] = [ids[0], *ids[:-1]]
        return first, template, shifted

    holder = {}
    bad = _with(ds, lambda a: holder.setdefault("rows", corrupt(a)))
    first, template, shifted = holder["rows"]
    # the tiny random model's log-probs hardly move with the prompt (0.03 for the template here; SmolLM2-135M: 0.8)
    row = _fit(team, bad, tmp_path / "drop", logprob_tolerance=1e-3)
    assert row["data_check_failed"] == 3, row["data_problems"]
    assert row["data_checks"] == {GRAMMAR_REJECTED: 1, LOGPROB_MISMATCH: 2}
    named = "\n".join(row["data_problems"])
    a = bad.actions
    for i in (first, template, shifted):
        assert f"episode {a.at[i, 'episode_id']} action {a.at[i, 'order']} (extractor)" in named
    assert "json_schema=Extract" in named and "rejects completion token" in named
    assert "first at token 0" in named  # the changed prompt: from the first completion token on
    assert row["agents"]["extractor"]["steps"] > 0  # the other 9 actions still train
    assert row["agents"]["extractor"]["clip_fraction"] == 0.0

    with pytest.raises(TrainingDataError, match="on_data_mismatch: error"):
        _fit(team, bad, tmp_path / "error", on_data_mismatch="error", logprob_tolerance=1e-3)


def test_verification_can_be_turned_off(served, tmp_path):
    team, ds = served

    def shift(actions):
        free = _free(actions)[0]
        ids = list(actions.at[free, "completion_token_ids"])
        actions.at[free, "completion_token_ids"] = [ids[0], *ids[:-1]]

    row = _fit(team, _with(ds, shift), tmp_path, verify_logprobs="off")
    assert row["data_check_failed"] == 0


def test_an_iteration_with_nothing_to_train_stops_naming_why(served, tmp_path):
    team, ds = served
    trainer = MARFTTrainer(team, lambda ep: 0.0, MARFTConfig(plots=False), tmp_path / "unscored", progress=False)
    with pytest.raises(TrainingDataError, match="no scored episode: the reward scored none of the 4"):
        trainer.fit_offline(ds, action_rewards={})

    def corrupt_all(actions):
        for i in actions.index:
            ids = list(actions.at[i, "completion_token_ids"])
            actions.at[i, "completion_token_ids"] = [ids[0], *ids[:-1]] if len(ids) > 1 else ids
    trainer = MARFTTrainer(team, lambda ep: 0.0, MARFTConfig(plots=False), tmp_path / "bad", progress=False)
    with pytest.raises(TrainingDataError, match="failed the data checks"):
        trainer.fit_offline(_with(ds, corrupt_all), action_rewards=_rewards(ds))
