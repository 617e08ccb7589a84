"""Frozen agents: nodes answered by a chat model marft_lg does not serve or train (a hosted API through
`ChatOpenAI`, or any LangChain chat model) are traced and mined as part of the environment. Their actions are in
the episode (agent = the node's role, else the node's name; the external model's name; no token ids, no
log-probs), in their successors' `depends_on` and in their successors' recorded prompts; the trained roles'
actions beside them keep their token ids and log-probs."""

from __future__ import annotations

import itertools
from typing import TypedDict

import pytest
from langchain_core.messages import AIMessage

from examples.mixed_team.external import ExternalEndpoint
from marft_lg.graph.chat_model import TeamChatModel
from marft_lg.graph.wrap import wrap
from marft_lg.serving.team import Team
from marft_lg.trajectories.mining import mine

PLAN = "Plan: add the two numbers carefully, then state the sum."
TRAINED = ("solver", "checker")


class State(TypedDict, total=False):
    question: str
    plan: str
    answer: str
    check: str


def build_graph(planner, worker, names=("planner", "solver", "checker")):
    """planner (the frozen model) -> solver -> checker; each prompt quotes the earlier nodes' outputs."""
    from langgraph.graph import END, START, StateGraph

    def plan(state: State) -> State:
        return {"plan": planner.invoke([("user", f"Make a plan for: {state['question']}")]).content}

    def solve(state: State) -> State:
        return {"answer": worker.invoke([("system", "You solve problems."),
                                         ("user", f"{state['question']}\n{state['plan']}")]).content}

    def check(state: State) -> State:
        return {"check": worker.invoke([("system", "You check answers."),
                                        ("user", f"{state['question']}\n{state['plan']}\nAnswer: {state['answer']}")]
                                       ).content}

    g = StateGraph(State)
    for name, fn in zip(names, (plan, solve, check), strict=True):
        g.add_node(name, fn)
    g.add_edge(START, names[0])
    g.add_edge(names[0], names[1])
    g.add_edge(names[1], names[2])
    g.add_edge(names[2], END)
    return g.compile()


@pytest.fixture(scope="module")
def team(tiny_model_dir):
    t = Team(tiny_model_dir, list(TRAINED), versions=None, seed=0)
    yield t
    t.close()


@pytest.fixture(scope="module")
def external():
    with ExternalEndpoint(reply=lambda messages: PLAN, model="external-planner") as server:
        yield server


def _chat_openai(external, **kwargs):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=external.base_url, api_key="x", model="external-planner", max_retries=0, **kwargs)


def _generic_fake(external):
    from langchain_core.language_models import GenericFakeChatModel

    return GenericFakeChatModel(messages=itertools.cycle([AIMessage(PLAN)]))


def _fake_list(external):
    from langchain_core.language_models import FakeListChatModel

    return FakeListChatModel(responses=[PLAN])


PLANNERS = {
    "chat_openai": (_chat_openai, "external-planner"),
    "chat_openai_streaming": (lambda ext: _chat_openai(ext, streaming=True), "external-planner"),
    "generic_fake": (_generic_fake, None),
    "fake_list": (_fake_list, None),
}


def _episodes(tmp_path, team, planner, *, n=2, names=("planner", "solver", "checker"), node_roles=None):
    worker = TeamChatModel(team=team, node_roles=node_roles, max_tokens=5, temperature=1.0)
    app = wrap(build_graph(planner, worker, names), team=team, trace_dir=tmp_path / "traces", node_roles=node_roles)
    try:
        for i in range(n):
            out = app.invoke({"question": f"What is {i} + {i + 3}?"}, episode_id=f"e{i}", seed=i)
            assert out["plan"] == PLAN
        assert app.flush()
    finally:
        app.close()
    ds = mine([tmp_path / "traces"])
    assert sorted(ds.episode_ids) == [f"e{i}" for i in range(n)]
    return ds


def _by_agent(ds, episode_id):
    acts = ds.actions[ds.actions["episode_id"] == episode_id].sort_values("order").to_dict("records")
    by_agent = {a["agent"]: a for a in acts}
    assert len(by_agent) == len(acts), [a["agent"] for a in acts]
    return by_agent


def _empty(value) -> bool:
    """None, NaN (pandas' missing scalar) or an empty sequence."""
    if value is None or isinstance(value, float):
        return value is None or value != value
    return len(value) == 0


@pytest.mark.parametrize("kind", list(PLANNERS))
def test_frozen_planner_is_traced_and_mined(kind, team, external, tmp_path):
    make, model_name = PLANNERS[kind]
    ds = _episodes(tmp_path, team, make(external))
    for eid in ds.episode_ids:
        acts = _by_agent(ds, eid)
        assert list(acts) == ["planner", *TRAINED]
        planner, solver, checker = acts["planner"], acts["solver"], acts["checker"]
        # the frozen action: in the episode, its text, the external model's name, no tokens or log-probs
        assert planner["order"] == 0 and planner["completion"] == PLAN
        assert "Make a plan for" in str(planner["messages"])
        if model_name is not None:
            assert planner["model"] == model_name
        else:
            assert planner["model"]  # whatever name the chat model gives itself
        for col in ("prompt_token_ids", "completion_token_ids", "completion_logprobs"):
            assert _empty(planner[col]), (col, planner[col])
        assert _empty(planner["adapter_version"])
        # its successors see it: in their prompts and in depends_on
        assert PLAN in str(solver["messages"]) and PLAN in str(checker["messages"])
        assert planner["order"] in list(solver["depends_on"])
        assert planner["order"] in list(checker["depends_on"])
        assert solver["order"] in list(checker["depends_on"])
        # the trained roles keep what training needs
        for act in (solver, checker):
            assert act["model"] != model_name
            assert len(act["completion_token_ids"]) > 0
            assert len(act["completion_logprobs"]) == len(act["completion_token_ids"])
            assert len(act["prompt_token_ids"]) > 0
    episode = ds.episodes.set_index("episode_id").loc["e0"]
    assert list(episode["agents"]) == ["planner", *TRAINED] and episode["status"] == "ok"
    if kind.startswith("chat_openai"):  # the endpoint saw one request per episode, with the planner's prompt
        assert any("Make a plan for" in str(r.get("messages")) for r in external.requests)


@pytest.mark.parametrize("frozen_role", [None, "planner"])
def test_frozen_node_named_otherwise_than_its_role(frozen_role, team, external, tmp_path):
    """node_roles maps the trained nodes (named otherwise than their roles), and the frozen node or not: a frozen
    node node_roles maps is an action of its role; one it leaves out is an action named after its node. Either way
    its successors depend on it."""
    roles = {"solve": "solver", "check": "checker", **({"plan_step": frozen_role} if frozen_role else {})}
    ds = _episodes(tmp_path, team, _chat_openai(external), names=("plan_step", "solve", "check"), node_roles=roles)
    agent = frozen_role or "plan_step"
    for eid in ds.episode_ids:
        acts = _by_agent(ds, eid)
        assert list(acts) == [agent, *TRAINED]
        frozen = acts[agent]
        assert frozen["completion"] == PLAN and frozen["model"] == "external-planner"
        assert _empty(frozen["completion_token_ids"]) and _empty(frozen["completion_logprobs"])
        assert frozen["order"] in list(acts["solver"]["depends_on"])
        assert len(acts["solver"]["completion_logprobs"]) > 0 and len(acts["checker"]["completion_logprobs"]) > 0


def test_external_endpoint_answers_like_a_hosted_api(external):
    """The stand-in endpoint: models list, usage filled, no log-probs; plain and streamed replies agree."""
    import httpx

    models = httpx.get(external.base_url + "/models").json()
    assert [m["id"] for m in models["data"]] == ["external-planner"]
    llm = _chat_openai(external)
    msg = llm.invoke("hello")
    assert msg.content == PLAN
    assert msg.usage_metadata["output_tokens"] > 0 and msg.usage_metadata["input_tokens"] > 0
    assert msg.response_metadata.get("logprobs") is None
    assert "".join(c.content for c in _chat_openai(external, streaming=True).stream("hello")) == PLAN
