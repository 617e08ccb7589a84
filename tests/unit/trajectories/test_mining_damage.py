"""One test per kind of damaged input: the damaged part is quarantined with its reason and file:line,
everything usable is still mined, nothing raises."""

from __future__ import annotations

import json

from trajectory_spans import line, own_episode, span, write

from marft_lg.trajectories.mining import mine_with_report


def _quarantined(path):
    return [json.loads(ln) for ln in path.read_text().splitlines()]


def _mine(tmp_path, lines, **kw):
    src = write(tmp_path / "spans.jsonl", lines)
    q = tmp_path / "quarantine.jsonl"
    dataset, report = mine_with_report(src, quarantine=q, **kw)
    return dataset, report, (_quarantined(q) if q.exists() else []), src


def test_truncated_last_line(tmp_path):
    good = line(own_episode(1, "e1"))
    cut = line(own_episode(2, "e2"))[:-40]
    dataset, report, q, src = _mine(tmp_path, [good, cut])
    assert dataset.episode_ids == ["e1"]
    assert [r["reason"] for r in q] == ["invalid_json"]
    assert q[0]["source"] == f"{src}:2" and q[0]["raw"] == cut


def test_garbage_lines(tmp_path):
    dataset, report, q, src = _mine(tmp_path, ["not json at all", line(own_episode(1, "e1")), "[1, 2, 3]",
                                               '{"hello": "world"}'])
    assert dataset.episode_ids == ["e1"]
    assert [(r["reason"], r["source"]) for r in q] == [
        ("invalid_json", f"{src}:1"), ("not_otlp", f"{src}:3"), ("not_otlp", f"{src}:4")]


def test_empty_lines_are_skipped_not_quarantined(tmp_path):
    dataset, report, q, _ = _mine(tmp_path, ["", "   ", line(own_episode(1, "e1")), ""])
    assert dataset.episode_ids == ["e1"] and q == []
    assert report.spans_kept == 6


def test_spans_without_ids(tmp_path):
    spans = own_episode(1, "e1")
    no_span_id = dict(spans[1], spanId="")  # the planner's agent span
    bad_trace = dict(spans[3], traceId="zz-not-hex")  # the researcher's agent span
    dataset, report, q, src = _mine(tmp_path, [line([s for s in spans if s not in (spans[1], spans[3])]
                                                     + [no_span_id, bad_trace])])
    assert sorted(r["reason"] for r in q) == ["missing_id", "missing_id"]
    assert all(r["source"] == f"{src}:1" and "span" in r for r in q)
    assert dataset.episode_ids == ["e1"]
    assert dataset.actions["agent"].tolist() == ["planner", "researcher"]  # from the chat spans themselves
    assert report.repaired_parents == 3  # both chats and the tool lost their parent


def test_end_before_start(tmp_path):
    spans = own_episode(1, "e1")
    broken = dict(spans[4], endTimeUnixNano=str(int(spans[4]["startTimeUnixNano"]) - 5))
    dataset, report, q, _ = _mine(tmp_path, [line(spans[:4] + [broken] + spans[5:])])
    assert [r["reason"] for r in q] == ["end_before_start"]
    assert q[0]["span_id"] == broken["spanId"]
    assert dataset.actions["agent"].tolist() == ["planner"]


def test_orphans_whose_parent_never_arrives(tmp_path):
    spans = own_episode(1, "e1")
    # the researcher's agent span is lost: its chat and tool spans point to a parent that never arrives
    dataset, report, q, _ = _mine(tmp_path, [line([s for s in spans if s["name"] != "invoke_agent researcher"])])
    assert q == []
    assert report.repaired_parents == 2
    acts = dataset.actions
    assert acts["agent"].tolist() == ["planner", "researcher"]
    assert acts["tool_calls"][1][0]["result"] == "30 days"


def test_multi_megabyte_attribute(tmp_path):
    spans = own_episode(1, "e1")
    huge = json.loads(json.dumps(spans[4]))
    huge["attributes"].append({"key": "app.blob", "value": {"stringValue": "x" * (3 * 2**20)}})
    dataset, report, q, _ = _mine(tmp_path, [line(spans[:4] + [huge] + spans[5:])], max_attribute_bytes=2**20)
    assert [r["reason"] for r in q] == ["attribute_too_large"]
    assert "app.blob" in q[0]["detail"]
    assert len(q[0]["span"]["attributes"][-1]["value"]["stringValue"]) == 3 * 2**20  # kept whole
    assert dataset.actions["agent"].tolist() == ["planner"]
    # with the default limit the same span is mined
    src = write(tmp_path / "again.jsonl", [line(spans[:4] + [huge] + spans[5:])])
    assert mine_with_report(src)[1].actions == 2


def test_duplicates_count_once(tmp_path):
    spans = own_episode(1, "e1")
    dataset, report, q, src = _mine(tmp_path, [line(spans), line(spans[2:4])])
    assert len(dataset.actions) == 2
    assert [r["reason"] for r in q] == ["duplicate", "duplicate"]
    assert q[0]["source"] == f"{src}:2" and f"{src}:1" in q[0]["detail"]


def test_bad_times(tmp_path):
    spans = own_episode(1, "e1")
    no_time = {k: v for k, v in spans[2].items() if k != "startTimeUnixNano"}
    dataset, report, q, _ = _mine(tmp_path, [line([no_time] + spans[3:])])
    assert [r["reason"] for r in q] == ["bad_time"]
    assert dataset.actions["agent"].tolist() == ["researcher"]


def test_tool_span_before_any_llm_call_of_its_episode(tmp_path):
    spans = own_episode(1, "e1")
    early = json.loads(json.dumps(spans[5]))
    early["spanId"] = f"{99:016x}"
    early["startTimeUnixNano"] = early["endTimeUnixNano"] = spans[0]["startTimeUnixNano"]
    dataset, report, q, src = _mine(tmp_path, [line(spans + [early])])
    assert [(r["reason"], r["span_id"], r["source"]) for r in q] == [("tool_without_action", early["spanId"], f"{src}:1")]
    assert dataset.actions["tool_calls"].map(len).tolist() == [0, 1]


def test_tool_span_without_any_action(tmp_path):
    tool = span(9, 1, None, "execute_tool lookup", 0, 1, {"gen_ai.operation.name": "execute_tool",
                                                         "gen_ai.tool.name": "lookup"})
    dataset, report, q, _ = _mine(tmp_path, [line(own_episode(1, "e1")), line([tool])])
    assert dataset.episode_ids == ["e1"]
    assert report.spans_without_actions == 1


def test_gzip_truncated_stream(tmp_path):
    import gzip

    data = gzip.compress((line(own_episode(1, "e1")) + "\n" + line(own_episode(2, "e2")) + "\n").encode())
    src = tmp_path / "cut.jsonl.gz"
    src.write_bytes(data[: len(data) - 30])
    q = tmp_path / "q.jsonl"
    dataset, report = mine_with_report(src, quarantine=q)
    reasons = [r["reason"] for r in _quarantined(q)]
    assert reasons and set(reasons) == {"invalid_json"}
    assert "e1" in dataset.episode_ids


def test_langgraph_context_of_the_wrong_type_is_read_as_text(tmp_path):
    """A checkpoint namespace or node sent as a number or a list (OpenInference `metadata` JSON, OpenLLMetry
    association properties) is read as its text, not a crash: it names the node run."""
    props = "traceloop.association.properties."

    def oi_call(trace, ns, node):
        meta = json.dumps({"langgraph_node": node, "langgraph_checkpoint_ns": ns, "langgraph_step": 1})
        return span(trace, 2, 1, "ChatModel", 1, 5, {
            "openinference.span.kind": "LLM", "metadata": meta, "llm.input_messages.0.message.role": "user",
            "llm.input_messages.0.message.content": "hi", "llm.output_messages.0.message.role": "assistant",
            "llm.output_messages.0.message.content": "hello there"})

    def traceloop_call(trace, ns, node):
        return span(trace, 2, 1, "ChatOpenAI.chat", 1, 5, {
            "traceloop.span.kind": "llm", props + "langgraph_node": node, props + "langgraph_checkpoint_ns": ns,
            "gen_ai.prompt.0.role": "user", "gen_ai.prompt.0.content": "hi",
            "gen_ai.completion.0.role": "assistant", "gen_ai.completion.0.content": "hello there"})

    lines = [line([span(1, 1, None, "LangGraph", 0, 10, {"openinference.span.kind": "CHAIN"}), oi_call(1, 5, 7)]),
             line([span(2, 1, None, "LangGraph", 0, 10, {"openinference.span.kind": "CHAIN"}),
                   oi_call(2, ["a|b"], "writer")]),
             line([span(3, 1, None, "LangGraph.workflow", 0, 10, {"traceloop.span.kind": "workflow"}),
                   traceloop_call(3, 9, 4)]),
             line([span(4, 1, None, "LangGraph.workflow", 0, 10, {"traceloop.span.kind": "workflow"}),
                   traceloop_call(4, ["x|y"], "critic")])]
    dataset, report, quarantined, _ = _mine(tmp_path, lines)
    assert report.episodes == 4 and quarantined == []
    assert dataset.actions["agent"].tolist() == ["7", "['a|b']", "4", "['x|y']"]  # the namespaces' text
