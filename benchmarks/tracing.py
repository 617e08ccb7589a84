"""Per-LLM-call overhead of `wrap` on a 4-node graph with an instant fake engine.

Runs the same graph unwrapped and wrapped (TeamChatModel routing + spans to the JSONL exporter),
interleaving the two so machine load hits both alike, and reports the median added latency per
LLM call and the throughput ratio wrapped/unwrapped (span export included: the exporter is
flushed inside the timed window). Optionally also with a fixed engine latency (`--latency-ms`)
to show the overhead against a model that takes time. Results: benchmarks/results/tracing.json.

    .venv/bin/python benchmarks/tracing.py --calls 1000
"""

from __future__ import annotations

import argparse
import json
import operator
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Annotated, TypedDict

from langgraph.graph import END, START, StateGraph
from rich.console import Console
from rich.progress import track
from rich.table import Table

from marft_lg.graph import TeamChatModel, wrap
from marft_lg.serving.types import ChatRequest, Completion

NODES = ("planner", "researcher", "writer", "critic")


class InstantEngine:
    """A ChatEngine that answers at once (or after `latency_s`) with a fixed 8-token completion."""

    model_name = "instant"

    def __init__(self, latency_s: float = 0.0):
        self.latency_s = latency_s

    def agents(self):
        return list(NODES)

    def versions(self):
        return dict.fromkeys(NODES, "v1")

    def chat(self, requests: list[ChatRequest]) -> list[Completion]:
        if self.latency_s:
            time.sleep(self.latency_s)
        return [Completion(text=f"{r.agent} ok", prompt_token_ids=list(range(32)), completion_token_ids=list(range(8)),
                           logprobs=[-0.1] * 8, agent=r.agent, adapter_version="v1", model=self.model_name)
                for r in requests]

    async def achat(self, requests):
        return self.chat(requests)


class State(TypedDict):
    msgs: Annotated[list, operator.add]


def build(llm):
    g = StateGraph(State)
    prev = START
    for name in NODES:
        g.add_node(name, lambda s, name=name: {"msgs": [llm.invoke(f"{name}: {s['msgs'][-1]}").content]})
        g.add_edge(prev, name)
        prev = name
    g.add_edge(prev, END)
    return g.compile()


def measure(calls: int, latency_s: float, warmup: int = 10) -> dict:
    engine = InstantEngine(latency_s)
    plain = build(TeamChatModel(team=engine, seed=0))
    episodes = max(1, calls // len(NODES))
    with tempfile.TemporaryDirectory() as tmp:
        app = wrap(build(TeamChatModel(seed=0)), team=engine, trace_dir=tmp)
        for _ in range(warmup):
            plain.invoke({"msgs": ["go"]})
            app.invoke({"msgs": ["go"]}, seed=0)
        app.flush()
        t_plain, t_wrapped = [], []
        cpu_plain = cpu_wrapped = 0.0
        for i in track(range(episodes), description=f"latency {latency_s * 1000:.0f} ms", transient=True):
            order = (0, 1) if i % 2 == 0 else (1, 0)
            for which in order:
                c0, t0 = time.process_time(), time.perf_counter()
                if which == 0:
                    plain.invoke({"msgs": ["go"]})
                    t_plain.append(time.perf_counter() - t0)
                    cpu_plain += time.process_time() - c0
                else:
                    app.invoke({"msgs": ["go"]}, seed=0)
                    t_wrapped.append(time.perf_counter() - t0)
                    cpu_wrapped += time.process_time() - c0
        c0, t0 = time.process_time(), time.perf_counter()
        app.flush()
        flush_s = time.perf_counter() - t0
        cpu_wrapped += time.process_time() - c0
        spans_bytes = sum(p.stat().st_size for p in Path(tmp).glob("*.jsonl"))
        app.close()
    total_plain, total_wrapped = sum(t_plain), sum(t_wrapped) + flush_s
    n_calls = episodes * len(NODES)
    return {
        "engine_latency_ms": latency_s * 1000,
        "llm_calls": n_calls,
        "median_call_ms_unwrapped": statistics.median(t_plain) / len(NODES) * 1000,
        "median_call_ms_wrapped": statistics.median(t_wrapped) / len(NODES) * 1000,
        "median_added_ms_per_call": (statistics.median(t_wrapped) - statistics.median(t_plain)) / len(NODES) * 1000,
        "throughput_calls_per_s_unwrapped": n_calls / total_plain,
        "throughput_calls_per_s_wrapped": n_calls / total_wrapped,
        "throughput_ratio": total_plain / total_wrapped,
        "cpu_ms_per_call_unwrapped": cpu_plain / n_calls * 1000,
        "cpu_ms_per_call_wrapped": cpu_wrapped / n_calls * 1000,
        "cpu_added_ms_per_call": (cpu_wrapped - cpu_plain) / n_calls * 1000,
        "cpu_throughput_ratio": cpu_plain / cpu_wrapped,
        # On an idle core a call costs its CPU time plus the engine's latency: the ratio to expect there.
        "idle_core_throughput_ratio_estimate": (latency_s * n_calls + cpu_plain) / (latency_s * n_calls + cpu_wrapped),
        "final_flush_ms": flush_s * 1000,
        "trace_bytes_per_call": spans_bytes / n_calls,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--latency-ms", type=float, nargs="*", default=[0.0, 20.0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "tracing.json"))
    args = parser.parse_args()
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:  # pragma: no cover
        pass
    runs = [measure(args.calls, ms / 1000) for ms in args.latency_ms]
    result = {
        "benchmark": "tracing",
        "graph": f"{len(NODES)}-node linear StateGraph, one TeamChatModel call per node",
        "targets": {"median_added_ms_per_call": "< 1", "throughput_ratio": ">= 0.95"},
        "machine": {"python": platform.python_version(), "cpu": platform.processor() or platform.machine(),
                    "load_avg_1m": _load()},
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    table = Table(title="wrap() overhead per LLM call")
    for col in ("engine latency", "calls", "median added (wall)", "ratio (wall)", "added CPU/call",
                "ratio (idle-core est.)"):
        table.add_column(col)
    for r in runs:
        table.add_row(f"{r['engine_latency_ms']:.0f} ms", str(r["llm_calls"]), f"{r['median_added_ms_per_call']:.3f} ms",
                      f"{r['throughput_ratio']:.3f}", f"{r['cpu_added_ms_per_call']:.3f} ms",
                      f"{r['idle_core_throughput_ratio_estimate']:.3f}")
    Console().print(table)


def _load() -> float | None:
    try:
        import os

        return round(os.getloadavg()[0], 2)
    except OSError:  # pragma: no cover
        return None


if __name__ == "__main__":
    main()
