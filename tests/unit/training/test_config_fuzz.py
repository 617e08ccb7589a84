"""Property tests (hypothesis): train.yaml and MARFTConfig loaders, given random YAML documents, random values
for known keys, damaged YAML text or random bytes, either load or raise the loaders' own `ConfigError` whose
message names the file. Never any other exception (which the CLI would show as a traceback)."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import yaml
from hypothesis import given
from hypothesis import strategies as st

from marft_lg.training.commands import TrainFile
from marft_lg.training.config import MARFTConfig
from tests.unit.config_fuzz import BYTES, FUZZ, TEXT, check_loads_or_names, damage, edits, values

_SCALAR, _VALUE = values(["offline", "online", "live", "5e-5", "-1", "nan", "reasoner", "v1", "1e400"])
_MARFT_KEYS = [f.name for f in dataclasses.fields(MARFTConfig)]
_TRAIN_KEYS = [f.name for f in dataclasses.fields(TrainFile) if f.init]
_REWARD = st.fixed_dictionaries({"weights": st.dictionaries(
    st.sampled_from(["step_count", "format_compliance", "task_completion", "cost", "tool_error_rate"]) | TEXT,
    _SCALAR, min_size=1, max_size=3)}, optional={"credit": _SCALAR, "answer_agents": _VALUE,
                                                  "components": st.dictionaries(TEXT, _VALUE, max_size=2)})
_VALID = {"model": "m", "agents": ["reasoner", "actor"], "reward": {"weights": {"step_count": -0.1}},
          "phases": ["offline"], "data": "data", "marft": {"learning_rate": 1e-4}}


def _document():
    known = st.dictionaries(st.sampled_from(_TRAIN_KEYS), _VALUE, max_size=6)
    marft = st.dictionaries(st.sampled_from(_MARFT_KEYS) | TEXT, _VALUE, max_size=4)
    one_bad = st.tuples(st.sampled_from(_TRAIN_KEYS), _VALUE).map(lambda kv: {**_VALID, kv[0]: kv[1]})
    bad_marft = st.tuples(st.sampled_from(_MARFT_KEYS), _VALUE).map(lambda kv: {**_VALID, "marft": {kv[0]: kv[1]}})
    bad_reward = _REWARD.map(lambda r: {**_VALID, "reward": r})
    plausible = st.dictionaries(st.sampled_from(["learning_rate", "clip_low", "gamma", "ppo_epochs", "kl_cut", "seed",
                                                 "use_critic", "group_size"]),
                                st.floats(0, 1) | st.integers(0, 4) | st.booleans() | st.none(), max_size=4)
    return st.one_of(known, marft.map(lambda m: {**_VALID, "marft": m}), one_bad, bad_marft, bad_reward, _VALUE,
                     plausible.map(lambda m: {**_VALID, "marft": m}))


_check = check_loads_or_names


def _load_train(path: Path) -> None:
    spec = TrainFile.load(path)
    spec.check_inputs()
    spec.config()
    spec.load_reward()


@FUZZ
@given(_document())
def test_train_yaml_documents_load_or_raise_config_error(doc):
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "data").mkdir()
        path = Path(tmp) / "train.yaml"
        path.write_text(yaml.safe_dump(doc, allow_unicode=True))
        _check(path, lambda: _load_train(path))


@FUZZ
@given(st.dictionaries(st.sampled_from(_MARFT_KEYS) | TEXT, _VALUE, max_size=6), st.booleans())
def test_marft_config_values_load_or_raise_config_error(values, in_section):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "marft.yaml"
        path.write_text(yaml.safe_dump({"marft": values} if in_section else values, allow_unicode=True))
        _check(path, lambda: MARFTConfig.from_yaml(path, section="marft" if in_section else None))


_VALID_TEXT = yaml.safe_dump(_VALID, sort_keys=False)


@FUZZ
@given(edits(len(_VALID_TEXT)))
def test_damaged_train_yaml_text_loads_or_raises_config_error(changes):
    text = damage(_VALID_TEXT, changes)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "data").mkdir()
        path = Path(tmp) / "train.yaml"
        path.write_text(text)
        _check(path, lambda: _load_train(path))


@BYTES
@given(st.binary(max_size=300))
def test_random_bytes_as_train_yaml_raise_config_error(data):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "train.yaml"
        path.write_bytes(data)
        _check(path, lambda: _load_train(path))
