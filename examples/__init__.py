"""Example LangGraph apps that use marft_lg end to end (importable so tests and the demo can run them)."""
