"""Mining throughput and memory: generate N-span trace files (own format, OpenInference) and mine them.

    .venv/bin/python benchmarks/mining.py                      # 1,000,000 spans per format
    .venv/bin/python benchmarks/mining.py --spans 100000       # quicker

Each mining run happens in a fresh subprocess so its peak RSS (ru_maxrss) is the run's own.
Episodes are the support-team shape (planner, two researchers with a tool call each, writer,
critic) with short prompts; the average bytes per span is reported next to the speed.
Results go to benchmarks/results/mining.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from marft_lg._provenance import code_state

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

T0 = 1_790_000_000_000_000_000
TARGET_SPANS_PER_S = 45_000  # with --out (`mine_to_parquet`), 2 workers; `mine()` is reported against it too
TARGET_PEAK_RSS_MB = 1536
LINES_BEFORE = "52332cd"  # the commit before the format engine: trajectories/ held C format code and fast twins


def _v(x):
    if isinstance(x, int) and not isinstance(x, bool):
        return {"intValue": str(x)}
    return {"stringValue": str(x)}


def _span(tid, sid, parent, name, start_ms, end_ms, attrs, error=False):
    out = {"traceId": tid, "spanId": f"{sid:016x}", "parentSpanId": f"{parent:016x}" if parent else "",
           "name": name, "kind": 1, "startTimeUnixNano": str(T0 + start_ms * 1_000_000),
           "endTimeUnixNano": str(T0 + end_ms * 1_000_000),
           "attributes": [{"key": k, "value": _v(v)} for k, v in attrs.items()],
           "status": {"code": 2, "message": "unknown topic"} if error else {"code": 1}}
    return out


# (agent, step, task, prompt, completion, tool)
_CALLS = [
    ("planner", 1, "p", "Customer question #{e}: how long is the refund window and is damage covered?",
     "TOPICS: refund_policy, warranty", None),
    ("researcher", 2, "r1", "Plan:\nTOPICS: refund_policy, warranty\nYour topic: refund_policy", "", "refund_policy"),
    ("researcher", 2, "r1", "Tool result: Refunds are accepted within 30 days of delivery.",
     "FINDING [refund_policy]: Refunds are accepted within 30 days of delivery.", None),
    ("researcher", 2, "r2", "Plan:\nTOPICS: refund_policy, warranty\nYour topic: warranty", "", "warranty"),
    ("researcher", 2, "r2", "Tool result: 2 year warranty; accidental damage is not covered.",
     "FINDING [warranty]: 2 year warranty; accidental damage is not covered.", None),
    ("writer", 3, "w", "Findings:\nFINDING [refund_policy]: Refunds are accepted within 30 days of delivery.\n"
     "FINDING [warranty]: 2 year warranty; accidental damage is not covered.",
     "ANSWER: 30 days for refunds; accidental damage is not covered. Thank you.", None),
    ("critic", 4, "c", "Draft:\nANSWER: 30 days for refunds; accidental damage is not covered. Thank you.",
     "APPROVE: the draft answers from the findings.", None),
]


def _ids(seed: int, n: int) -> list[int]:
    """Token ids spread over SmolLM2's 49,152-token vocabulary (small ints would be cached by Python)."""
    return [(seed * 7919 + i * 104729) % 49152 for i in range(n)]


def own_episode(e: int) -> list[dict]:
    from marft_lg.tracing import attributes as A

    tid = f"{e + 1:032x}"
    eid = f"ep-{e:08d}"
    spans = [_span(tid, 1, None, "invoke_workflow support_team", 0, 100, {
        A.GEN_AI_OPERATION_NAME: A.OP_WORKFLOW, A.MARFT_EPISODE_ID: eid, A.MARFT_SCENARIO_ID: f"s-{e % 50}",
        A.MARFT_OUTCOME: json.dumps({"answer": "30 days"})})]
    sid, t, agent_span = 2, 1, {}
    for agent, step, task, prompt, completion, tool in _CALLS:
        if task not in agent_span:
            agent_span[task] = sid
            spans.append(_span(tid, sid, 1, f"invoke_agent {agent}", t, t + 12, {
                A.GEN_AI_OPERATION_NAME: A.OP_AGENT, A.MARFT_AGENT_ROLE: agent, A.MARFT_EPISODE_ID: eid,
                A.MARFT_LANGGRAPH_STEP: step, A.MARFT_LANGGRAPH_TASK_ID: f"{eid}:{task}"}))
            sid += 1
        out_msg = {"role": "assistant", "content": completion}
        if tool:
            out_msg["tool_calls"] = [{"id": f"call-{task}", "name": "lookup", "args": {"topic": tool}}]
        spans.append(_span(tid, sid, agent_span[task], f"chat {agent}", t + 1, t + 5, {
            A.GEN_AI_OPERATION_NAME: A.OP_CHAT, A.MARFT_AGENT_ROLE: agent, A.MARFT_EPISODE_ID: eid,
            A.MARFT_LANGGRAPH_STEP: step, A.MARFT_LANGGRAPH_TASK_ID: f"{eid}:{task}",
            A.GEN_AI_INPUT_MESSAGES: A.to_genai_messages([{"role": "system", "content": f"You are the {agent}."},
                                                           {"role": "user", "content": prompt.format(e=e)}]),
            A.GEN_AI_OUTPUT_MESSAGES: A.to_genai_messages([out_msg]),
            A.MARFT_PROMPT_TOKEN_IDS: A.encode_ints(_ids(e, 40)), A.MARFT_COMPLETION_TOKEN_IDS: A.encode_ints(_ids(e + 1, 12)),
            A.MARFT_COMPLETION_LOGPROBS: A.encode_floats([-0.1 - 0.01 * i for i in range(12)]), A.MARFT_ADAPTER_VERSION: "v1",
            A.GEN_AI_RESPONSE_MODEL: "smollm2-135m", A.GEN_AI_USAGE_INPUT_TOKENS: 40, A.GEN_AI_USAGE_OUTPUT_TOKENS: 12}))
        sid += 1
        if tool:
            spans.append(_span(tid, sid, agent_span[task], "execute_tool lookup", t + 6, t + 7, {
                A.GEN_AI_OPERATION_NAME: A.OP_TOOL, A.GEN_AI_TOOL_NAME: "lookup", A.GEN_AI_TOOL_CALL_ID: f"call-{task}",
                A.MARFT_EPISODE_ID: eid, A.GEN_AI_TOOL_CALL_ARGUMENTS: json.dumps({"topic": tool}),
                A.GEN_AI_TOOL_CALL_RESULT: "entry text"}))
            sid += 1
        t += 10
    return spans


def openinference_episode(e: int) -> list[dict]:
    tid = f"{e + 1:032x}"
    eid = f"session-{e:08d}"
    spans = [_span(tid, 1, None, "LangGraph", 0, 100, {
        "openinference.span.kind": "CHAIN", "session.id": eid, "output.value": json.dumps({"answer": "30 days"}),
        "metadata": json.dumps({"thread_id": eid, "scenario_id": f"s-{e % 50}"})})]
    sid, t, node_span = 2, 1, {}
    for agent, step, task, prompt, completion, tool in _CALLS:
        ns = f"{agent}:{e:08d}-{task}"
        meta = json.dumps({"thread_id": eid, "langgraph_step": step, "langgraph_node": agent,
                           "langgraph_triggers": ["branch:to:" + agent], "langgraph_checkpoint_ns": ns, "checkpoint_ns": ns})
        if task not in node_span:
            node_span[task] = sid
            spans.append(_span(tid, sid, 1, agent, t, t + 12, {
                "openinference.span.kind": "CHAIN", "session.id": eid, "metadata": meta}))
            sid += 1
        attrs = {"openinference.span.kind": "LLM", "session.id": eid, "metadata": meta,
                 "llm.input_messages.0.message.role": "system", "llm.input_messages.0.message.content": f"You are the {agent}.",
                 "llm.input_messages.1.message.role": "user", "llm.input_messages.1.message.content": prompt.format(e=e),
                 "llm.output_messages.0.message.role": "assistant", "llm.output_messages.0.message.content": completion,
                 "llm.model_name": "smollm2-135m", "llm.token_count.prompt": 40, "llm.token_count.completion": 12}
        if tool:
            attrs.update({"llm.output_messages.0.message.tool_calls.0.tool_call.id": f"call-{task}",
                          "llm.output_messages.0.message.tool_calls.0.tool_call.function.name": "lookup",
                          "llm.output_messages.0.message.tool_calls.0.tool_call.function.arguments": json.dumps({"topic": tool})})
        spans.append(_span(tid, sid, node_span[task], "ChatModel", t + 1, t + 5, attrs))
        sid += 1
        if tool:
            spans.append(_span(tid, sid, node_span[task], "lookup", t + 6, t + 7, {
                "openinference.span.kind": "TOOL", "tool.name": "lookup", "input.value": tool,
                "output.value": "entry text", "session.id": eid, "metadata": meta}))
            sid += 1
        t += 10
    return spans


GENERATORS = {"own": own_episode, "openinference": openinference_episode}


def generate(fmt: str, n_spans: int, path: Path) -> dict:
    """Write episodes until `n_spans` spans; a few episodes per line, as a batching exporter would."""
    import orjson

    make = GENERATORS[fmt]
    written, e = 0, 0
    with path.open("wb") as fh:
        while written < n_spans:
            batch = []
            while len(batch) < 64 and written + len(batch) < n_spans:
                spans = make(e)
                e += 1
                batch.extend(spans[: n_spans - written - len(batch)])
            fh.write(orjson.dumps({"resourceSpans": [{"resource": {"attributes": []},
                                                      "scopeSpans": [{"scope": {"name": "bench"}, "spans": batch}]}]}))
            fh.write(b"\n")
            written += len(batch)
    return {"spans": written, "episodes_generated": e, "file_bytes": path.stat().st_size}


_CHILD = """
import json, resource, sys, tempfile, threading, time
import psutil
from marft_lg.trajectories.mining import mine_to_parquet, mine_with_report

peak = [0]
stop = threading.Event()

def watch():  # the whole process tree: mining runs worker processes (spawned here, so no page is shared)
    me = psutil.Process()
    while not stop.is_set():
        rss = 0
        for p in [me, *me.children(recursive=True)]:
            try:
                rss += p.memory_info().rss
            except psutil.Error:
                pass
        peak[0] = max(peak[0], rss)
        stop.wait(0.1)

threading.Thread(target=watch, daemon=True).start()
workers = None if sys.argv[3] == "auto" else int(sys.argv[3])
t = time.perf_counter()
if sys.argv[2] == "memory":
    ds, rep = mine_with_report(sys.argv[1], workers=workers)
else:
    with tempfile.TemporaryDirectory() as out:
        rep = mine_to_parquet(sys.argv[1], out, workers=workers)
dt = time.perf_counter() - t
stop.set()
me = resource.getrusage(resource.RUSAGE_SELF)
kids = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"seconds": dt, "cpu_seconds": me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime,
                  "parent_cpu_seconds": me.ru_utime + me.ru_stime,
                  "episodes": rep.episodes, "actions": rep.actions, "spans_kept": rep.spans_kept,
                  "quarantined": rep.quarantined_total,
                  "peak_rss_mb": max(peak[0] / 2**20, me.ru_maxrss / 1024),
                  "parent_peak_rss_mb": me.ru_maxrss / 1024, "largest_worker_peak_rss_mb": kids.ru_maxrss / 1024}))
"""


def measure(path: Path, mode: str, workers: str = "auto") -> dict:
    """Mine `path` in a fresh process: `memory` = `mine()` (the whole dataset in RAM), `parquet` = `marft-lg mine --out`.
    Peak memory (`peak_rss_mb`) is the largest RSS summed over the process and its mining workers (sampled every
    100 ms; the sampling thread makes mining spawn its workers, so they share no pages), and at least the
    parent's own ru_maxrss."""
    out = subprocess.run([sys.executable, "-c", _CHILD, str(path), mode, workers], capture_output=True, text=True,
                         check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return json.loads(out.stdout.strip().splitlines()[-1])


def _console():
    try:
        from rich.console import Console

        return Console()
    except ImportError:  # a bare machine: plain prints
        import contextlib

        class Plain:
            print = staticmethod(print)

            @staticmethod
            def status(text):
                print(text, flush=True)
                return contextlib.nullcontext()

        return Plain()


NOTE = ("'runs' = the latest `python benchmarks/mining.py` (spans_per_s: wall; spans_per_cpu_s: CPU time of the"
        " process and its workers; peak_rss_mb: RSS summed over the process and its workers). 'before' = the"
        " one-process miner on an idle 16-core Xeon pinned to 2 cores; 'history' = earlier measurements kept for"
        " comparison (those under load say so).")


def _with_history(results: dict, out: Path) -> dict:
    """The new results, keeping the 'before' section and earlier runs of an existing results file."""
    previous = json.loads(out.read_text()) if out.exists() else {}
    history = dict(previous.get("history", {}))
    for key, value in previous.items():
        if key not in ("note", "targets", "before", "history", "machine", "runs"):
            history.setdefault(key, value)
    if "runs" in previous:
        history[f"previous_run_{previous.get('machine', {}).get('finished', 'unknown')}"] = {
            "machine": previous.get("machine"), "runs": previous["runs"]}
    return {**{k: results[k] for k in ("commit", "dirty") if k in results}, "note": NOTE, **results, **({"before": previous["before"]} if "before" in previous else {}),
            "history": history}


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True, cwd=ROOT).stdout


def trajectories_lines(rev: str | None = None) -> dict:
    """Lines of `marft_lg/trajectories` (Python and C, by file kind) in the working tree or at git revision `rev`."""
    if rev is None:
        files = [p for p in (ROOT / "marft_lg" / "trajectories").rglob("*") if p.suffix in (".py", ".c")]
        texts = {str(p.relative_to(ROOT)): p.read_text() for p in files}
    else:
        names = [n for n in _git("ls-tree", "-r", "--name-only", rev, "marft_lg/trajectories").split()
                 if n.endswith((".py", ".c"))]
        texts = {n: _git("show", f"{rev}:{n}") for n in names}
    out = {"python": 0, "c": 0}
    for name, text in texts.items():
        out["c" if name.endswith(".c") else "python"] += text.count("\n")
    return {**out, "total": out["python"] + out["c"]}


def _code_state() -> dict:
    """The commit measured (and whether the tree had changes), and the trajectories line counts."""
    try:
        state = code_state()
        state["trajectories_lines"] = {"now": trajectories_lines(), f"at {LINES_BEFORE}": trajectories_lines(LINES_BEFORE)}
    except (subprocess.CalledProcessError, FileNotFoundError):  # not a git checkout
        state = {"commit": None, "trajectories_lines": {"now": trajectories_lines()}}
    return state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=1_000_000)
    parser.add_argument("--formats", default="own,openinference")
    parser.add_argument("--modes", default="parquet,memory", help="parquet: marft-lg mine --out; memory: mine()")
    parser.add_argument("--workers", default="auto",
                        help="mining worker processes, comma-separated to compare (auto: one per usable core)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep (and reuse) generated files here")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "mining.json")
    parser.add_argument("--conditions", default="",
                        help="how the machine was used meanwhile (e.g. 'quiet, nice -10'); kept with the results")
    args = parser.parse_args()
    console = _console()
    results = {**_code_state(), "machine": {"cpus": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)), "python": platform.python_version(), "platform": platform.platform(),
                           "load_average_at_start": os.getloadavg(), "nice": os.nice(0),
                           **({"conditions": args.conditions} if args.conditions else {})},
               "targets": {"spans_per_s": TARGET_SPANS_PER_S, "peak_rss_mb": TARGET_PEAK_RSS_MB}, "runs": {}}
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="marft-mining-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    for fmt in args.formats.split(","):
        path = workdir / f"{fmt}-{args.spans}.jsonl"
        meta = path.with_suffix(".json")
        if path.exists() and meta.exists():
            gen = json.loads(meta.read_text())
        else:
            with console.status(f"generating {args.spans:,} {fmt} spans"):
                gen = generate(fmt, args.spans, path)
            meta.write_text(json.dumps(gen))
        for mode in args.modes.split(","):
            for workers in args.workers.split(","):
                name = f"{fmt}/{mode}" if workers == "auto" else f"{fmt}/{mode}/workers={workers}"
                with console.status(f"mining {name}"):
                    t = time.perf_counter()
                    run = measure(path, mode, workers)
                    wall = time.perf_counter() - t
                rate = gen["spans"] / run["seconds"]
                results["runs"][name] = {
                    "format": fmt, "mode": mode, "workers": workers, **gen, **run,
                    "bytes_per_span": round(gen["file_bytes"] / gen["spans"]),
                    "spans_per_s": round(rate), "spans_per_cpu_s": round(gen["spans"] / run["cpu_seconds"]),
                    "process_wall_s": round(wall, 2),
                    "meets_speed_target": rate >= TARGET_SPANS_PER_S if mode == "parquet" else None,
                    "meets_memory_target": run["peak_rss_mb"] <= TARGET_PEAK_RSS_MB}
                console.print(f"{name}: {gen['spans']:,} spans ({gen['file_bytes'] / 2**20:.0f} MiB) in"
                              f" {run['seconds']:.1f} s = {rate:,.0f} spans/s ({gen['spans'] / run['cpu_seconds']:,.0f}"
                              f" per CPU-s, parent {run['parent_cpu_seconds']:.1f} CPU-s), peak RSS {run['peak_rss_mb']:.0f} MB"
                              f" (parent {run['parent_peak_rss_mb']:.0f}, largest worker {run['largest_worker_peak_rss_mb']:.0f}),"
                              f" {run['episodes']:,} episodes, {run['actions']:,} actions")
    results["machine"]["load_average_at_end"] = os.getloadavg()
    results["machine"]["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if args.workdir is None:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(_with_history(results, args.out), indent=2) + "\n")
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
