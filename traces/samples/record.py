"""Record the committed sample traces: the support_team example on a scripted chat model, traced by
real instrumentors, plus a truth file of what the recording run itself observed.

    python traces/samples/record.py openinference   # -> traces/samples/openinference.jsonl
    python traces/samples/record.py openllmetry     # -> traces/samples/openllmetry.jsonl
    python traces/samples/record.py own             # -> traces/samples/own.jsonl (needs marft_lg.graph.wrap)

The truth (``<format>.truth.json``) comes from a LangChain callback handler watching the same run,
not from the spans: per episode, the agent of every LLM call in order, tool errors per call, and
the dependencies the app's prompts are built from (see `expected_dependencies`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from langchain_core.callbacks import BaseCallbackHandler  # noqa: E402
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult  # noqa: E402

from examples.support_team.app import SCENARIOS, build_graph  # noqa: E402
from examples.support_team.fake import FakeSupportModel  # noqa: E402
from marft_lg.trajectories.scenarios import ScenarioSet  # noqa: E402

HERE = Path(__file__).resolve().parent
# one topic; two topics fanned out with Send; a tool error; the critic loop hitting its cap
SCENARIO_IDS = ["support-warranty-refund", "support-gift-card", "support-urgent-password"]


class CollectingExporter(SpanExporter):
    """Keeps finished spans; `flush_line` writes them as one OTLP/JSON line (one export batch)."""

    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.spans.extend(spans)
        return SpanExportResult.SUCCESS

    def flush_line(self, fh: Any) -> int:
        from marft_lg.tracing.otlp_json import dumps_request

        n = len(self.spans)
        if n:
            fh.write(dumps_request(self.spans) + "\n")
        self.spans = []
        return n


class CallLog(BaseCallbackHandler):
    """What the run knew: every chat-model call (node, task, completion) and every tool error."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self._open: dict[Any, dict[str, Any]] = {}
        self._node_run: dict[Any, Any] = {}

    def on_chat_model_start(self, serialized, messages, *, run_id, parent_run_id=None, metadata=None, **kw):
        md = metadata or {}
        call = {"agent": md.get("langgraph_node"), "step": md.get("langgraph_step"),
                "task": md.get("langgraph_checkpoint_ns") or md.get("checkpoint_ns"), "tool_errors": 0, "completion": None}
        self.calls.append(call)
        self._open[run_id] = call

    def on_llm_end(self, response, *, run_id, **kw):
        call = self._open.pop(run_id, None)
        if call is not None:
            call["completion"] = response.generations[0][0].text

    def on_tool_start(self, serialized, input_str, *, run_id, metadata=None, **kw):
        md = metadata or {}
        self._node_run[run_id] = md.get("langgraph_checkpoint_ns") or md.get("checkpoint_ns")

    def on_tool_error(self, error, *, run_id, **kw):
        task = self._node_run.get(run_id)
        issuer = next(c for c in reversed(self.calls) if c["task"] == task)
        issuer["tool_errors"] += 1


def expected_dependencies(calls: list[dict[str, Any]]) -> list[list[int]]:
    """The app's prompt wiring: researchers quote the plan, the writer and critic quote the findings,
    a revising writer quotes its previous draft and the critique, the critic quotes the latest draft;
    an agent also sees its own earlier calls in the same node run."""
    deps: list[list[int]] = []
    for i, c in enumerate(calls):
        earlier = calls[:i]
        d = {j for j, e in enumerate(earlier) if e["task"] == c["task"]}
        finals = {}
        for j, e in enumerate(earlier):
            if e["agent"] == "researcher":
                finals[e["task"]] = j
        if c["agent"] == "researcher":
            d |= {j for j, e in enumerate(earlier) if e["agent"] == "planner"}
        elif c["agent"] in ("writer", "critic"):
            d |= set(finals.values())
            writers = [j for j, e in enumerate(earlier) if e["agent"] == "writer"]
            critics = [j for j, e in enumerate(earlier) if e["agent"] == "critic"]
            if c["agent"] == "critic" and writers:
                d.add(writers[-1])
            if c["agent"] == "writer" and critics:
                d |= {writers[-1], critics[-1]}
        deps.append(sorted(d))
    return deps


def instrument(fmt: str, provider: TracerProvider) -> None:
    if fmt == "openinference":
        from openinference.instrumentation.langchain import LangChainInstrumentor

        LangChainInstrumentor().instrument(tracer_provider=provider)
    elif fmt == "openllmetry":
        from opentelemetry.instrumentation.langchain import LangchainInstrumentor

        LangchainInstrumentor().instrument(tracer_provider=provider)
    else:
        raise SystemExit(f"unknown format {fmt!r}")


def record_third_party(fmt: str, out: Path) -> dict[str, Any]:
    exporter = CollectingExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrument(fmt, provider)
    graph = build_graph(FakeSupportModel())
    scenarios = ScenarioSet.load(SCENARIOS).by_id()
    truth: dict[str, Any] = {"format": fmt, "episodes": {}}
    with out.open("w", encoding="utf-8") as fh:
        for sid in SCENARIO_IDS:
            log = CallLog()
            episode_id = f"{fmt}-{sid}"
            graph.invoke(scenarios[sid]["inputs"], {
                "max_concurrency": 1, "callbacks": [log],
                "configurable": {"thread_id": episode_id},
                "metadata": {"session_id": episode_id, "scenario_id": sid},
            })
            exporter.flush_line(fh)
            truth["episodes"][episode_id] = describe(sid, log.calls)
    return truth


def record_own(out: Path) -> dict[str, Any]:
    try:
        from marft_lg.graph.wrap import wrap
    except ImportError as exc:
        raise SystemExit(f"own format needs marft_lg.graph.wrap, which is not importable yet ({exc})") from exc
    import tempfile

    graph = build_graph(FakeSupportModel())
    scenarios = ScenarioSet.load(SCENARIOS).by_id()
    truth: dict[str, Any] = {"format": "own", "episodes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        app = wrap(graph, trace_dir=tmp)
        for sid in SCENARIO_IDS:
            log = CallLog()
            episode_id = f"own-{sid}"
            app.invoke(scenarios[sid]["inputs"], {"max_concurrency": 1, "callbacks": [log]},
                       episode_id=episode_id, scenario_id=sid)
            truth["episodes"][episode_id] = describe(sid, log.calls)
        app.flush()
        lines = [ln for f in sorted(Path(tmp).rglob("*.jsonl")) for ln in f.read_text().splitlines() if ln.strip()]
    out.write_text("\n".join(lines) + "\n")
    return truth


def describe(scenario_id: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    agents = [c["agent"] for c in calls]
    return {
        "scenario_id": scenario_id,
        "n_actions": len(calls),
        "agents": agents,
        "actions_per_agent": {a: agents.count(a) for a in sorted(set(agents))},
        "tool_errors": [c["tool_errors"] for c in calls],
        "depends_on": expected_dependencies(calls),
        "completions": [c["completion"] for c in calls],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("format", choices=["openinference", "openllmetry", "own"])
    args = parser.parse_args()
    out = HERE / f"{args.format}.jsonl"
    truth = record_own(out) if args.format == "own" else record_third_party(args.format, out)
    (HERE / f"{args.format}.truth.json").write_text(json.dumps(truth, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {out} ({out.stat().st_size} bytes) and its truth file")


if __name__ == "__main__":
    main()
