"""marft_lg.graph: route a LangGraph app's LLM calls to a Team's adapters and trace every episode."""

from marft_lg.graph.chat_model import TeamChatModel, UnmappedNodeError
from marft_lg.graph.wrap import WrappedGraph, wrap

__all__ = ["TeamChatModel", "UnmappedNodeError", "WrappedGraph", "wrap"]
