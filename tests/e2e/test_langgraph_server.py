"""A wrapped graph named in a langgraph.json, run by LangGraph's API server (in-memory runtime): one episode per
run created through langgraph_sdk (runs.wait; runs.stream with messages, updates and events), ids from run metadata."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from examples.wrap_existing.run import free_port, start_process, stop_server
from marft_lg import mine

pytestmark = pytest.mark.e2e
HERE = Path(__file__).resolve().parent
APP = '''
import os
from marft_lg import wrap
from tool_apps import ToolFake, hand_written_supervisor
graph = wrap(hand_written_supervisor(ToolFake()), trace_dir=os.environ["MARFT_LG_TRACE_DIR"])
'''


def test_langgraph_api_server_runs_are_episodes(tmp_path):
    pytest.importorskip("langgraph_api")
    pytest.importorskip("langgraph_sdk")
    shutil.copy(HERE.parent / "unit" / "graph" / "tool_apps.py", tmp_path / "tool_apps.py")
    (tmp_path / "app.py").write_text(APP)
    (tmp_path / "langgraph.json").write_text('{"dependencies": ["."], "graphs": {"team": "./app.py:graph"}}')
    traces = tmp_path / "traces"
    port = free_port()
    env = {**os.environ, "MARFT_LG_TRACE_DIR": str(traces), "LANGGRAPH_CLI_NO_ANALYTICS": "1"}
    langgraph = Path(sys.executable).parent / "langgraph"
    server = start_process([str(langgraph), "dev", "--config", "langgraph.json", "--host", "127.0.0.1", "--port",
                            str(port), "--no-browser", "--no-reload", "--allow-blocking"],
                           f"http://127.0.0.1:{port}/ok", tmp_path / "server.log", cwd=tmp_path, env=env, timeout_s=120)
    try:
        async def drive() -> tuple[dict, int, str]:
            from langgraph_sdk import get_client

            client = get_client(url=f"http://127.0.0.1:{port}")
            question = {"messages": [{"role": "user", "content": "solve it"}]}
            thread = await client.threads.create()
            out = await client.runs.wait(thread["thread_id"], "team", input=question,
                                         metadata={"scenario_id": "s-wait", "episode_id": "ep-wait"})
            thread2 = await client.threads.create()
            parts, run_id = 0, None
            async for part in client.runs.stream(thread2["thread_id"], "team", input=question,
                                                 stream_mode=["messages", "updates", "events"],
                                                 metadata={"scenario_id": "s-stream"}):
                parts += 1
                if part.event == "metadata":
                    run_id = part.data["run_id"]
            state = await client.threads.get_state(thread2["thread_id"])  # the server's checkpointer holds the thread
            assert state["values"]["messages"]
            return out, parts, run_id

        out, parts, run_id = asyncio.run(drive())
        assert out["messages"][-1]["content"] == "FINISH" and parts > 10
        deadline = time.monotonic() + 30
        while True:  # the server's process exports its spans on a short timer; a run's root span (its metadata)
            ds = mine([traces]) if traces.exists() else None  # ends last and may reach the file one export later
            if ds is not None and len(ds) == 2 and ds.episodes["scenario_id"].notna().all():
                break
            assert time.monotonic() < deadline, "the server's runs were not traced"
            time.sleep(1)
    finally:
        stop_server(server)
    episodes = ds.episodes.set_index("episode_id")
    assert set(episodes.index) == {"ep-wait", run_id}
    assert episodes.loc["ep-wait", "scenario_id"] == "s-wait" and episodes.loc[run_id, "scenario_id"] == "s-stream"
    acts = ds.actions
    assert acts.groupby("episode_id").size().tolist() == [10, 10]
    assert set(acts["agent"]) == {"supervisor", "researcher", "mathematician"}
