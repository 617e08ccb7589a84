"""Property tests (hypothesis): `CompositeReward.from_yaml`, given random reward YAML (known and unknown
components, random options, damaged text, random bytes), builds a reward or raises `ConfigError` naming the
file; never any other exception."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import yaml
from hypothesis import given
from hypothesis import strategies as st

from marft_lg.rewards.composite import CompositeReward
from marft_lg.rewards.registry import get_component_class, known_components
from tests.unit.config_fuzz import BYTES, FUZZ, TEXT, check_loads_or_names, damage, edits, values

_SCALAR, _VALUE = values(["terminal", "shaped", "exact", "symbolic", "actor", "1e-3", "veto", "[", "("])
_NAMES = known_components()
_OPTIONS = {n: [f.name for f in dataclasses.fields(get_component_class(n)) if f.init and f.name != "judge"]
            for n in _NAMES if dataclasses.is_dataclass(get_component_class(n))}


@st.composite
def _config(draw):
    names = draw(st.lists(st.one_of(st.sampled_from(_NAMES), st.sampled_from(_NAMES), TEXT), max_size=3, unique=True))
    weights = {n: draw(st.one_of(st.floats(-2, 2), st.integers(-2, 2), _SCALAR)) for n in names}
    components = {}
    for n in names:
        if draw(st.booleans()):
            keys = [*_OPTIONS.get(n, []), "range", "type"]
            components[n] = draw(st.dictionaries(st.sampled_from(keys) | TEXT, _VALUE, max_size=3) | _SCALAR)
    out = {"weights": weights, "components": components}
    if draw(st.booleans()):
        out["credit"] = draw(st.sampled_from(["terminal", "shaped"]) | _SCALAR)
    if draw(st.booleans()):
        out["answer_agents"] = draw(st.one_of(st.lists(TEXT, max_size=2), _VALUE))
    if draw(st.sampled_from([False, False, False, False, True])):
        out[draw(TEXT)] = draw(_VALUE)
    return draw(st.sampled_from([out] * 6 + [weights, draw(_VALUE)]))


def _check(path: Path) -> None:
    check_loads_or_names(path, lambda: CompositeReward.from_yaml(path))


@FUZZ
@given(_config())
def test_reward_yaml_documents_build_or_raise_config_error(doc):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "reward.yaml"
        path.write_text(yaml.safe_dump(doc, allow_unicode=True))
        _check(path)


@st.composite
def _options(draw):
    name = draw(st.sampled_from(sorted(_OPTIONS)))
    keys = st.sampled_from([*_OPTIONS[name], "range"])
    return name, draw(st.dictionaries(keys, _VALUE | st.lists(st.floats(-5, 5), min_size=2, max_size=2), max_size=3))


@FUZZ
@given(st.lists(_options(), min_size=1, max_size=3))
def test_built_in_components_with_random_options_build_or_raise_config_error(items):
    doc = {"weights": {n: 1.0 for n, _ in items}, "components": dict(items), "credit": "shaped"}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "reward.yaml"
        path.write_text(yaml.safe_dump(doc, allow_unicode=True))
        _check(path)


_VALID_TEXT = yaml.safe_dump({"credit": "shaped", "answer_agents": ["actor"],
                              "weights": {"task_completion": 1.0, "step_count": -0.1},
                              "components": {"task_completion": {"match": "numeric"}}}, sort_keys=False)


@FUZZ
@given(edits(len(_VALID_TEXT)))
def test_damaged_reward_yaml_text_builds_or_raises_config_error(changes):
    text = damage(_VALID_TEXT, changes)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "reward.yaml"
        path.write_text(text)
        _check(path)


@BYTES
@given(st.binary(max_size=300))
def test_random_bytes_as_reward_yaml_raise_config_error(data):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "reward.yaml"
        path.write_bytes(data)
        _check(path)
