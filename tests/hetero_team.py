"""A three-agent graph for heterogeneous-team tests: a planner (any chat model: the frozen agent), then a solver
and a checker (the trained workers, through one chat model routed per node)."""

from __future__ import annotations

from typing import TypedDict

from marft_lg.training.policy import adapter_parameters
from marft_lg.trajectories.scenarios import Scenario

TRAINED = ["solver", "checker"]


class State(TypedDict, total=False):
    question: str
    plan: str
    answer: str
    check: str


def build_graph(planner, worker):
    from langgraph.graph import END, START, StateGraph

    def plan(state: State) -> State:
        return {"plan": planner.invoke([("user", f"Plan how to solve: {state['question']}")]).content}

    def solve(state: State) -> State:
        return {"answer": worker.invoke([("system", "You solve problems."),
                                         ("user", f"{state['question']}\nPlan: {state['plan']}")]).content}

    def check(state: State) -> State:
        return {"check": worker.invoke([("system", "You check answers."),
                                        ("user", f"{state['question']}\nAnswer: {state['answer']}")]).content}

    g = StateGraph(State)
    for name, fn in (("planner", plan), ("solver", solve), ("checker", check)):
        g.add_node(name, fn)
    g.add_edge(START, "planner")
    g.add_edge("planner", "solver")
    g.add_edge("solver", "checker")
    g.add_edge("checker", END)
    return g.compile()


SCENARIOS = [Scenario(f"s{i}", {"question": f"What is {i} + {i + 2}?"}) for i in range(2)]


def episode_reward(episode) -> float:
    return float(len(episode.actions[-1].get("completion") or "") % 3)


def adapter_weights(team, role):
    base = team.team_of(role)
    return [p.detach().clone() for p in adapter_parameters(base.model, base.adapter_name(role))]


