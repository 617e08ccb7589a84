"""The C reader (`_otlp_c.spans`) either declines a line or gives exactly what the tolerant reader gives, on
random lines of every shape (escapes, unicode, numbers, nesting, whitespace, damage), and it accepts the usual
ones. Mining gives the same tables with and without it."""

from __future__ import annotations

import json
import os
import random
import string
import sys

import pytest
from trajectory_spans import line, own_episode, write

from marft_lg.trajectories import otlp
from marft_lg.trajectories.otlp import DEFAULT_MAX_ATTRIBUTE_BYTES, tolerant_spans_of_line
from marft_lg.trajectories.quarantine import Quarantine

pytestmark = pytest.mark.skipif(os.environ.get("MARFT_MINING_C_READER") == "0", reason="C reader switched off")


def test_the_c_reader_is_built():
    # setup.py builds it on install (optional=True: without a compiler the install still succeeds); CI has gcc
    assert otlp.c_spans is not None, "marft_lg/trajectories/_otlp_c.c was not compiled: reinstall with a C compiler"


def _tolerant(raw: bytes):
    q, stats = Quarantine(None), {}
    spans = list(tolerant_spans_of_line(raw, "f.jsonl:3", q, DEFAULT_MAX_ATTRIBUTE_BYTES, stats))
    return spans, stats.get("spans_read", 0), dict(q.counts)


_TEXT = string.ascii_letters + string.digits + ' "\\/\n\t\r\b\f\x00\x01\x1f\x7f{}[]:,' + "é€😀\u2028\ud7ff\ue000"


def _text(rng: random.Random, n: int = 12) -> str:
    if rng.random() < 0.3:
        return rng.choice(["", "planner", "gen_ai.operation.name", "chat", "x" * 200, "ép" * 40])
    return "".join(rng.choice(_TEXT) for _ in range(rng.randint(0, n)))


def _int_text(rng: random.Random, clean: bool) -> str:
    usual = ["0", "7", "-3", "0012", "-0", str(rng.randint(-10**17, 10**17))]
    return rng.choice(usual if clean else [*usual, "12a", "", "+5", " 5", "1_0", str(2**63), str(2**70), "٣"])


def _number(rng: random.Random, clean: bool):
    usual = [0, 1, -1, 2**53 + 1, 10**17, rng.randint(-10**6, 10**6), rng.random(), -rng.random() * 1e300,
             1.5e200, float(rng.randint(0, 9)), rng.uniform(-1e9, 1e9)]
    return rng.choice(usual if clean else [*usual, 2**63, 2**64, 1e-310, 12345678901234567890.5])


def _any_value(rng: random.Random, depth: int = 0, clean: bool = False):
    odd = 0 if clean else 1
    kind = rng.choices(["string", "int", "intnum", "double", "bool", "array", "kvlist", "bytes", "two", "empty",
                        "null", "other"], weights=[30, 8, 4, 6, 4, 3 if depth < 3 else 0, 3 if depth < 3 else 0,
                                                   2, odd, odd, odd, odd])[0]
    if kind == "string":
        return {"stringValue": _text(rng)}
    if kind == "int":
        return {"intValue": _int_text(rng, clean)}
    if kind == "intnum":
        return {"intValue": rng.randint(-10**17, 10**17) if clean else _number(rng, clean)}
    if kind == "double":
        return {"doubleValue": _number(rng, clean)}
    if kind == "bool":
        return {"boolValue": rng.choice([True, False] if clean else [True, False, 1, "true", None])}
    if kind == "array":
        values = {"values": [_any_value(rng, depth + 1, clean) for _ in range(rng.randint(0, 3))]}
        return {"arrayValue": rng.choice([{}, values] if clean else [{}, values, {"values": None}, None])}
    if kind == "kvlist":
        return {"kvlistValue": {"values": _attributes(rng, depth + 1, clean)}}
    if kind == "bytes":
        return {"bytesValue": rng.choice(["AAE=", "", _text(rng)])}
    if kind == "two":
        return {"stringValue": "s", "intValue": "1"}
    if kind == "empty":
        return {}
    if kind == "null":
        return {"stringValue": None}
    return {"vendorValue": 1}


def _attributes(rng: random.Random, depth: int = 0, clean: bool = False) -> list:
    out = []
    for _ in range(rng.randint(0, 6)):
        kv = {"key": rng.choice(["a", "b", "gen_ai.operation.name", _text(rng, 6)]),
              "value": _any_value(rng, depth, clean)}
        r = 1.0 if clean else rng.random()
        if r < 0.02:
            del kv["value"]
        elif r < 0.04:
            kv["extra"] = 1
        elif r < 0.06:
            kv = {"value": kv["value"], "key": kv["key"]}
        out.append(kv)
    return out


def _id(rng: random.Random, n: int, clean: bool = False) -> object:
    good = "".join(rng.choice("0123456789abcdef") for _ in range(n))
    if clean:
        return good if good.strip("0") else "1" * n
    return rng.choices([good, good.upper(), "0" * n, good[:-1], "t61rcWkgMzE=", 5, None, "zz" * (n // 2)],
                       weights=[90, 2, 1, 1, 1, 1, 1, 1])[0]


def _span(rng: random.Random, trace: str, clean: bool) -> dict:
    """A random span; `clean`: only shapes the C reader is meant to take (random content all the same)."""
    if not clean:
        return _odd_span(rng, trace)
    start = rng.randint(0, 2**62)
    span: dict = {"traceId": trace, "spanId": _id(rng, 16, True)}
    r = rng.random()
    if r < 0.6:
        span["parentSpanId"] = _id(rng, 16, True)
    elif r < 0.9:
        span["parentSpanId"] = rng.choice(["", "0" * 16])
    span["name"] = rng.choice([_text(rng), None])
    span["startTimeUnixNano"], span["endTimeUnixNano"] = rng.choice([(str(start), str(start + 5)), (start, start)])
    if rng.random() < 0.9:
        span["attributes"] = _attributes(rng, 0, True) if rng.random() < 0.95 else None
    if rng.random() < 0.7:
        span["status"] = rng.choice([None, {}, {"code": 1}, {"code": 2, "message": _text(rng)}, {"code": "2"},
                                     {"code": "STATUS_CODE_ERROR"}, {"code": "ERROR"}, {"code": -2}])
    if rng.random() < 0.2:
        span["events"] = rng.choice([None, [], [{"name": _text(rng), "attributes": _attributes(rng, 0, True),
                                                 "timeUnixNano": "5"}], [{"name": None}], [{}]])
    for key, value in (("kind", 1), ("traceState", ""), ("flags", 256), ("links", []), ("droppedAttributesCount", 0)):
        if rng.random() < 0.2:
            span[key] = value
    return span


def _odd_span(rng: random.Random, trace: str) -> dict:
    start = rng.randint(0, 2**62)
    span: dict = {"traceId": trace if rng.random() < 0.95 else _id(rng, 32), "spanId": _id(rng, 16)}
    r = rng.random()
    if r < 0.6:
        span["parentSpanId"] = _id(rng, 16)
    elif r < 0.8:
        span["parentSpanId"] = ""
    elif r < 0.85:
        span["parentSpanId"] = "0" * 16
    elif r < 0.9:
        span["parentSpanId"] = None
    span["name"] = rng.choices([_text(rng), None, 5], weights=[95, 3, 2])[0]
    times = rng.choices([(str(start), str(start + 5)), (start, start + 5), (str(start), str(start - 1)),
                         ("soon", "1"), (2**64, 2**64 + 1), (float(start), float(start)), (str(2**70), str(2**70))],
                        weights=[80, 8, 3, 2, 2, 2, 3])[0]
    span["startTimeUnixNano"], span["endTimeUnixNano"] = times
    if rng.random() < 0.9:
        span["attributes"] = _attributes(rng) if rng.random() < 0.95 else None
    if rng.random() < 0.7:
        span["status"] = rng.choice([None, {}, {"code": 1}, {"code": 2, "message": _text(rng)}, {"code": "2"},
                                     {"code": "STATUS_CODE_ERROR"}, {"code": "ERROR", "message": None},
                                     {"code": 2.0}, {"code": True}, {"message": 5}, "bad"])
    if rng.random() < 0.2:
        span["events"] = rng.choice([None, [], [{"name": _text(rng), "attributes": _attributes(rng),
                                                 "timeUnixNano": "5"}], [{"name": None}], [{}], [5]])
    for key, value in (("kind", 1), ("traceState", ""), ("flags", 256), ("links", []), ("droppedAttributesCount", 0)):
        if rng.random() < 0.2:
            span[key] = value
    if rng.random() < 0.02:
        span["vendorField"] = {"x": [1, 2.5, "é"]}
    if rng.random() < 0.01:
        span = {k: v for k, v in span.items() if k != "spanId"}
    return span


def _request(rng: random.Random) -> dict:
    trace = _id(rng, 32, True)
    clean = rng.random() < 0.5
    resource_spans = []
    for _ in range(rng.randint(1, 2)):
        scopes = [{"scope": {"name": "s"}, "spans": [_span(rng, trace, clean) for _ in range(rng.randint(0, 3))]}
                  for _ in range(rng.randint(1, 2))]
        rs: dict = {"scopeSpans": scopes}
        if rng.random() < 0.5:
            rs["resource"] = {"attributes": [{"key": "service.name", "value": {"stringValue": "app"}}],
                              "n": [1.5, -2, True, None]}
        if rng.random() < 0.2:
            rs["schemaUrl"] = "https://opentelemetry.io/schemas/1.26.0"
        resource_spans.append(rs)
    return {"resourceSpans": resource_spans}


def _dump(rng: random.Random, request: dict) -> bytes:
    text = json.dumps(request, ensure_ascii=rng.random() < 0.5,
                      separators=rng.choice([(",", ":"), (", ", ": "), (" ,", " :")]))
    raw = text.encode("utf-8", errors="surrogatepass") + rng.choice([b"", b"\n", b" \r\n"])
    r = rng.random()
    if r < 0.05 and raw:
        raw = raw[: rng.randrange(len(raw))]  # truncated
    elif r < 0.1 and raw:
        i = rng.randrange(len(raw))
        raw = raw[:i] + bytes([rng.randrange(256)]) + raw[i + 1:]  # one byte changed
    return raw


def test_c_reader_declines_or_equals_the_tolerant_reader_on_random_lines():
    rng = random.Random(20261122)
    accepted = kept = 0
    for i in range(4000):
        raw = _dump(rng, _request(rng))
        got = otlp.c_spans(raw, "f.jsonl:3")
        if got is None:
            continue
        accepted += 1
        kept += len(got[0])
        spans, n, quarantined = _tolerant(raw)
        assert quarantined == {}, (i, raw[:300])
        assert got == (spans, n), (i, raw[:300])
    assert accepted > 1000 and kept > 2000  # it takes lines with escapes, unicode, numbers and nesting


def test_c_reader_accepts_usual_lines_and_shares_trace_ids():
    raw = line(own_episode(1, "e1") + own_episode(2, "e2", base=10, tool_error=True)).encode()
    got = otlp.c_spans(raw, "f.jsonl:3")
    assert got is not None and got[1] == len(got[0]) > 10
    spans, n, _ = _tolerant(raw)
    assert got == (spans, n)
    assert len({id(s.trace_id) for s in got[0] if s.trace_id == got[0][0].trace_id}) == 1


@pytest.mark.parametrize("raw", [b"", b"{}", b"[]", b"not json", b'{"resourceSpans": []} x', b'{"resourceSpans": {}}',
                                 b'{"resource_spans": []}', b'{"resourceSpans": [{}]}', b'{"resourceSpans": [5]}',
                                 b'{"resourceSpans": [{"scopeSpans": [{"spans": [5]}]}]}',
                                 b'{"resourceSpans": [], "resourceSpans": []}'])
def test_c_reader_declines_other_shapes(raw):
    assert otlp.c_spans(raw, "f:1") is None


def test_c_reader_refuses_wrong_arguments():
    with pytest.raises(TypeError):
        otlp.c_spans("text, not bytes", "f:1")


def test_mining_gives_the_same_tables_with_and_without_the_c_reader(tmp_path, monkeypatch):
    from marft_lg.trajectories.mining import mine

    lines = [line(own_episode(e, f"e{e}", base=10 * e, tool_error=e % 3 == 0)) for e in range(1, 30)]
    lines.insert(5, "garbage")
    lines.insert(9, line(own_episode(4, "e4", base=40))[:-1].replace('"spanId"', ' "spanId" '))
    path = write(tmp_path / "t.jsonl", lines)
    with_c = mine(path, quarantine=tmp_path / "q1.jsonl", workers=1)
    monkeypatch.setattr(otlp, "c_spans", None)
    without = mine(path, quarantine=tmp_path / "q2.jsonl", workers=1)
    assert with_c.episodes.equals(without.episodes) and with_c.actions.equals(without.actions)
    assert (tmp_path / "q1.jsonl").read_text() == (tmp_path / "q2.jsonl").read_text() != ""


def test_newline_counting_in_c_equals_bytes_count(tmp_path, monkeypatch):
    from marft_lg.trajectories.parallel import _count_newlines

    rng = random.Random(3)
    data = bytes(rng.choice(b"ab\n") for _ in range(100_000))
    path = tmp_path / "lines.jsonl"
    path.write_bytes(data)
    cuts = [(0, len(data)), (0, 0), (5, 6), *[sorted(rng.sample(range(len(data) + 1), 2)) for _ in range(20)]]
    expected = [data[a:b].count(b"\n") for a, b in cuts]
    assert [_count_newlines(path, a, b) for a, b in cuts] == expected
    monkeypatch.setattr(otlp, "_otlp_c", None)  # the pure-Python fallback, a chunk at a time
    assert [_count_newlines(path, a, b) for a, b in cuts] == expected
    assert otlp.count_newlines(memoryview(data), chunk=4096) == expected[0]


def _random_messages(rng: random.Random) -> list:
    def text() -> str:
        return "".join(rng.choice(["a", "b", " ", "é", "日", "🙂", "\n", '"', "\\", "\t", "x" * 20]) for _ in range(rng.randrange(0, 8)))

    def args():
        return rng.choice([{"topic": text()}, [1, 2.5, None], "s", 3, None, {"n": {"m": [True, False]}}, 1e-7, -0.0])

    messages = []
    for _ in range(rng.randrange(0, 4)):
        parts = []
        for _ in range(rng.randrange(0, 4)):
            if rng.random() < 0.7:
                parts.append({"type": "text", "content": text()})
            else:
                part = {"type": "tool_call"}
                for key, value in (("id", f"c{rng.randrange(9)}"), ("name", "lookup"), ("arguments", args())):
                    if rng.random() < 0.8:
                        part[key] = value if rng.random() < 0.9 else None
                parts.append(part)
        message = {"role": rng.choice(["user", "assistant", "system", "tool"]), "parts": parts}
        if rng.random() < 0.15:
            del message["role"]
        messages.append(dict(reversed(message.items())) if rng.random() < 0.2 else message)
    return messages


def _mangle(rng: random.Random, raw: str) -> str:
    edits = [
        lambda s: s.replace('"type": "text"', '"type": "image"', 1),
        lambda s: s.replace('"content": ', '"content": 5, "x": ', 1),
        lambda s: s.replace('"role": ', '"role": null, "r": ', 1),
        lambda s: s.replace('"parts": [', '"parts": [{}, ', 1),
        lambda s: s.replace('"parts": ', '"parts": null, "p": ', 1),
        lambda s: s.replace('{"type": "tool_call"', '{"type": "tool_call", "content": "c"', 1),
        lambda s: s.replace('{"type": "text"', '{"type": "text", "id": "i"', 1),
        lambda s: s.replace('"role"', '"role", "role": "user"', 1).replace('"role", ', '"role": "x", ', 1),
        lambda s: s.replace('"type"', '"t\\u0079pe"', 1),
        lambda s: s.replace('"arguments": ', '"arguments": 123456789012345678901234, "q": ', 1),
        lambda s: s.replace('"text"', '"te\\u0078t"', 1),
        lambda s: s.replace('"a', '"\\ud800a', 1),
        lambda s: s[: rng.randrange(len(s) + 1)],
        lambda s: s + rng.choice(["", " ", "x", "]", "\n"]),
        lambda s: s.replace(", ", ",", rng.randrange(3)).replace(": ", ":"),
        lambda s: s.replace('"content": "', '"content": "\\"\\n\\u00e9\\ud83d\\ude42', 1),
    ]
    for _ in range(rng.randrange(1, 3)):
        raw = rng.choice(edits)(raw)
    return raw


def test_c_genai_messages_decline_or_equal_the_typed_path(monkeypatch):
    """`_otlp_c.genai_messages` gives exactly what the msgspec pass of `_typed_messages` gives, or declines."""
    from marft_lg.trajectories.formats import genai

    rng = random.Random(11)
    texts = []
    for _ in range(3000):
        messages = _random_messages(rng)
        raw = json.dumps(messages, ensure_ascii=rng.random() < 0.3)
        texts.append(raw if rng.random() < 0.5 else _mangle(rng, raw))
    c_out = [genai._c_messages(t) for t in texts]
    monkeypatch.setattr(genai, "_c_messages", None)
    typed = [genai._typed_messages(t) for t in texts]
    accepted = 0
    for t, got, want in zip(texts, c_out, typed, strict=True):
        if got is not None:
            accepted += 1
            assert got == want, t
            assert [list(m) for m in got] == [list(m) for m in want], t  # key order too
    assert accepted > 1000 and sum(w is not None for w in typed) > accepted * 1.02
    usual = json.dumps([{"role": "system", "parts": [{"type": "text", "content": "You plan."}]},
                        {"role": "assistant", "parts": [{"type": "tool_call", "id": "c1", "name": "f", "arguments": {"a": 1}}]}])
    assert genai.C_READER.genai_messages(usual) == [{"role": "system", "content": "You plan."},
                                                    {"role": "assistant", "content": "",
                                                     "tool_calls": [{"id": "c1", "name": "f", "args": {"a": 1}}]}]
    assert genai.C_READER.genai_messages("[]") is None and genai.C_READER.genai_messages(b"[]") is None


def _random_metadata(rng: random.Random):
    meta = {}
    choices = {
        "langgraph_node": ["researcher", "writer", None, 3, ""],
        "langgraph_checkpoint_ns": ["researcher:r1", "team:t1|researcher:r1", "a||b:c", "|x:1", "plain", "", None,
                                    ["a|b"], 5, "é:1|日:2"],
        "checkpoint_ns": ["writer:w1", "outer:o|inner:i", None, ""],
        "langgraph_step": [2, 0, -1, "3", 2.7, True, None, "x", [1], 2**70],
        "langgraph_triggers": [["branch:to:researcher"], [], ["a", 1], '["a", "b"]', "('a', 'b')", None, 5, ("t",)],
        "thread_id": ["session-1", "", None, 0, 7],
        "session_id": ["s2", "", None],
        "conversation_id": ["c3", "", None, 0],
        "scenario_id": ["s-1", 4, None, ""],
        "user": ["u1"],
    }
    for key, values in choices.items():
        if rng.random() < 0.6:
            meta[key] = rng.choice(values)
    shape = rng.random()
    if shape < 0.8:
        return json.dumps(meta, default=list)
    return rng.choice([None, meta, "plain text", "[1, 2]", "{bad json", "", 42])


def test_c_openinference_metadata_equals_python():
    from marft_lg.trajectories.formats import openinference as oi

    assert oi._meta is not oi._metadata, "the C version is not in use"
    rng = random.Random(17)
    values = [_random_metadata(rng) for _ in range(3000)]
    oi._meta_cache.clear()
    c_out = [oi._meta(v) for v in values]
    oi._meta_cache.clear()
    py_out = [oi._metadata(v) for v in values]
    oi._meta_cache.clear()
    for v, got, want in zip(values, c_out, py_out, strict=True):
        assert got == want and [type(x) for x in got] == [type(x) for x in want], v
        for x in got[2], got[5], got[6], got[7]:  # agent, task, session, scenario: interned
            assert type(x) is not str or x is sys.intern(x), (v, x)
    text = json.dumps({"langgraph_node": "n", "langgraph_checkpoint_ns": "a:1|b:2"})
    assert oi._meta(text) is oi._meta(text) and oi._meta(text)[2] == "a|b"  # cached
    oi._meta_cache.clear()


def _random_openinference_attributes(rng: random.Random) -> dict:
    fields = ["message.role", "message.content", "message.tool_call_id", "message.name",
              "message.tool_calls.0.tool_call.id", "message.tool_calls.0.tool_call.function.name",
              "message.tool_calls.0.tool_call.function.arguments", "message.tool_calls.1.tool_call.function.name",
              "message.tool_calls.2.tool_call.other", "message.contents.0.message_content.text"]
    values = ["user", "assistant", "hi é", 7, None, '{"t": 1}', "not json", "", ["a"], 2.5]
    attrs = {}
    for side in ("llm.input_messages.", "llm.output_messages."):
        for idx in rng.sample(["0", "1", "2", "00"], rng.randrange(0, 3)):
            for field in rng.sample(fields, rng.randrange(1, 4)):
                if field.startswith("message.contents") and rng.random() < 0.8:
                    continue
                attrs[f"{side}{idx}.{field}"] = rng.choice(values)
    for key in rng.sample(["session.id", "llm.model_name", "metadata", "input.value"], 2):
        attrs[key] = "x"
    items = list(attrs.items())
    rng.shuffle(items)
    return dict(items)


def test_c_openinference_messages_equal_the_reference():
    """`_otlp_c.oi_io_messages` (the layout of a key set remembered, then the messages built in C) gives what
    `flat_messages` gives, key order of each message included, the first time and from the remembered layout."""
    from marft_lg.trajectories.formats import openinference as oi

    assert oi._io is not oi.io_messages, "the C version is not in use"
    rng = random.Random(19)
    built = 0
    for _ in range(2000):
        a = _random_openinference_attributes(rng)
        expected = (oi.flat_messages(a, "llm.input_messages."), oi.flat_messages(a, "llm.output_messages."))
        for _ in range(2):
            got = oi._io(a)
            assert got == expected, a
            assert [[list(m) for m in side] for side in got] == [[list(m) for m in side] for side in expected], a
        built += oi._layouts.get(tuple(a)) is not None
    assert built > 500
