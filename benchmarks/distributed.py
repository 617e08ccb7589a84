"""Rollouts past one process: orchestration overhead on Ray, the embedded model on 1 vs 2 workers, and the cost of an
on-policy iteration as iterations accumulate.

    .venv/bin/python benchmarks/distributed.py                 # everything (~5 minutes on 2 cores)
    .venv/bin/python benchmarks/distributed.py --only scaling  # one part: scaling | embedded | iteration_cost

- scaling: n = 1, 2, 4, 8 rollout workers on a local Ray cluster, each answering every LLM call after a fixed 50 ms
  (`tests/unit/distributed/ray_apps.py:FixedLatencyEngine`), one episode at a time per worker: what the
  orchestration itself costs, not this machine's two cores. Efficiency = episodes/s at n / (n x episodes/s at 1).
- embedded: the real SmolLM2-135M on 1 and 2 workers of this machine (reported, no target).
- iteration_cost: 30 on-policy collections through a wrapped app on the tiny random model, read back from the app's
  own records (today's collector) and, for contrast, by mining the trace directory after each (the old collector).
Results go to benchmarks/results/distributed.json with the commit they were measured at.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
APPS = ROOT / "tests" / "unit" / "distributed" / "ray_apps.py"
AGENTS = ["planner", "writer"]
TARGET_EFFICIENCY_AT_8 = 0.9
TARGET_ITERATION_RATIO = 1.1


def _scenarios(n: int):
    from marft_lg.trajectories.scenarios import Scenario

    return [Scenario(f"s{i}", {"msgs": [f"question {i}"]}) for i in range(n)]


def _ray(num_cpus: int):
    import ray

    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    ray.init(num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1", configure_logging=False,
             log_to_driver=False, _temp_dir=tempfile.mkdtemp(prefix="ray", dir="/tmp"))
    return ray


def scaling(workers=(1, 2, 4, 8), per_worker: int = 24, latency_s: float = 0.05) -> dict:
    from marft_lg.distributed.config import RayConfig, WorkerResources
    from marft_lg.distributed.rollout import RayCollector
    from marft_lg.distributed.worker import WorkerSpec

    ray = _ray(num_cpus=max(workers))
    rows = []
    try:
        for n in workers:
            spec = WorkerSpec(app=f"{APPS}:two_agents", agents=AGENTS, engine=f"{APPS}:FixedLatencyEngine",
                              engine_options={"latency_s": latency_s}, concurrency=1)
            cfg = RayConfig(address="auto", rollout_workers=n, worker=WorkerResources(num_cpus=1))
            with RayCollector(cfg, spec, run_id=f"n{n}") as collector:
                collector.collect(_scenarios(n), 2, 0, seed=0)  # warm-up: imports, first graph compile
                times = []
                for it in range(1, 4):
                    t = time.perf_counter()
                    ds = collector.collect(_scenarios(n * per_worker // 2), 2, it, seed=0)
                    times.append(time.perf_counter() - t)
                    assert len(ds.episodes) == n * per_worker
            rate = n * per_worker / statistics.median(times)
            rows.append({"workers": n, "episodes_per_s": round(rate, 2), "episodes_per_iteration": n * per_worker,
                         "iteration_s": [round(x, 3) for x in times]})
            print(f"scaling: {n} workers: {rate:.1f} episodes/s", flush=True)
    finally:
        ray.shutdown()
    base = rows[0]["episodes_per_s"]
    for r in rows:
        r["efficiency"] = round(r["episodes_per_s"] / (r["workers"] * base), 3)
    return {"scaling": rows, "latency_s_per_call": latency_s, "calls_per_episode": 2,
            "meets_target": rows[-1]["efficiency"] >= TARGET_EFFICIENCY_AT_8}


def embedded(episodes: int = 16, max_tokens: int = 32) -> dict:
    from marft_lg.distributed.config import RayConfig, WorkerResources
    from marft_lg.distributed.rollout import RayCollector
    from marft_lg.distributed.worker import WorkerSpec
    from marft_lg.serving.engine.models import resolve_model

    model = str(resolve_model("embedded:smollm2-135m-instruct"))
    ray = _ray(num_cpus=2)
    out = []
    try:
        for n in (1, 2):
            spec = WorkerSpec(app=f"{APPS}:two_agents", agents=AGENTS, model=model, max_tokens=max_tokens,
                              concurrency=8)
            with RayCollector(RayConfig(address="auto", rollout_workers=n, worker=WorkerResources(num_cpus=1)),
                              spec, run_id=f"e{n}") as collector:
                collector.collect(_scenarios(2), 1, 0, seed=0)
                t = time.perf_counter()
                ds = collector.collect(_scenarios(episodes), 1, 1, seed=0)
                dt = time.perf_counter() - t
            tokens = int(ds.actions["completion_token_ids"].map(len).sum())
            out.append({"workers": n, "episodes": episodes, "seconds": round(dt, 2),
                        "episodes_per_s": round(episodes / dt, 3), "completion_tokens_per_s": round(tokens / dt, 1)})
            print(f"embedded: {n} workers: {episodes / dt:.2f} episodes/s, {tokens / dt:.0f} tokens/s", flush=True)
    finally:
        ray.shutdown()
    return {"embedded": out, "max_tokens": max_tokens}


def iteration_cost(iterations: int = 30, scenarios: int = 8, k: int = 2) -> dict:
    from marft_lg.graph.chat_model import TeamChatModel
    from marft_lg.graph.collect import GraphCollector
    from marft_lg.graph.wrap import wrap
    from marft_lg.loading import load_object
    from marft_lg.serving.engine.models import build_tiny_model
    from marft_lg.serving.team import Team

    model = str(build_tiny_model(Path(tempfile.mkdtemp()) / "tiny"))
    team = Team(model, AGENTS, seed=0)
    build = load_object(f"{APPS}:two_agents")
    out = {}
    for name in ("records", "trace_files"):
        trace_dir = Path(tempfile.mkdtemp())
        app = wrap(build(TeamChatModel(team=team, max_tokens=8)), team=team, trace_dir=trace_dir)
        target = app if name == "records" else _WithoutCapture(app)  # the old collector mined the folder each time
        collector = GraphCollector(target, run_id=name, trace_dir=trace_dir)
        times = []
        for it in range(iterations):
            t = time.perf_counter()
            collector.collect(_scenarios(scenarios), k, it, seed=0)
            times.append(time.perf_counter() - t)
        app.close()
        # single iterations vary by +-30% (thread scheduling): compare means of ten, and fit a slope
        first, last = statistics.mean(times[1:11]), statistics.mean(times[-10:])
        slope = statistics.linear_regression(range(len(times) - 1), times[1:]).slope
        out[name] = {"iteration_s": [round(x, 4) for x in times], "mean_iterations_2_to_11_s": round(first, 4),
                     "mean_last_10_s": round(last, 4), "ratio_last_to_first": round(last / first, 3),
                     "slope_ms_per_iteration": round(slope * 1000, 2),
                     "ratio_iteration_30_to_1": round(times[-1] / times[0], 3)}
        print(f"iteration cost ({name}): {first * 1000:.0f} ms -> {last * 1000:.0f} ms ({last / first:.2f}x), "
              f"{slope * 1000:+.2f} ms per iteration", flush=True)
    team.close()
    out["meets_target"] = out["records"]["ratio_last_to_first"] <= TARGET_ITERATION_RATIO
    return {"iteration_cost": out, "episodes_per_iteration": scenarios * k}


class _WithoutCapture:
    """A wrapped app seen without `capture`, so the collector mines its trace files (the pre-[scale] behaviour)."""

    def __init__(self, app):
        self._app = app

    def invoke(self, *args, **kwargs):
        return self._app.invoke(*args, **kwargs)

    def flush(self):
        return self._app.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("scaling", "embedded", "iteration_cost"), default=None)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "distributed.json")
    args = parser.parse_args()
    previous = json.loads(args.out.read_text()) if args.out.exists() else {}
    from marft_lg._provenance import code_state

    state = code_state()
    results = {**previous, **state,
               "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                           "load_average_at_start": os.getloadavg()},
               "targets": {"efficiency_at_8_workers": TARGET_EFFICIENCY_AT_8,
                           "iteration_30_over_iteration_1": TARGET_ITERATION_RATIO}}
    parts = {"scaling": scaling, "embedded": embedded, "iteration_cost": iteration_cost}
    for name, run in parts.items():
        if args.only in (None, name):
            results.update(run())
            results.setdefault("measured_at", {})[name] = {**state,
                                                           "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
