"""What the config-loader fuzz tests share: settings, random YAML values, text damage, and the one check."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from marft_lg._config import ConfigError

FUZZ = settings(max_examples=250, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
BYTES = settings(max_examples=60, deadline=None, database=None)
# text without ':' so no value can name an importable `module:attr`
TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_characters=":", exclude_categories=("Cs",)), max_size=10)
YAML_DAMAGE = ["[", "]", "{", "}", ":", "- ", "\n  ", "&a ", "*a", "!!python/object/apply:os.system ['x']",
               "!!python/object:os.system ''", "!!python/name:os.system", "!!int x", "!!float x", "'", '"', "\t", "<<: *a\n"]


def values(words: Sequence[str]) -> tuple[st.SearchStrategy, st.SearchStrategy]:
    """(scalars, nested values) for a config: random scalars plus `words` the config's own values use."""
    scalar = st.one_of(st.none(), st.booleans(), st.integers(-10**20, 10**20), st.floats(), TEXT, st.sampled_from(words))
    nested = st.recursive(scalar, lambda c: st.lists(c, max_size=3) | st.dictionaries(TEXT | scalar, c, max_size=3),
                          max_leaves=8)
    return scalar, nested


def edits(length: int) -> st.SearchStrategy:
    """Up to 4 (position, characters cut, text inserted) edits of a valid file's `length` characters."""
    return st.lists(st.tuples(st.integers(0, length), st.integers(0, 3), TEXT | st.sampled_from(YAML_DAMAGE)),
                    min_size=1, max_size=4)


def damage(text: str, changes: Sequence[tuple[int, int, str]]) -> str:
    for pos, cut, insert in changes:
        pos = min(pos, len(text))
        text = text[:pos] + insert + text[pos + cut:]
    return text


def check_loads_or_names(path: Path, load: Callable[[], object]) -> None:
    """`load()` gives a config, or raises the loaders' own `ConfigError` naming `path` (never anything else)."""
    try:
        load()
    except ConfigError as exc:
        assert str(path) in str(exc), f"the error does not name {path}: {exc}"
