"""Put the plain app of `app.py` under marft_lg: serve its agents, wrap it, run it, mine the traces.

    python -m examples.wrap_existing.run                 # starts `marft-lg serve` on the embedded model
    python -m examples.wrap_existing.run --url http://127.0.0.1:8000/v1   # an already running server
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from examples.wrap_existing.app import build_graph

QUESTIONS = ["Why is the sky blue?", "What do bees make?", "Why do we have seasons?"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, port: int, log: Path, timeout_s: float = 300.0) -> subprocess.Popen:
    """`marft-lg serve` for the app's two roles, on loopback, in its own process group."""
    cmd = [sys.executable, "-m", "marft_lg.cli", "serve", "--model", model, "--agents", "researcher,writer",
           "--host", "127.0.0.1", "--port", str(port)]
    return start_process(cmd, f"http://127.0.0.1:{port}/health", log, timeout_s=timeout_s)


def start_process(cmd: list[str], health_url: str, log: Path, *, cwd: Path | None = None,
                  env: dict[str, str] | None = None, timeout_s: float = 300.0) -> subprocess.Popen:
    """Start a server in its own process group and wait until `health_url` answers 200 (stopped on failure)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[2:4]} exited with {proc.returncode}; see {log}:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(health_url, timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise TimeoutError(f"{cmd[2:4]} did not become healthy in {timeout_s:.0f}s; see {log}")


def stop_server(proc: subprocess.Popen) -> None:
    """Stop the server by its own pid (its process group), SIGKILL after 10 s."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run(url: str, trace_dir: Path, questions: list[str]) -> dict:
    """The few lines that put the app under marft_lg: wrap, invoke, mine."""
    from marft_lg import mine, wrap

    app = wrap(build_graph(url), trace_dir=trace_dir)  # same interface as the compiled graph
    answers = [app.invoke({"question": q}, scenario_id=f"q{i}")["answer"] for i, q in enumerate(questions)]
    app.flush()
    dataset = mine([trace_dir])  # spans -> episodes -> ordered agent actions
    return {"answers": answers, "dataset": dataset}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="base URL of a running OpenAI-compatible server (…/v1)")
    parser.add_argument("--model", default="embedded:smollm2-135m-instruct")
    parser.add_argument("--trace-dir", type=Path, default=Path("traces/wrap_existing"))
    args = parser.parse_args(argv)
    proc = None
    if args.url is None:
        port = free_port()
        args.trace_dir.mkdir(parents=True, exist_ok=True)
        proc = start_server(args.model, port, args.trace_dir / "server.log")
        args.url = f"http://127.0.0.1:{port}/v1"
    try:
        out = run(args.url, args.trace_dir, QUESTIONS)
    finally:
        if proc is not None:
            stop_server(proc)
    for q, a in zip(QUESTIONS, out["answers"], strict=True):
        print(f"Q: {q}\nA: {a}\n")
    actions = out["dataset"].actions
    print(f"mined {len(out['dataset'])} episodes, actions per agent: {actions['agent'].value_counts().to_dict()}")


if __name__ == "__main__":
    main()
