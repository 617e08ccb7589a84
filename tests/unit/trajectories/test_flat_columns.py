"""TokenColumn decodes a batch of encoded token-id / log-prob attributes exactly as `decode_ints` /
`decode_floats` would one at a time, and shares the int objects of token ids."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from marft_lg.tracing.attributes import decode_floats, decode_ints, encode_floats, encode_ints
from marft_lg.trajectories.flat_columns import INT_CACHE_SIZE, TokenColumn


def _one_by_one(values, fn):
    out = []
    for v in values:
        try:
            out.append(None if v is None else fn(v))
        except (ValueError, TypeError):
            out.append(None)
    return out


INTS = [encode_ints([1, 2, 40000]), None, "[5, 6]", [7, 8], encode_ints([]), "i32:AAA", "not json", 12,
        encode_ints([INT_CACHE_SIZE + 5, -3]), encode_ints([49151]), "i32:AAAA AAAA", "i32:AAAAAQ==", "i32:AAAAAA=="]
FLOATS = [encode_floats([-0.5, -0.125]), None, "[0.25]", [1.5], "f32:@@", encode_floats([-1e-3])]


def test_int_column_matches_decode_ints_row_by_row():
    col = TokenColumn.decode(INTS, "int")
    assert col.to_lists() == _one_by_one(INTS, decode_ints)
    assert len(col) == len(INTS)


def test_float_column_matches_decode_floats_row_by_row():
    col = TokenColumn.decode(FLOATS, "float")
    assert col.to_lists() == _one_by_one(FLOATS, decode_floats)


def test_token_ids_share_int_objects_across_rows():
    a, b = TokenColumn.decode([encode_ints([30000, 31000]), encode_ints([31000, 30000])], "int").to_lists()
    assert a[0] is b[1] and a[1] is b[0]


def test_ids_outside_the_shared_range_are_exact_in_a_column_that_also_has_shared_ones():
    big = [INT_CACHE_SIZE, INT_CACHE_SIZE + 1, 2**40, -(2**40), -1, 0]
    rows = TokenColumn.decode([[*big, 30000], encode_ints([30000])], "int").to_lists()
    assert rows == [[*big, 30000], [30000]]
    assert all(type(v) is int for v in rows[0])


def test_random_columns_match_row_by_row():
    rng = np.random.default_rng(7)
    for kind, encode, decode in (("int", encode_ints, decode_ints), ("float", encode_floats, decode_floats)):
        values = []
        for _ in range(300):
            n = int(rng.integers(0, 50))
            if rng.random() < 0.1:
                values.append(None)
            elif kind == "int":
                values.append(encode(rng.integers(0, 60000, n).tolist()))
            else:
                values.append(encode((-rng.random(n)).tolist()))
        assert TokenColumn.decode(values, kind).to_lists() == _one_by_one(values, decode)


@pytest.mark.parametrize(("values", "kind", "type_"), [(INTS, "int", pa.list_(pa.int64())),
                                                      (FLOATS, "float", pa.list_(pa.float64()))])
def test_arrow_column_equals_the_lists(values, kind, type_):
    col = TokenColumn.decode(values, kind)
    arrow = col.to_arrow(type_)
    assert arrow.type == type_
    assert arrow.to_pylist() == col.to_lists()


def test_empty_and_all_missing_columns():
    assert TokenColumn.decode([], "int").to_lists() == []
    col = TokenColumn.decode([None, None], "float")
    assert col.to_lists() == [None, None] and col.to_arrow().null_count == 2
    assert np.array_equal(col.offsets, [0, 0, 0])


