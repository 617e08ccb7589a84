"""Property tests (hypothesis): `RetrainJob.from_yaml` (job.yaml, with inline reward / trainer / gate) and
`PromotionGate.from_yaml`, given random documents, random values for known keys, damaged text and random bytes,
load or raise `ConfigError` naming the file; never any other exception."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import yaml
from hypothesis import given
from hypothesis import strategies as st

from marft_lg.evaluation.gate import PromotionGate, SafetyCheck
from marft_lg.jobs.config import RetrainJob
from tests.unit.config_fuzz import BYTES, FUZZ, TEXT, check_loads_or_names, damage, edits, values

_SCALAR, _VALUE = values(["UTC", "0 2 * * *", "2026-01-01T00:00:00Z", "heldout", "-1", "nan", "reward",
                                     "format", "planner"])
_JOB_KEYS = [f.name for f in dataclasses.fields(RetrainJob) if f.init]
_GATE_KEYS = [f.name for f in dataclasses.fields(PromotionGate)]
_SAFETY_KEYS = [f.name for f in dataclasses.fields(SafetyCheck)]
_GATE_VALUE = st.one_of(_VALUE, st.floats(-1, 2), st.integers(0, 10),
                        st.dictionaries(st.sampled_from(["*", "reward", "format_compliance", "tool_accuracy", "vibes"]),
                                        st.floats(-1, 1) | _SCALAR, max_size=3),
                        st.lists(st.dictionaries(st.sampled_from(_SAFETY_KEYS) | TEXT, _SCALAR, max_size=5), max_size=2))
_GATE = st.dictionaries(st.sampled_from(_GATE_KEYS) | TEXT, _GATE_VALUE, max_size=5)


def _job_document():
    known = st.dictionaries(st.sampled_from(_JOB_KEYS), _VALUE, max_size=6)
    one = st.tuples(st.sampled_from(_JOB_KEYS), _VALUE).map(lambda kv: {"name": "n", kv[0]: kv[1]})
    inline = st.fixed_dictionaries({}, optional={
        "trainer": st.dictionaries(st.sampled_from(["learning_rate", "clip_low", "ppo_epochs", "gamma"]) | TEXT,
                                   _VALUE, max_size=3),
        "gate": _GATE,
        "reward": st.fixed_dictionaries({"weights": st.dictionaries(TEXT, _SCALAR, max_size=2)},
                                        optional={"credit": _SCALAR})})
    return st.one_of(known, one, inline, _VALUE)


_check = check_loads_or_names


@FUZZ
@given(_job_document())
def test_job_yaml_documents_load_or_raise_config_error(doc):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "job.yaml"
        path.write_text(yaml.safe_dump(doc, allow_unicode=True))
        _check(path, lambda: RetrainJob.from_yaml(path))


@FUZZ
@given(_GATE, st.booleans())
def test_gate_yaml_documents_load_or_raise_config_error(doc, nested):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gate.yaml"
        path.write_text(yaml.safe_dump({"gate": doc} if nested else doc, allow_unicode=True))
        _check(path, lambda: PromotionGate.from_yaml(path))


_VALID_TEXT = yaml.safe_dump({"name": "nightly", "traces": ["traces"], "min_new_episodes": 5, "settle_s": 60,
                              "trainer": {"learning_rate": 1e-4}, "gate": {"min_pairs": 3, "safety": [
                                  {"name": "fmt", "component": "format", "min": 0.5}]},
                              "reward": {"weights": {"step_count": -0.1}}}, sort_keys=False)


@FUZZ
@given(edits(len(_VALID_TEXT)))
def test_damaged_job_and_gate_text_loads_or_raises_config_error(changes):
    text = damage(_VALID_TEXT, changes)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "job.yaml"
        path.write_text(text)
        _check(path, lambda: RetrainJob.from_yaml(path))
        _check(path, lambda: PromotionGate.from_yaml(path))


@BYTES
@given(st.binary(max_size=300))
def test_random_bytes_as_job_or_gate_yaml_raise_config_error(data):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "job.yaml"
        path.write_bytes(data)
        _check(path, lambda: RetrainJob.from_yaml(path))
        _check(path, lambda: PromotionGate.from_yaml(path))
