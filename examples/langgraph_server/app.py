"""The supervisor_tools app, wrapped, for LangGraph's own API server (`langgraph dev` / `langgraph up`).

`langgraph.json` names `graph`: a wrapped app is a zero-argument graph factory for the server, which
runs the compiled graph it returns with marft_lg's tracer in its config. Every run the server makes
(`runs.wait`, `runs.stream` in any stream mode, threads on the server's checkpointer) is one episode;
its episode id is the run's `episode_id` metadata, else the server's run id, and its scenario id the
run's `scenario_id` metadata.
"""

from __future__ import annotations

import os
from pathlib import Path

from marft_lg import wrap
from marft_lg.loading import load_object

# the app as its author wrote it, next door
build_graph = load_object("../supervisor_tools/app.py:build_graph", base_dir=Path(__file__).resolve().parent)
graph = wrap(build_graph(), trace_dir=os.environ.get("MARFT_LG_TRACE_DIR", "traces"))
