import json

import pytest
from eval_factory import make_dataset

from marft_lg.trajectories.scenario_sets import scenarios_from_dataset


def _ds():
    eps = []
    for i, status in enumerate(["ok", "ok", "ok", "error", "ok", "ok"]):
        eps.append({"episode_id": f"e{i}", "status": status, "actions": [{"agent": "w", "completion": "x"}]})
    ds = make_dataset(eps)
    outcomes = [{"question": q, "answer": f"ans {q}"} for q in ["a?", "b?", "a?", "c?", "d?", "e?"]]
    outcomes[4] = None  # capture was off
    ds.episodes["outcome"] = [None if o is None else json.dumps(o) for o in outcomes]
    ds.episodes["feedback"] = [{"thumbs": f} if f is not None else {} for f in [1, -1, 1, 1, None, 1]]
    return ds


def test_distinct_successful_inputs_become_scenarios():
    s = scenarios_from_dataset(_ds(), ["question"], reference_key="answer")
    assert sorted(x.inputs["question"] for x in s) == ["a?", "b?", "e?"]
    a = next(x for x in s if x.inputs["question"] == "a?")
    assert a.reference == "ans a?" and a.split == "eval" and a.meta["source_episode"] == "e0"
    assert a.scenario_id.startswith("trace-")


def test_feedback_filter_sampling_and_errors():
    s = scenarios_from_dataset(_ds(), ["question"], require_feedback="thumbs")
    assert sorted(x.inputs["question"] for x in s) == ["a?", "e?"]
    one = scenarios_from_dataset(_ds(), ["question"], n=2, seed=4)
    assert len(one) == 2
    assert [x.scenario_id for x in one] == [x.scenario_id for x in scenarios_from_dataset(_ds(), ["question"], n=2, seed=4)]
    assert len(scenarios_from_dataset(_ds(), ["nope"])) == 0
    with pytest.raises(ValueError, match="input_keys"):
        scenarios_from_dataset(_ds(), [])


def test_a_hash_split_is_stable_as_traffic_grows_and_chat_inputs_are_the_opening_turn():
    def ds_of(questions):
        eps = [{"episode_id": f"e{i}", "status": "ok", "actions": [{"agent": "w", "completion": "x"}]}
               for i in range(len(questions))]
        ds = make_dataset(eps)
        ds.episodes["outcome"] = [json.dumps({"question": q}) for q in questions]
        return ds

    small = scenarios_from_dataset(ds_of([f"q{i}" for i in range(40)]), ["question"], heldout=0.25)
    big = scenarios_from_dataset(ds_of([f"q{i}" for i in range(200)]), ["question"], heldout=0.25)
    side = {s.scenario_id: s.split for s in big}
    assert all(side[s.scenario_id] == s.split for s in small)  # an input keeps its side as traffic grows
    share = sum(s.split == "heldout" for s in big) / len(big)
    assert 0.15 < share < 0.35 and {s.split for s in big} == {"train", "heldout"}
    with pytest.raises(ValueError, match="heldout"):
        scenarios_from_dataset(ds_of(["a"]), ["question"], heldout=1.0)

    chat = make_dataset([{"episode_id": f"c{i}", "status": "ok", "actions": [{"agent": "w", "completion": "x"}]}
                         for i in range(2)])
    opening = [{"type": "system", "content": "be brief"}, {"type": "human", "content": "hi?"}]
    chat.episodes["outcome"] = [json.dumps({"messages": [*opening, {"type": "ai", "content": a}]}) for a in "AB"]
    [one] = scenarios_from_dataset(chat, ["messages"])  # two answers to one question: one scenario
    assert one.inputs == {"messages": opening}


def test_production_episodes_are_grouped_by_their_input():
    from marft_lg.trajectories.scenario_sets import label_with_inputs

    eps = [{"episode_id": f"e{i}", "status": "ok", "actions": [{"agent": "w", "completion": "x"}]} for i in range(4)]
    ds = make_dataset(eps)
    ds.episodes["outcome"] = [json.dumps({"question": q, "answer": "x"}) for q in ("a?", "b?", "a?", "c?")]
    ds.episodes["scenario_id"] = [None, None, None, "given"]
    labelled, n = label_with_inputs(ds, ["question"])
    assert n == 3
    sids = dict(zip(labelled.episodes["episode_id"], labelled.episodes["scenario_id"], strict=True))
    assert sids["e0"] == sids["e2"] != sids["e1"] and sids["e3"] == "given"
    [a] = [s for s in scenarios_from_dataset(ds, ["question"]) if s.inputs == {"question": "a?"}]
    assert sids["e0"] == a.scenario_id  # the id of the scenario the question became
    assert len(labelled.scenario_groups()) == 3 and ds.episodes["scenario_id"].isna().sum() == 3  # a copy
