"""The dependency function in C (`_assembly_c.dependencies`) gives every action the `depends_on` the Python
version gives, on random episodes (node runs, LangGraph steps, completions quoted in later prompts), and leaves
inputs of other types to the Python version untouched."""

from __future__ import annotations

import copy
import os
import random

import pytest

from marft_lg.trajectories import assembly
from marft_lg.trajectories.assembly import _COMPLETION, _DEPENDS_ON, _MESSAGES, ACTION_FIELDS

pytestmark = pytest.mark.skipif(os.environ.get("MARFT_MINING_C_READER") == "0", reason="C switched off")
C = assembly._c_dependencies


def test_the_c_version_is_built():
    assert C is not None, "marft_lg/trajectories/_assembly_c.c was not compiled: reinstall with a C compiler"


def _python(tasks, steps, actions):
    saved = assembly._c_dependencies
    assembly._c_dependencies = None
    try:
        assembly._dependencies(tasks, steps, actions)
    finally:
        assembly._c_dependencies = saved


def _row(messages, completion):
    row = [None] * len(ACTION_FIELDS)
    row[_MESSAGES], row[_COMPLETION], row[_DEPENDS_ON] = messages, completion, []
    return row


def _episode(rng: random.Random):
    n = rng.randrange(0, 14)
    words = ["refund", "policy", "30 days", "warranty", "é日本", "\u2003", " ", "\n", "TOPICS:", "ok"]
    completions = ["".join(rng.choice(words) for _ in range(rng.randrange(0, 6))) for _ in range(n)]
    tasks = [rng.choice(["t1", "t2", "t3", "t4"]) for _ in range(n)]
    steps = [rng.choice([None, 1, 2, 3, 5, -1, 2**40]) for _ in range(n)]
    actions = []
    for i in range(n):
        messages = []
        for _ in range(rng.randrange(0, 4)):
            quoted = completions[rng.randrange(i)] if i and rng.random() < 0.6 else ""
            content = rng.choice([quoted, f"Plan:\n{quoted} more", None, "", 7, "x"])
            messages.append({"role": "user", "content": content} if rng.random() < 0.9 else {"role": "user"})
        actions.append(_row(messages, rng.choice([completions[i], completions[i], None, ""])))
    return tasks, steps, actions


def test_c_dependencies_equal_python_on_random_episodes():
    rng = random.Random(13)
    with_edges = 0
    for _ in range(3000):
        tasks, steps, actions = _episode(rng)
        expected = copy.deepcopy(actions)
        _python(tasks, steps, expected)
        assert C(tasks, steps, actions, _MESSAGES, _COMPLETION, _DEPENDS_ON, assembly.MIN_QUOTED_COMPLETION_CHARS) is True
        assert [a[_DEPENDS_ON] for a in actions] == [a[_DEPENDS_ON] for a in expected], (tasks, steps)
        with_edges += any(a[_DEPENDS_ON] for a in actions)
    assert with_edges > 1500


@pytest.mark.parametrize("change", ["step_float", "step_bool", "message_not_dict", "completion_not_str", "row_tuple",
                                    "huge_step"])
def test_c_dependencies_leave_other_types_to_python(change):
    tasks, steps = ["t1", "t1", "t2"], [1, 2, 2]
    actions = [_row([{"content": "a"}], "the first answer"), _row([{"content": "the first answer"}], "second one"),
               _row([{"content": "x"}], "")]
    if change == "step_float":
        steps[1] = 2.0
    elif change == "step_bool":
        steps[0] = True
    elif change == "message_not_dict":
        actions[1][_MESSAGES] = [("content", "the first answer")]
    elif change == "completion_not_str":
        actions[0][_COMPLETION] = 5
    elif change == "row_tuple":
        actions[2] = tuple(actions[2])
    elif change == "huge_step":
        steps[2] = 2**70
    before = copy.deepcopy(actions)
    assert C(tasks, steps, actions, _MESSAGES, _COMPLETION, _DEPENDS_ON, 8) is NotImplemented
    assert actions == before


def test_mined_tables_are_the_same_with_and_without_the_c_dependencies(tmp_path, monkeypatch):
    from trajectory_spans import line, own_episode, write

    from marft_lg.trajectories.mining import mine

    path = write(tmp_path / "t.jsonl", [line(own_episode(e, f"e{e}", base=10 * e, tool_error=e % 3 == 0))
                                        for e in range(1, 25)])
    with_c = mine(path, workers=1)
    monkeypatch.setattr(assembly, "_c_dependencies", None)
    without = mine(path, workers=1)
    assert with_c.actions["depends_on"].tolist() == without.actions["depends_on"].tolist()
    assert any(with_c.actions["depends_on"].tolist())
