"""`marft-lg serve` records what it sampled (`served_spans`), takes the caller's trace context and baggage, and
honours an episode's version pins and seeds; the helpers that carry them (`tracing.propagation`)."""

from __future__ import annotations

import httpx
import pytest

from marft_lg.serving.http.local_server import LocalServer
from marft_lg.serving.http.served_spans import CallContext, schema_error, tool_calls_of
from marft_lg.serving.team import Team
from marft_lg.serving.team_factory import team as build_team
from marft_lg.tracing import attributes as A
from marft_lg.tracing import propagation as P
from marft_lg.tracing.sink import RecordSink

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}]


@pytest.fixture()
def served(tiny_model_dir, tmp_path):
    team = Team(tiny_model_dir, ["planner", "writer"], registry=tmp_path / "registry", versions=None, seed=0)
    team.save_version("writer")  # v1
    sink = RecordSink(schedule_delay_s=None)
    server = LocalServer(team, sink)
    yield team, server, sink
    server.close()
    team.close()


def _ask(server, headers=None, **body):
    payload = {"model": "writer", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}
    r = httpx.post(f"{server.base_url}/chat/completions", json=payload, headers=headers or {}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_request_is_recorded_under_its_callers_span_with_the_episodes_pins_and_seed(served):
    team, server, sink = served
    parent = P.traceparent(0xABC, 0xDEF)
    baggage = P.encode_baggage({P.EPISODE_KEY: "ep-1", P.VERSIONS_KEY: "writer=v1;planner=init", P.SEED_KEY: "11"})
    with sink.tap() as spans:
        first = _ask(server, {"traceparent": parent, "baggage": baggage})
        again = _ask(server, {"traceparent": parent, "baggage": baggage})
        plain = _ask(server)
    [a, b, c] = spans
    assert (a.trace_id, a.parent_id, a.kind) == (0xABC, 0xDEF, 2)  # a SERVER span under the app's LLM span
    assert a.attributes[A.MARFT_EPISODE_ID] == "ep-1" and a.attributes[A.MARFT_SERVED] is True
    assert a.attributes[A.MARFT_ADAPTER_VERSION] == "v1" and first["marft"]["adapter_version"] == "v1"  # the pin
    assert a.attributes[A.GEN_AI_REQUEST_SEED] == 11 and first["choices"] == again["choices"]  # the call's seed
    assert a.attributes[A.GEN_AI_RESPONSE_ID] == first["id"]
    ids = A.decode_ints(a.attributes[A.MARFT_PROMPT_TOKEN_IDS])
    assert ids == team.engine.encode(_request(team))  # the prompt exactly as the server rendered it
    assert len(A.decode_floats(a.attributes[A.MARFT_COMPLETION_LOGPROBS])) == len(
        A.decode_ints(a.attributes[A.MARFT_COMPLETION_TOKEN_IDS]))
    assert c.parent_id == 0 and A.MARFT_EPISODE_ID not in c.attributes and A.GEN_AI_REQUEST_SEED not in c.attributes
    assert c.attributes[A.MARFT_ADAPTER_VERSION] == "init" and plain["marft"]["adapter_version"] == "init"
    assert b.trace_id == a.trace_id


def _request(team):
    from marft_lg.serving.http.chat_api import parse_chat_body

    reqs, _ = parse_chat_body({"model": "writer", "messages": [{"role": "user", "content": "hi"}]}, team)
    return reqs[0]


def test_an_explicit_model_pin_and_seed_win_over_baggage(served):
    _, server, sink = served
    baggage = P.encode_baggage({P.VERSIONS_KEY: "init", P.SEED_KEY: "3"})
    with sink.tap() as spans:
        out = _ask(server, {"baggage": baggage}, model="writer@v1", seed=5)
    assert out["marft"]["adapter_version"] == "v1" and spans[0].attributes[A.GEN_AI_REQUEST_SEED] == 5


def test_malformed_trace_context_is_ignored_not_refused():
    ctx = CallContext.from_headers({"traceparent": "00-" + "0" * 32 + "-" + "1" * 16 + "-01",
                                    "baggage": "marft.seed=abc,junk,marft.versions=writer%3Dv2"})
    assert ctx.parent is None and ctx.seed is None and ctx.version_for("writer") == "v2"
    assert CallContext.from_headers({"traceparent": "garbage"}).parent is None
    assert CallContext.from_headers({"baggage": f"marft.seed={2**70}"}).seed is None
    ours, theirs = P.traceparent(5, 6), P.traceparent(7, 8)
    assert CallContext.from_headers({"traceparent": theirs, "baggage": f"marft.parent={ours}"}).parent == (5, 6)
    assert CallContext.from_headers({"traceparent": theirs, "baggage": "marft.parent=junk"}).parent == (7, 8)


def test_tool_calls_record_unknown_tools_and_arguments_that_break_the_schema():
    opts = {"tool_names": ["add"], "tools": TOOLS, "parallel_tool_calls": True}
    text = ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"a": "one"}}</tool_call>'
            '<tool_call>{"name": "mul", "arguments": {}}</tool_call><tool_call>{oops</tool_call>')
    calls = tool_calls_of(text, opts)
    assert [c["error"] is None for c in calls] == [True, False, False, False]
    assert "schema" in calls[1]["error"] and "unknown tool 'mul'" in calls[2]["error"]
    assert "not valid JSON" in calls[3]["error"]
    assert schema_error({"a": 1}, {"required": 7}) is None  # a schema that is not one is not held against the call
    assert tool_calls_of(text, {"tool_names": None}) == []


def test_the_propagation_helpers_round_trip_and_leave_other_requests_alone():
    assert P.parse_traceparent(P.traceparent(5, 6)) == (5, 6)
    assert P.parse_baggage(P.encode_baggage({"k": "a=b;c", "x": "1"})) == {"k": "a=b;c", "x": "1"}
    assert P.decode_versions(P.encode_versions({"a": "v1", "b": "init"})) == {"a": "v1", "b": "init"}
    assert P.decode_versions("live") == "live" and P.decode_versions("") is None

    class Span:
        span_id, end_ns = 6, 0

    out = P.Outbound(5, Span(), baggage={P.EPISODE_KEY: "e"}, seed=lambda: 9)
    headers = P.outbound_headers(out, {"baggage": "theirs=1"})
    assert headers["traceparent"] == P.traceparent(5, 6)
    assert P.parse_baggage(headers["baggage"]) == {"theirs": "1", P.EPISODE_KEY: "e", P.SEED_KEY: "9",
                                                   P.PARENT_KEY: headers["traceparent"]}
    kept = P.outbound_headers(out, {"traceparent": "00-theirs"})
    assert "traceparent" not in kept  # theirs is kept; our span still travels in the baggage
    assert P.parse_baggage(kept["baggage"])[P.PARENT_KEY] == headers["traceparent"]
    P.install()
    for method, url, touched in (("POST", "http://h/v1/chat/completions", True), ("GET", "http://h/v1/models", False),
                                 ("POST", "http://h/search", False)):
        request = httpx.Request(method, url, json={"model": "x"} if method == "POST" else None)
        P.enter(out)
        try:
            P.prepare(request)
        finally:
            P.enter(None)
        assert ("traceparent" in request.headers) is touched
    Span.end_ns = 1  # the span ended: nothing carried any more
    P.enter(out)
    assert P.current() is None
    P.enter(None)


def test_the_loopback_server_takes_only_its_teams_models(served):
    team, server, _ = served
    chat = httpx.Request("POST", "http://10.0.0.1:8000/v1/chat/completions", json={"model": "writer@v1"})
    other = httpx.Request("POST", "http://10.0.0.1:8000/v1/chat/completions", json={"model": "gpt-4o"})
    server.redirect(chat)
    server.redirect(other)
    assert chat.url.host == "127.0.0.1" and chat.url.path == "/v1/chat/completions"
    assert chat.headers["host"] == f"127.0.0.1:{chat.url.port}"
    assert other.url.host == "10.0.0.1" and server.redirected == 1


def test_a_role_named_like_its_base_model_is_served_its_adapter(tiny_model_dir, tmp_path):
    """A base in a folder named after its role (`checker=bases/checker`): `model: checker` is the role, on its
    adapter, not the bare base (which answered before, untrainable, with no version)."""
    import shutil

    shutil.copytree(tiny_model_dir, tmp_path / "writer")
    team = build_team({"planner": tiny_model_dir, "writer": str(tmp_path / "writer")}, seed=0)
    sink = RecordSink(schedule_delay_s=None)
    server = LocalServer(team, sink)
    try:
        assert "writer" in team.bases
        with sink.tap() as spans:
            out = _ask(server)
        assert out["marft"] == {"agent": "writer", "adapter_version": "init", "logprobs_masked": False}
        assert spans[0].attributes[A.MARFT_AGENT_ROLE] == "writer"
    finally:
        server.close()
        team.close()
