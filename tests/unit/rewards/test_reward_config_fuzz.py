"""Property tests (hypothesis): `CompositeReward.from_yaml`, given random reward YAML (known and unknown
components, random options, damaged text, random bytes), builds a reward or raises `ConfigError` naming the
file; never any other exception."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from marft_lg._config import ConfigError
from marft_lg.rewards.composite import CompositeReward
from marft_lg.rewards.registry import get_component_class, known_components

FUZZ = settings(max_examples=250, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# text without ':' so no value can name an importable `module:attr`
_TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_characters=":", exclude_categories=("Cs",)),
                max_size=10)
_SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-10**20, 10**20), st.floats(), _TEXT,
                    st.sampled_from(["terminal", "shaped", "exact", "symbolic", "actor", "1e-3", "veto", "[", "("]))
_VALUE = st.recursive(_SCALAR, lambda c: st.lists(c, max_size=3) | st.dictionaries(_TEXT | _SCALAR, c, max_size=3),
                      max_leaves=8)
_NAMES = known_components()
_OPTIONS = {n: [f.name for f in dataclasses.fields(get_component_class(n)) if f.init and f.name != "judge"]
            for n in _NAMES if dataclasses.is_dataclass(get_component_class(n))}


@st.composite
def _config(draw):
    names = draw(st.lists(st.one_of(st.sampled_from(_NAMES), st.sampled_from(_NAMES), _TEXT), max_size=3, unique=True))
    weights = {n: draw(st.one_of(st.floats(-2, 2), st.integers(-2, 2), _SCALAR)) for n in names}
    components = {}
    for n in names:
        if draw(st.booleans()):
            keys = [*_OPTIONS.get(n, []), "range", "type"]
            components[n] = draw(st.dictionaries(st.sampled_from(keys) | _TEXT, _VALUE, max_size=3) | _SCALAR)
    out = {"weights": weights, "components": components}
    if draw(st.booleans()):
        out["credit"] = draw(st.sampled_from(["terminal", "shaped"]) | _SCALAR)
    if draw(st.booleans()):
        out["answer_agents"] = draw(st.one_of(st.lists(_TEXT, max_size=2), _VALUE))
    if draw(st.sampled_from([False, False, False, False, True])):
        out[draw(_TEXT)] = draw(_VALUE)
    return draw(st.sampled_from([out] * 6 + [weights, draw(_VALUE)]))


def _check(path: Path) -> None:
    try:
        CompositeReward.from_yaml(path)
    except ConfigError as exc:
        assert str(path) in str(exc), f"the error does not name {path}: {exc}"


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
@given(st.lists(st.tuples(st.integers(0, len(_VALID_TEXT)), st.integers(0, 3), _TEXT | st.sampled_from(
    ["[", "]", "{", "}", ":", "- ", "\n  ", "&a ", "*a", "!!python/name:os.system", "!!float x", "'", "\t"])),
    min_size=1, max_size=4))
def test_damaged_reward_yaml_text_builds_or_raises_config_error(edits):
    text = _VALID_TEXT
    for pos, cut, insert in edits:
        pos = min(pos, len(text))
        text = text[:pos] + insert + text[pos + cut:]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "reward.yaml"
        path.write_text(text)
        _check(path)


@settings(max_examples=60, deadline=None, database=None)
@given(st.binary(max_size=300))
def test_random_bytes_as_reward_yaml_raise_config_error(data):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "reward.yaml"
        path.write_bytes(data)
        _check(path)
