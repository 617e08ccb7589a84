"""TokenColumn decodes a batch of encoded token-id / log-prob attributes exactly as `decode_ints` /
`decode_floats` would one at a time, and shares the int objects of token ids; its lists are the same with and
without the C conversion (`_columns_c.split_lists`)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from marft_lg.tracing.attributes import decode_floats, decode_ints, encode_floats, encode_ints
from marft_lg.trajectories import flat_columns
from marft_lg.trajectories.flat_columns import INT_CACHE_SIZE, NumberColumn, StringColumn, TokenColumn

C_BUILT = flat_columns._c_split_lists is not None


@pytest.fixture(params=["c", "python"])
def conversion(request, monkeypatch):
    """The test runs with the C conversions (when built) and with the numpy/Python ones."""
    if request.param == "c" and not C_BUILT:
        pytest.skip("the C extension _columns_c is not built")
    if request.param == "python":
        monkeypatch.setattr(flat_columns, "_c_split_lists", None)
        monkeypatch.setattr(flat_columns, "_c_utf8_column", None)
        monkeypatch.setattr(flat_columns, "_c_b64_column", None)
        monkeypatch.setattr(flat_columns, "_c_number_column", None)
    return request.param


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


def test_int_column_matches_decode_ints_row_by_row(conversion):
    col = TokenColumn.decode(INTS, "int")
    assert col.to_lists() == _one_by_one(INTS, decode_ints)
    assert len(col) == len(INTS)


def test_float_column_matches_decode_floats_row_by_row(conversion):
    col = TokenColumn.decode(FLOATS, "float")
    assert col.to_lists() == _one_by_one(FLOATS, decode_floats)


def test_token_ids_share_int_objects_across_rows(conversion):
    a, b = TokenColumn.decode([encode_ints([30000, 31000]), encode_ints([31000, 30000])], "int").to_lists()
    assert a[0] is b[1] and a[1] is b[0]


def test_ids_outside_the_shared_range_are_exact_in_a_column_that_also_has_shared_ones(conversion):
    big = [INT_CACHE_SIZE, INT_CACHE_SIZE + 1, 2**40, -(2**40), -1, 0]
    rows = TokenColumn.decode([[*big, 30000], encode_ints([30000])], "int").to_lists()
    assert rows == [[*big, 30000], [30000]]
    if conversion == "c":  # the numpy path shares only in columns without such ids
        assert rows[0][-1] is rows[1][0]
    assert all(type(v) is int for v in rows[0])


def test_random_columns_match_row_by_row(conversion):
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


needs_c = pytest.mark.skipif(not C_BUILT, reason="the C extension _columns_c is not built")


@needs_c
def test_c_conversion_refuses_inconsistent_arrays():
    from marft_lg.trajectories._columns_c import split_lists as split

    ok = np.ones(2, dtype=bool)
    with pytest.raises(ValueError, match="row 1 has offsets 2..9 outside 0..3"):
        split(np.arange(3, dtype=np.int64), np.array([0, 2, 9], dtype=np.int64), ok, None)
    with pytest.raises(ValueError, match="one more item"):
        split(np.arange(3, dtype=np.int64), np.array([0, 3], dtype=np.int64), ok, None)
    with pytest.raises(TypeError, match="int64 or float64"):
        split(np.arange(3, dtype=np.uint64), np.array([0, 1, 3], dtype=np.int64), ok, None)
    with pytest.raises(TypeError, match="4-byte|8-byte"):
        split(np.arange(3, dtype=np.int32), np.array([0, 1, 3], dtype=np.int64), ok, None)


@pytest.mark.parametrize(("values", "kind", "type_"), [(INTS, "int", pa.list_(pa.int64())),
                                                      (FLOATS, "float", pa.list_(pa.float64()))])
def test_arrow_column_equals_the_lists(conversion, values, kind, type_):
    col = TokenColumn.decode(values, kind)
    arrow = col.to_arrow(type_)
    assert arrow.type == type_
    assert arrow.to_pylist() == col.to_lists()


def test_empty_and_all_missing_columns(conversion):
    assert TokenColumn.decode([], "int").to_lists() == []
    col = TokenColumn.decode([None, None], "float")
    assert col.to_lists() == [None, None] and col.to_arrow().null_count == 2
    assert np.array_equal(col.offsets, [0, 0, 0])


STRINGS = ["planner", None, "", "rédacteur 日本 🙂", "x" * 5000, None, "planner"]


@pytest.mark.parametrize("values", [STRINGS, [], [None, None], ["only"]])
def test_string_column_holds_the_strings(conversion, values):
    col = StringColumn.encode(values)
    if conversion == "python":
        assert col is None  # without the C module the caller keeps its list
        return
    assert len(col) == len(values)
    assert col.to_list() == values
    for type_ in (pa.string(), pa.large_string()):
        arrow = col.to_arrow(type_)
        assert arrow.type == type_ and arrow.to_pylist() == values
        assert arrow.null_count == values.count(None)


@needs_c
@pytest.mark.parametrize("values", [["a", 1], ["a", b"bytes"], ["lone \ud800 surrogate"], [["a"]]])
def test_string_column_declines_what_is_not_all_strings(values):
    assert StringColumn.encode(values) is None


@needs_c
def test_mined_tables_are_the_same_with_and_without_the_c_columns(tmp_path, monkeypatch):
    """`mine()` builds its string columns from the batches' UTF-8 buffers and its token lists in C; the tables
    (values and dtypes) equal those built from Python lists, in one process and with workers."""
    from trajectory_spans import line, own_episode, write

    from marft_lg.trajectories.mining import mine

    lines = []
    for e in range(1, 40):
        spans = own_episode(e, f"e{e}", base=10 * e, tool_error=e % 3 == 0)
        if e % 4 == 0:  # a non-ASCII agent name
            for s in spans:
                for a in s["attributes"]:
                    if a["value"].get("stringValue") == "researcher":
                        a["value"]["stringValue"] = "chercheur·研究"
        lines.append(line(spans))
    path = write(tmp_path / "t.jsonl", lines)
    built = {}
    for c in (True, False):
        if not c:
            monkeypatch.setattr(flat_columns, "_c_utf8_column", None)
            monkeypatch.setattr(flat_columns, "_c_split_lists", None)
            monkeypatch.setattr(flat_columns, "_c_b64_column", None)
            monkeypatch.setattr(flat_columns, "_c_number_column", None)
        for workers in (1, 2):
            ds = mine(path, workers=workers)
            built[c, workers] = ds
    first = built[True, 1]
    assert set(first.actions["agent"]) == {"planner", "researcher", "chercheur·研究"}
    assert first.actions["model"].isna().any() and first.actions["model"].notna().any()
    for ds in built.values():
        pd.testing.assert_frame_equal(ds.episodes, first.episodes, check_exact=True)
        pd.testing.assert_frame_equal(ds.actions, first.actions, check_exact=True)


@pytest.mark.parametrize(("values", "kind"), [([0, 5, None, -2**63, 2**63 - 1], "int"), ([1.5, None, -0.0, 1e300], "float"),
                                              ([], "int"), ([None, None], "float")])
def test_number_column_holds_the_numbers(conversion, values, kind):
    col = NumberColumn.encode(values, kind)
    if conversion == "python":
        assert col is None
        return
    assert len(col) == len(values) and col.to_list() == values
    type_ = pa.int64() if kind == "int" else pa.float64()
    assert col.to_arrow(type_).to_pylist() == values and col.to_arrow(type_).type == type_


@needs_c
@pytest.mark.parametrize(("values", "kind"), [([1, 2**63], "int"), ([1, 2.5], "int"), ([True], "int"), (["1"], "int"),
                                              ([1.5, 2], "float"), ([np.float64(1.5)], "float")])
def test_number_column_declines_other_values(values, kind):
    assert NumberColumn.encode(values, kind) is None


@needs_c
def test_c_base64_accepts_canonical_text_and_equals_binascii_where_it_accepts():
    import base64
    import binascii
    import random

    from marft_lg.trajectories._columns_c import b64_column

    rng = random.Random(5)
    for _ in range(3000):
        raw = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 20)))
        text = base64.b64encode(raw).decode()
        data, offsets, valid = b64_column([f"i32:{text}", None], "i32:")
        assert data == raw and valid == b"\x01\x00"
        assert np.frombuffer(offsets, dtype=np.int64).tolist() == [0, len(raw), len(raw)]
        mangled = list(text)
        for _ in range(rng.randrange(1, 3)):  # change, insert or drop a character
            at = rng.randrange(len(mangled) + 1)
            ch = rng.choice("A/+=z9 \n-_.")
            if rng.random() < 0.4 and mangled:
                mangled[min(at, len(mangled) - 1)] = ch
            elif rng.random() < 0.5:
                mangled.insert(at, ch)
            elif mangled:
                del mangled[min(at, len(mangled) - 1)]
        text = "".join(mangled)
        got = b64_column([f"i32:{text}"], "i32:")
        if got is not None:
            assert got[0] == binascii.a2b_base64(text)
    assert b64_column(["f32:AAAA"], "i32:") is None and b64_column([["i32:AAAA"]], "i32:") is None
    assert b64_column(["i32:AAAA", "i32:éAAA"], "i32:") is None
