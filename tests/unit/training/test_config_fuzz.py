"""Property tests (hypothesis): train.yaml and MARFTConfig loaders, given random YAML documents, random values
for known keys, damaged YAML text or random bytes, either load or raise the loaders' own `ConfigError` whose
message names the file. Never any other exception (which the CLI would show as a traceback)."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from marft_lg._config import ConfigError
from marft_lg.training.commands import TrainFile
from marft_lg.training.config import MARFTConfig

FUZZ = settings(max_examples=250, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# text without ':' so no value can name an importable `module:attr`
_TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_characters=":", exclude_categories=("Cs",)),
                max_size=10)
_SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-10**20, 10**20), st.floats(), _TEXT,
                    st.sampled_from(["offline", "online", "live", "5e-5", "-1", "nan", "reasoner", "v1", "1e400"]))
_VALUE = st.recursive(_SCALAR, lambda c: st.lists(c, max_size=3) | st.dictionaries(_TEXT | _SCALAR, c, max_size=3),
                      max_leaves=8)
_MARFT_KEYS = [f.name for f in dataclasses.fields(MARFTConfig)]
_TRAIN_KEYS = [f.name for f in dataclasses.fields(TrainFile) if f.init]
_REWARD = st.fixed_dictionaries({"weights": st.dictionaries(
    st.sampled_from(["step_count", "format_compliance", "task_completion", "cost", "tool_error_rate"]) | _TEXT,
    _SCALAR, min_size=1, max_size=3)}, optional={"credit": _SCALAR, "answer_agents": _VALUE,
                                                  "components": st.dictionaries(_TEXT, _VALUE, max_size=2)})
_VALID = {"model": "m", "agents": ["reasoner", "actor"], "reward": {"weights": {"step_count": -0.1}},
          "phases": ["offline"], "data": "data", "marft": {"learning_rate": 1e-4}}


def _document():
    known = st.dictionaries(st.sampled_from(_TRAIN_KEYS), _VALUE, max_size=6)
    marft = st.dictionaries(st.sampled_from(_MARFT_KEYS) | _TEXT, _VALUE, max_size=4)
    one_bad = st.tuples(st.sampled_from(_TRAIN_KEYS), _VALUE).map(lambda kv: {**_VALID, kv[0]: kv[1]})
    bad_marft = st.tuples(st.sampled_from(_MARFT_KEYS), _VALUE).map(lambda kv: {**_VALID, "marft": {kv[0]: kv[1]}})
    bad_reward = _REWARD.map(lambda r: {**_VALID, "reward": r})
    plausible = st.dictionaries(st.sampled_from(["learning_rate", "clip_low", "gamma", "ppo_epochs", "kl_cut", "seed",
                                                 "use_critic", "group_size"]),
                                st.floats(0, 1) | st.integers(0, 4) | st.booleans() | st.none(), max_size=4)
    return st.one_of(known, marft.map(lambda m: {**_VALID, "marft": m}), one_bad, bad_marft, bad_reward, _VALUE,
                     plausible.map(lambda m: {**_VALID, "marft": m}))


def _check(path: Path, load) -> None:
    try:
        load()
    except ConfigError as exc:
        assert str(path) in str(exc), f"the error does not name {path}: {exc}"


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
@given(st.dictionaries(st.sampled_from(_MARFT_KEYS) | _TEXT, _VALUE, max_size=6), st.booleans())
def test_marft_config_values_load_or_raise_config_error(values, in_section):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "marft.yaml"
        path.write_text(yaml.safe_dump({"marft": values} if in_section else values, allow_unicode=True))
        _check(path, lambda: MARFTConfig.from_yaml(path, section="marft" if in_section else None))


_VALID_TEXT = yaml.safe_dump(_VALID, sort_keys=False)


@FUZZ
@given(st.lists(st.tuples(st.integers(0, len(_VALID_TEXT)), st.integers(0, 3), _TEXT | st.sampled_from(
    ["[", "]", "{", "}", ":", "- ", "\n  ", "&a ", "*a", "!!python/object:os.system ''", "!!int x", "'", '"', "\t"])),
    min_size=1, max_size=4))
def test_damaged_train_yaml_text_loads_or_raises_config_error(edits):
    text = _VALID_TEXT
    for pos, cut, insert in edits:
        pos = min(pos, len(text))
        text = text[:pos] + insert + text[pos + cut:]
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "data").mkdir()
        path = Path(tmp) / "train.yaml"
        path.write_text(text)
        _check(path, lambda: _load_train(path))


@settings(max_examples=60, deadline=None, database=None)
@given(st.binary(max_size=300))
def test_random_bytes_as_train_yaml_raise_config_error(data):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "train.yaml"
        path.write_bytes(data)
        _check(path, lambda: _load_train(path))
