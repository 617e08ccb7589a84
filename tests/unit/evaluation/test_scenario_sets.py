import json

import pytest
from eval_factory import make_dataset

from marft_lg.evaluation.scenario_sets import scenarios_from_dataset


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
