"""Prebuilt agents as roles: a prebuilt agent graph nested in an app is one role, named after the agent.

LangGraph's `create_react_agent`, LangChain's `create_agent`, and the agents that `langgraph-supervisor`
and `langgraph-swarm` assemble from them run as subgraphs whose nodes (``agent`` / ``model``,
``tools``) would otherwise be traced as roles ``researcher|agent``. `prebuilt_agent_roles` finds
them in a compiled graph, recursively, and maps each of their nodes to the agent's name (the
compiled subgraph's ``name``, else the node it runs as). A custom nested subgraph is not a prebuilt
agent: its calls keep the ``outer|inner`` role unless `node_roles` maps them.
"""

from __future__ import annotations

import logging
from typing import Any

# The modules whose model-calling node makes a graph a prebuilt agent.
PREBUILT_MODEL_MODULES = ("langgraph.prebuilt.chat_agent_executor", "langchain.agents.factory")
DEFAULT_GRAPH_NAME = "LangGraph"
logger = logging.getLogger("marft_lg.graph")


def is_prebuilt_agent(graph: Any) -> bool:
    """Whether a compiled graph is a prebuilt agent (its model node is a prebuilt agent's)."""
    for node in (getattr(graph, "nodes", None) or {}).values():
        func = getattr(getattr(node, "bound", None), "func", None)
        if getattr(func, "__module__", None) in PREBUILT_MODEL_MODULES:
            return True
    return False


def prebuilt_agent_roles(graph: Any) -> dict[str, str]:
    """``{node path: agent name}`` for every node of every prebuilt agent in `graph` (itself included)."""
    found: list[tuple[str, Any]] = []
    if is_prebuilt_agent(graph) and getattr(graph, "name", DEFAULT_GRAPH_NAME) != DEFAULT_GRAPH_NAME:
        found.append(("", graph))
    try:
        subgraphs = list(graph.get_subgraphs(recurse=True))
    except Exception as exc:  # noqa: BLE001 - not a LangGraph graph, or one that cannot list its subgraphs
        logger.debug("marft_lg: no subgraphs listed for %r: %s", graph, exc)
        subgraphs = []
    found += [(ns, sub) for ns, sub in subgraphs if is_prebuilt_agent(sub)]
    roles: dict[str, str] = {}
    for ns, sub in sorted(found, key=lambda item: item[0].count("|") if item[0] else -1):  # inner agents win
        name = getattr(sub, "name", None)
        if not name or name == DEFAULT_GRAPH_NAME:
            name = ns.rsplit("|", 1)[-1]
        for node in sub.nodes:
            if not node.startswith("__"):
                roles[f"{ns}|{node}" if ns else node] = name
    return roles
