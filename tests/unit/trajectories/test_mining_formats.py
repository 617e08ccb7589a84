"""Own-format spans (built from the attribute contract) and generic GenAI-semconv spans; ids, paths, since,
feedback and determinism."""

from __future__ import annotations

import base64
import gzip
import json

import pandas as pd
import pytest
from trajectory_spans import T0, feedback_span, line, own_episode, span, write

from marft_lg.trajectories.dataset import TrajectoryDataset
from marft_lg.trajectories.mining import mine, mine_with_report


def test_own_format_fields(tmp_path):
    ds = mine(write(tmp_path / "a.jsonl", [line(own_episode(1, "e1", scenario_id="s-refund"))]))
    ep = ds.episodes.iloc[0]
    assert (ep["episode_id"], ep["scenario_id"], ep["status"], ep["n_actions"]) == ("e1", "s-refund", "ok", 2)
    assert ep["agents"] == ["planner", "researcher"]
    assert json.loads(ep["outcome"]) == {"answer": "30 days"}
    assert ep["metadata"] == {"user": "u1"}
    assert ep["start_time"] == pd.Timestamp(T0, unit="ns", tz="UTC")
    planner, researcher = ds.actions.to_dict("records")
    assert planner["prompt_token_ids"] == [1, 2, 3] and planner["completion_token_ids"] == [7, 8]
    assert planner["completion_logprobs"] == [-0.5, -0.25]
    assert planner["messages"] == [{"role": "system", "content": "You plan."}, {"role": "user", "content": "refund?"}]
    assert (planner["adapter_version"], planner["model"], planner["latency_s"]) == ("v3", "smollm2", 0.017)
    assert (planner["input_tokens"], planner["output_tokens"], planner["step"]) == (3, 2, 1)
    assert researcher["completion_logprobs"] is None
    assert researcher["depends_on"] == [0]
    assert researcher["tool_calls"] == [{"id": "c1", "name": "lookup", "args": {"topic": "refund_policy"},
                                         "result": "30 days", "error": None}]


def test_own_format_tool_error_counts(tmp_path):
    ds = mine(write(tmp_path / "a.jsonl", [line(own_episode(1, "e1", tool_error=True))]))
    researcher = ds.actions.iloc[1]
    assert researcher["tool_errors"] == 1
    assert researcher["tool_calls"][0]["error"] == "ToolException: unknown topic"
    assert ds.episodes.iloc[0]["status"] == "ok"  # a failed tool call is the agent's mistake, not a crash


def test_feedback_joined_latest_wins_and_orphan_feedback_quarantined(tmp_path):
    lines = [line(own_episode(1, "e1")), line([feedback_span(50, 1, "e1", "thumbs", 0, 500)]),
             line([feedback_span(51, 1, "e1", "thumbs", 1, 900), feedback_span(51, 2, "e1", "csat", 4.5, 901)]),
             line([feedback_span(52, 1, "nope", "thumbs", 1, 900)])]
    q = tmp_path / "q.jsonl"
    ds, report = mine_with_report(write(tmp_path / "a.jsonl", lines), quarantine=q)
    assert ds.episodes.iloc[0]["feedback"] == {"thumbs": 1, "csat": 4.5}
    assert report.quarantined == {"feedback_without_episode": 1}
    assert len(ds) == 1


def test_since_keeps_episodes_that_ended_after_watermark(tmp_path):
    src = write(tmp_path / "a.jsonl", [line(own_episode(1, "early", t=0)), line(own_episode(2, "late", base=10, t=5000))])
    cut = pd.Timestamp(T0 + 2_000 * 1_000_000, unit="ns", tz="UTC")
    ds, report = mine_with_report(src, since=cut.isoformat())
    assert ds.episode_ids == ["late"] and report.episodes_before_since == 1
    assert mine(src, since=cut.to_pydatetime()).episode_ids == ["late"]
    with pytest.raises(ValueError, match="ISO-8601"):
        mine(src, since="yesterday")


def test_deterministic_and_order_independent(tmp_path):
    a, b = own_episode(1, "e1"), own_episode(2, "e2", base=10, t=300)
    one = mine(write(tmp_path / "one.jsonl", [line(a), line(b)]))
    again = mine(write(tmp_path / "one.jsonl", [line(a), line(b)]))
    shuffled = mine(write(tmp_path / "two.jsonl", [line(list(reversed(b))), line(list(reversed(a)))]))
    for other in (again, shuffled):
        pd.testing.assert_frame_equal(one.episodes, other.episodes)
        pd.testing.assert_frame_equal(one.actions, other.actions)


def test_parquet_round_trip(tmp_path):
    ds = mine(write(tmp_path / "a.jsonl", [line(own_episode(1, "e1"))]))
    ds.to_parquet(tmp_path / "out")
    back = TrajectoryDataset.from_parquet(tmp_path / "out")
    assert back.actions["tool_calls"].tolist() == ds.actions["tool_calls"].tolist()
    assert back.actions["prompt_token_ids"].tolist() == ds.actions["prompt_token_ids"].tolist()
    assert back.episodes["feedback"].tolist() == ds.episodes["feedback"].tolist()


def test_base64_ids_accepted(tmp_path):
    spans = own_episode(1, "e1")
    for s in spans:
        s["traceId"] = base64.b64encode(bytes.fromhex(s["traceId"])).decode()
        s["spanId"] = base64.b64encode(bytes.fromhex(s["spanId"])).decode()
        if s["parentSpanId"]:
            s["parentSpanId"] = base64.b64encode(bytes.fromhex(s["parentSpanId"])).decode()
    ds, report = mine_with_report(write(tmp_path / "a.jsonl", [line(spans)]))
    assert report.repaired_parents == 0 and ds.actions["span_id"].tolist() == [f"{3:016x}", f"{5:016x}"]


def test_directories_globs_and_gzip(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    write(tmp_path / "d" / "a.jsonl", [line(own_episode(1, "e1"))])
    (tmp_path / "d" / "sub" / "b.jsonl.gz").write_bytes(gzip.compress((line(own_episode(2, "e2", base=10)) + "\n").encode()))
    write(tmp_path / "d" / "ignored.txt", ["nonsense"])
    assert mine(tmp_path / "d").episode_ids == ["e1", "e2"]
    assert mine(str(tmp_path / "d" / "**" / "*.gz")).episode_ids == ["e2"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        mine(tmp_path / "missing.jsonl")


def _genai_chat(trace, sid, parent, t, agent, prompt, completion, conversation):
    return span(trace, sid, parent, f"chat {agent}", t, t + 5, {
        "gen_ai.operation.name": "chat", "gen_ai.conversation.id": conversation, "gen_ai.request.model": "m",
        "gen_ai.input.messages": json.dumps([{"role": "user", "parts": [{"type": "text", "content": prompt}]}]),
        "gen_ai.output.messages": json.dumps([{"role": "assistant", "parts": [{"type": "text", "content": completion}]}]),
    })


def test_generic_genai_semconv_conversation_across_traces(tmp_path):
    # two traces (two turns) of one conversation; agents named only on the enclosing invoke_agent span
    turn1 = [span(1, 1, None, "invoke_agent triage", 0, 20, {"gen_ai.operation.name": "invoke_agent",
                                                             "gen_ai.agent.name": "triage", "gen_ai.conversation.id": "conv-9"}),
             _genai_chat(1, 2, 1, 1, "triage", "my order is late", "Route to the shipping desk please.", "conv-9")]
    turn2 = [span(2, 1, None, "invoke_agent shipping", 100, 120, {"gen_ai.operation.name": "invoke_agent",
                                                                  "gen_ai.agent.name": "shipping", "gen_ai.conversation.id": "conv-9"}),
             _genai_chat(2, 2, 1, 101, "shipping", "Triage said: Route to the shipping desk please.", "It ships today.", "conv-9")]
    ds, report = mine_with_report(write(tmp_path / "g.jsonl", [line(turn1), line(turn2)]))
    assert ds.episode_ids == ["conv-9"] and report.formats == {"genai": 4}
    assert ds.actions["agent"].tolist() == ["triage", "shipping"]
    assert ds.actions["depends_on"].tolist() == [[], [0]]  # the triage completion is quoted in the prompt
    assert sorted(ds.episodes.iloc[0]["trace_ids"]) == [f"{1:032x}", f"{2:032x}"]


def test_unknown_spans_only_mean_nothing_usable(tmp_path):
    ds, report = mine_with_report(write(tmp_path / "h.jsonl", [line([span(1, 1, None, "GET /", 0, 1, {"http.method": "GET"})])]))
    assert len(ds) == 0 and report.spans_without_actions == 1 and report.formats == {"unknown": 1}


def test_streaming_parquet_equals_in_memory(tmp_path):
    from marft_lg.trajectories.mining import mine_to_parquet

    lines = [line(own_episode(i + 1, f"e{i}", base=10 * i, t=50 * i, tool_error=i % 2 == 1)) for i in range(5)]
    lines.append(line([feedback_span(90, 1, "e3", "thumbs", 1, 900)]))
    src = write(tmp_path / "a.jsonl", lines)
    report = mine_to_parquet(src, tmp_path / "streamed", chunk_actions=3)
    assert (report.episodes, report.actions) == (5, 10)
    assert report.actions_per_agent == {"planner": 5, "researcher": 5}
    mine(src).to_parquet(tmp_path / "memory")
    streamed = TrajectoryDataset.from_parquet(tmp_path / "streamed")
    in_memory = TrajectoryDataset.from_parquet(tmp_path / "memory")
    pd.testing.assert_frame_equal(streamed.episodes, in_memory.episodes, check_dtype=False)
    pd.testing.assert_frame_equal(streamed.actions, in_memory.actions, check_dtype=False)
    assert streamed.episodes.set_index("episode_id")["feedback"]["e3"] == {"thumbs": 1}
    assert not list((tmp_path / "streamed").glob(".*.tmp"))


def test_legacy_openllmetry_indexed_prompts_and_subgraph_agents(tmp_path):
    props = "traceloop.association.properties."
    def call(sid, t, ns, node, prompt, completion):
        return span(7, sid, 1, "ChatOpenAI.chat", t, t + 5, {
            "traceloop.span.kind": "llm", props + "langgraph_node": node, props + "langgraph_step": "2",
            props + "langgraph_checkpoint_ns": ns, props + "thread_id": "thread-1",
            props + "langgraph_triggers": f"('branch:to:{node}',)",
            "gen_ai.prompt.0.role": "system", "gen_ai.prompt.0.content": "be brief",
            "gen_ai.prompt.1.role": "user", "gen_ai.prompt.1.content": prompt,
            "gen_ai.completion.0.role": "assistant", "gen_ai.completion.0.content": completion,
            "gen_ai.completion.0.tool_calls.0.name": "lookup", "gen_ai.completion.0.tool_calls.0.arguments": '{"q": 1}',
            "gen_ai.usage.prompt_tokens": 9, "gen_ai.usage.completion_tokens": 4, "gen_ai.response.model": "gpt-x"})
    spans = [span(7, 1, None, "LangGraph.workflow", 0, 100, {"traceloop.span.kind": "workflow", props + "thread_id": "thread-1"}),
             call(2, 1, "research:abc|search:def", "search", "find refunds", "looked it up carefully"),
             call(3, 10, "writer:ghi", "writer", "notes: looked it up carefully", "done")]
    ds = mine(write(tmp_path / "legacy.jsonl", [line(spans)]))
    acts = ds.actions.to_dict("records")
    assert ds.episode_ids == ["thread-1"]
    assert [a["agent"] for a in acts] == ["research|search", "writer"]
    assert acts[0]["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "find refunds"}]
    assert acts[0]["tool_calls"] == [{"id": None, "name": "lookup", "args": {"q": 1}, "result": None, "error": None}]
    assert (acts[0]["input_tokens"], acts[0]["output_tokens"], acts[0]["model"], acts[0]["step"]) == (9, 4, "gpt-x", 2)
    assert acts[1]["depends_on"] == [0]


def test_since_skips_files_written_well_before_the_watermark_unread(tmp_path):
    import os

    from marft_lg.trajectories.mining import SINCE_FILE_MARGIN_S

    cut = pd.Timestamp(T0 + 2_000 * 1_000_000, unit="ns", tz="UTC")
    old = write(tmp_path / "old.jsonl", ["not json: were this file read, it would be quarantined"])
    near = write(tmp_path / "near.jsonl", [line(own_episode(2, "late", base=10, t=5000))])
    s = cut.value / 1e9
    os.utime(old, (s - SINCE_FILE_MARGIN_S - 60, s - SINCE_FILE_MARGIN_S - 60))
    os.utime(near, (s - SINCE_FILE_MARGIN_S + 60, s - SINCE_FILE_MARGIN_S + 60))  # within the margin: read
    ds, report = mine_with_report(tmp_path, since=cut.isoformat(), quarantine=tmp_path / "q.jsonl")
    assert ds.episode_ids == ["late"]
    assert report.files_before_since == 1 and report.files == 1 and not report.quarantined
    assert mine_with_report(tmp_path)[1].quarantined == {"invalid_json": 1}  # without `since` every file is read
