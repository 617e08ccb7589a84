"""support_team: planner -> researchers (Send fan-out, `lookup` tool) -> writer <-> critic, as a LangGraph app."""

from examples.support_team.app import SCENARIOS, build_graph, lookup

__all__ = ["SCENARIOS", "build_graph", "lookup"]
